"""Make Triton's CPU interpreter round like the GPU, for bit-exact kernel tests.

The interpreter (``TRITON_INTERPRET=1``) stores bfloat16 as raw 16-bit words and
converts float32 to bfloat16 by truncating the mantissa, where the GPU (and torch)
round to nearest even. Kernels whose contract is "round where Hugging Face rounds"
cannot be checked bit for bit under truncation; inside :func:`bf16_round_to_nearest`
the interpreter's float32-to-bfloat16 conversion rounds to nearest even instead.
float16 needs nothing: the interpreter computes it with numpy, which rounds correctly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

__all__ = ["bf16_round_to_nearest"]


@contextlib.contextmanager
def bf16_round_to_nearest() -> Iterator[bool]:
    """Within the context, the interpreter rounds float32 -> bfloat16 to nearest even.

    Yields ``True`` when the patch is in place, ``False`` when this Triton's
    interpreter has no conversion hook to patch (callers then compare within one
    bfloat16 unit in the last place instead of bit for bit).
    """
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        yield False
        return
    original = getattr(interpreter, "_convert_float", None)
    if original is None:
        yield False
        return

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            as_bf16 = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
            as_bf16 = as_bf16.to(torch.bfloat16)
            return as_bf16.view(torch.int16).numpy().view(np.uint16).reshape(np.shape(data))
        return original(data, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert
    try:
        yield True
    finally:
        interpreter._convert_float = original

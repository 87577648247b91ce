"""Make Triton's CPU interpreter round like the GPU, for bit-exact kernel tests.

The interpreter (``TRITON_INTERPRET=1``) stores bfloat16 as raw 16-bit words and
converts float32 to bfloat16 by truncating the mantissa, where the GPU (and torch)
round to nearest even. Kernels whose contract is "round where Hugging Face rounds"
cannot be checked bit for bit under truncation; inside :func:`bf16_round_to_nearest`
the interpreter's float32-to-bfloat16 conversion rounds to nearest even instead, and
inside :func:`fp8_round_to_nearest` its float32-to-e4m3 conversion too.
float16 needs nothing: the interpreter computes it with numpy, which rounds correctly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

__all__ = ["bf16_round_to_nearest", "fp8_round_to_nearest"]


@contextlib.contextmanager
def bf16_round_to_nearest() -> Iterator[bool]:
    """Within the context, the interpreter rounds float32 -> bfloat16 to nearest even.

    Yields ``True`` when the patch is in place, ``False`` when this Triton's
    interpreter has no conversion hook to patch (callers then compare within one
    bfloat16 unit in the last place instead of bit for bit).
    """
    with _torch_downcasts(("bfloat16",)) as patched:
        yield patched


@contextlib.contextmanager
def fp8_round_to_nearest() -> Iterator[bool]:
    """Within the context, the interpreter converts float32 -> float8 e4m3 (and ->
    bfloat16) as torch and the GPU do. Its own e4m3 rounding drops the carry into the
    exponent (125.6 becomes 64, not 128) and truncates subnormals. Yields as
    :func:`bf16_round_to_nearest`."""
    with _torch_downcasts(("bfloat16", "float8e4nv")) as patched:
        yield patched


@contextlib.contextmanager
def _torch_downcasts(names: tuple[str, ...]) -> Iterator[bool]:
    """The interpreter's float32 -> ``tl.<name>`` conversions done by torch instead."""
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
    torch_dtypes = {"bfloat16": (torch.bfloat16, np.uint16),
                    "float8e4nv": (torch.float8_e4m3fn, np.uint8)}
    targets = {getattr(tl, n): torch_dtypes[n] for n in names}

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype in targets:
            dtype, bits = targets[output_dtype]
            flat = np.ascontiguousarray(data, dtype=np.float32).reshape(-1)
            out = torch.from_numpy(flat).to(dtype).view(torch.uint8).numpy().view(bits)
            return out.reshape(np.shape(data))
        return original(data, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert
    try:
        yield True
    finally:
        interpreter._convert_float = original

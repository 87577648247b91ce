"""Float32 in-place RoPE of query and key heads for decode-sized inputs (C kernel).

Inside a model at batch 1 RoPE as torch ops (mul, flip, mul, add: ``RotaryEmbedding
.apply``) costs about 20 us per layer, mostly dispatch; ``rope.c`` rotates a row's
heads in place on the calling thread in well under a microsecond, with torch's
rounding (bit for bit). Full-width rotation only (``rotary_dim == head_dim``); inputs
of at most :data:`MAX_ROWS` rows.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch

from lmkit_kernels.cpu.build import bind_kernel_library
from lmkit_kernels.cpu.checks import require_float32_cpu, require_kernel

__all__ = ["MAX_ROWS", "rope_inplace", "rope_kernel", "rope_unavailable_reason"]

MAX_ROWS = 32  # decode batches
SOURCE = Path(__file__).with_name("rope.c")
ABI = 1
_P, _L = ctypes.c_void_p, ctypes.c_long

RopeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], None]


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    return bind_kernel_library(
        SOURCE, "lmkit_rope_abi", ABI, what="CPU RoPE kernel", fallback="torch ops",
        functions={"lmkit_rope_inplace": ([_P, _L, _P, _P, _L, _L, _L], None)})


def rope_unavailable_reason() -> str:
    """Why the kernel is not available (empty when it is)."""
    return _library()[1]


def rope_kernel() -> RopeFn | None:
    """The kernel without per-call checks (for a model's hot path), or ``None``.

    ``fn(x, cos, sin, num_heads)`` rotates the first ``num_heads`` heads of ``x [m,
    heads, dim]`` in place; the caller guarantees what :func:`rope_inplace` checks.
    """
    lib = _library()[0]
    if lib is None:
        return None
    rope = lib.lmkit_rope_inplace

    def run(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int) -> None:
        rope(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), x.shape[0],
             num_heads, x.shape[2])

    return run


def rope_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 num_heads: int | None = None) -> None:
    """Rotate the first ``num_heads`` (all when ``None``) heads of ``x: [m, heads,
    dim]`` in place (rows may be strided, heads contiguous)
    by ``cos``, ``sin``: contiguous ``[m, 1, dim]`` (``sin`` carrying the sign of
    "rotate half", as :meth:`RotaryEmbedding.cos_sin` returns them), ``m <=``
    :data:`MAX_ROWS`, ``dim`` even.

    Raises ``RuntimeError`` when the kernel is not available and ``ValueError`` for
    inputs it does not take.
    """
    fn = require_kernel(rope_kernel(), "CPU RoPE kernel", rope_unavailable_reason())
    if x.dim() != 3 or x.shape[0] > MAX_ROWS or x.shape[2] % 2:
        raise ValueError(f"rope_inplace takes [m <= {MAX_ROWS}, heads, even dim], "
                         f"got {tuple(x.shape)}")
    m, _, dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != dim:
        raise ValueError("rope_inplace: x's heads must be contiguous")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.numel() != m * dim or not t.is_contiguous():
            raise ValueError(f"rope_inplace: {name} must be a contiguous [{m}, 1, {dim}], "
                             f"got {tuple(t.shape)}")
    heads = x.shape[1] if num_heads is None else num_heads
    if not 0 <= heads <= x.shape[1]:
        raise ValueError(f"rope_inplace: num_heads={heads} is not within 0..{x.shape[1]}")
    require_float32_cpu("rope_inplace", x=x, cos=cos, sin=sin)
    fn(x, cos, sin, heads)

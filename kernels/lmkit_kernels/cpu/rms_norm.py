"""Float32 residual add + RMSNorm for decode-sized inputs on the CPU (C kernel).

Inside a model at batch 1 the torch ops (``x + residual``, ``F.rms_norm``) cost 15-30
us per call, two calls per decoder layer, mostly dispatch and thread hand-off after
the projections; ``rms_norm.c`` does a row in about 1 us on the calling thread. It is
used for inputs of at most :data:`MAX_ROWS` rows; larger ones keep torch.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch

from lmkit_kernels.cpu.build import bind_kernel_library
from lmkit_kernels.cpu.checks import require_float32_cpu, require_kernel

__all__ = ["MAX_ROWS", "add_rms_norm", "rms_norm_kernel", "rms_norm_unavailable_reason"]

MAX_ROWS = 32  # decode batches
SOURCE = Path(__file__).with_name("rms_norm.c")
ABI = 1
_P, _L = ctypes.c_void_p, ctypes.c_long

NormFn = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor, float],
                  "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    return bind_kernel_library(
        SOURCE, "lmkit_rms_norm_abi", ABI, what="CPU RMSNorm kernel", fallback="torch ops",
        functions={"lmkit_add_rms_norm": (
            [_P, _L, _P, _L, _P, ctypes.c_float, _P, _P, _L, _L], None)})


def rms_norm_unavailable_reason() -> str:
    """Why the kernel is not available (empty when it is)."""
    return _library()[1]


def rms_norm_kernel() -> NormFn | None:
    """The kernel without per-call checks (for a model's hot path), or ``None``.

    ``fn(x, residual, weight, eps)`` returns ``normed`` without a residual, else
    ``(normed, x + residual)``; the caller guarantees what :func:`add_rms_norm` checks.
    """
    lib = _library()[0]
    if lib is None:
        return None
    norm = lib.lmkit_add_rms_norm

    def run(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        m, n = x.shape
        if x.stride(1) != 1:
            x = x.contiguous()
        out = torch.empty(m, n, dtype=torch.float32)
        if residual is None:
            norm(x.data_ptr(), x.stride(0), None, 0, weight.data_ptr(), eps, out.data_ptr(),
                 None, m, n)
            return out
        if residual.stride(1) != 1:
            residual = residual.contiguous()
        summed = torch.empty(m, n, dtype=torch.float32)
        norm(x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0),
             weight.data_ptr(), eps, out.data_ptr(), summed.data_ptr(), m, n)
        return out, summed

    return run


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm(x) * weight``, or with ``residual`` ``(rms_norm(x + residual) * weight,
    x + residual)``, for float32 ``[m, n]`` CPU rows (``m <=`` :data:`MAX_ROWS`).

    Raises ``RuntimeError`` when the kernel is not available and ``ValueError`` for
    inputs it does not take.
    """
    fn = require_kernel(rms_norm_kernel(), "CPU RMSNorm kernel", rms_norm_unavailable_reason())
    if x.dim() != 2 or x.shape[0] > MAX_ROWS:
        raise ValueError(f"add_rms_norm takes [m <= {MAX_ROWS}, n] rows, got {tuple(x.shape)}")
    if weight.shape != (x.shape[1],) or not weight.is_contiguous():
        raise ValueError(f"add_rms_norm: weight must be a contiguous [{x.shape[1]}]")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} is not "
                         f"{tuple(x.shape)}")
    require_float32_cpu("add_rms_norm", x=x, weight=weight, residual=residual)
    return fn(x, residual, weight, eps)

"""The quantized GEMV with the layer's residual add + RMSNorm folded into its activation
quantization (``qgemv.c``'s ``lmkit_qgemv_norm_*``).

A pre-norm decoder layer feeds each of its two norms' outputs to one projection only
(the fused QKV, the fused gate-up). For decode batches the kernel quantizes the input
rows to int8 anyway, so the norm can run there, row by row, on the calling thread:
``y = (rms_norm(x + residual) * norm_weight) @ dequant(W).T + bias`` and the new
residual ``x + residual``, in one C call instead of the norm's own call and output.
The norm is computed by the same code as :mod:`lmkit_kernels.cpu.rms_norm` (same
formula, order and compiler flags), so ``y`` is bit-identical to the norm kernel
followed by :func:`lmkit_kernels.cpu.qgemv.bind_linear`'s function.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lmkit_kernels.cpu.checks import require_kernel
from lmkit_kernels.cpu.qgemv import MAX_ROWS, PackedWeight, _library

__all__ = ["MAX_ROWS", "NormLinearFn", "bind_norm_linear"]

# (x [m, k], residual [m, k] or None, norm weight [k], eps, bias) -> (y [m, n], new residual)
NormLinearFn = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor, float,
                         "torch.Tensor | None"], tuple[torch.Tensor, torch.Tensor]]


def bind_norm_linear(w: PackedWeight) -> NormLinearFn:
    """``(x, residual, norm_weight, eps, bias) -> (y, h)`` for one packed weight, with
    ``h = x + residual`` (``x`` itself without a residual) and ``y = (rms_norm(h) *
    norm_weight) @ dequant(w).T + bias``, for float32 CPU inputs of at most
    :data:`MAX_ROWS` rows with unit stride along ``k`` (the caller routes larger ones to
    the separate norm and projection); unchecked, like
    :func:`lmkit_kernels.cpu.qgemv.bind_linear`'s function."""
    lib, fns, reason = _library()
    isa = require_kernel(next(iter(fns), None), "CPU quantized GEMV kernel", reason)
    fn = getattr(lib, f"lmkit_qgemv_norm_{isa}")
    qtype, wptr, n, k = w.qtype, w.data.data_ptr(), w.n, w.k
    empty, threads, f32 = torch.empty, torch.get_num_threads, torch.float32

    def linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
               eps: float, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        m = x.shape[0]
        out = empty(m, n, dtype=f32)
        if residual is None:
            h, rptr, ldr, hptr = x, None, 0, None
        else:
            h = empty(m, k, dtype=f32)
            rptr, ldr, hptr = residual.data_ptr(), residual.stride(0), h.data_ptr()
        if fn(qtype, x.data_ptr(), x.stride(0), rptr, ldr, norm_weight.data_ptr(), eps, hptr,
              k, wptr, None if bias is None else bias.data_ptr(), out.data_ptr(), n, m, n, k,
              threads()):
            raise MemoryError("the quantized GEMV kernel could not allocate its int8 activations")
        return out, h

    return linear

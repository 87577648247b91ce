"""The quantized GEMV with the layer's input transform folded into its activation
quantization: the residual add + RMSNorm (``qgemv.c``'s ``lmkit_qgemv_norm_*``,
:func:`bind_norm_linear`) or SiLU-and-multiply (``lmkit_qgemv_silu_avx512vnni``,
:func:`bind_silu_linear`).

A pre-norm decoder layer feeds each of its two norms' outputs to one projection only
(the fused QKV, the fused gate-up). For decode batches the kernel quantizes the input
rows to int8 anyway, so the norm can run there, row by row, on the calling thread:
``y = (rms_norm(x + residual) * norm_weight) @ dequant(W).T + bias`` and the new
residual ``x + residual``, in one C call instead of the norm's own call and output.
The norm is computed by the same code as :mod:`lmkit_kernels.cpu.rms_norm` (same
formula, order and compiler flags), so ``y`` is bit-identical to the norm kernel
followed by :func:`lmkit_kernels.cpu.qgemv.bind_linear`'s function.

A gated MLP's down projection reads ``silu(gate) * up`` of the gate-up output only; the
folded kernel computes it while quantizing, with the same arithmetic as torch's
AVX-512 CPU ``silu`` (``gate / (1 + exp(-gate))`` with the Sleef ``expf`` torch links,
whose address is looked up in torch's library), so the result is bit-identical to
``F.silu(gate) * up`` then the GEMV. It is offered only where that holds: torch runs
its AVX-512 kernels, exports ``Sleef_expf16_u10``, and the AVX-512 VNNI build is in use.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable

import torch

from lmkit_kernels.cpu.checks import require_kernel
from lmkit_kernels.cpu.qgemv import MAX_ROWS, PackedWeight, _library

__all__ = ["MAX_ROWS", "NormLinearFn", "SiluLinearFn", "bind_norm_linear", "bind_silu_linear"]

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


# (gate_up [m, 2k], bias) -> (silu(gate) * up) @ dequant(W).T + bias
SiluLinearFn = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]


@functools.cache
def _torch_exp16() -> int | None:
    """The address of the Sleef ``expf`` torch's AVX-512 ``silu`` runs, or ``None``."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return None
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        return ctypes.cast(ctypes.CDLL(path).Sleef_expf16_u10, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def bind_silu_linear(w: PackedWeight) -> SiluLinearFn | None:
    """``(gate_up, bias) -> (silu(gate) * up) @ dequant(w).T + bias`` for one packed
    weight (``gate_up`` ``[m, 2 * w.k]``: gate then up per row; float32 CPU, at most
    :data:`MAX_ROWS` rows, unit stride along the row), bit-identical to torch's
    ``F.silu(gate) * up`` then :func:`lmkit_kernels.cpu.qgemv.bind_linear`'s function;
    ``None`` where that cannot hold (see the module docstring). Unchecked."""
    lib, fns, _ = _library()
    exp16 = _torch_exp16()
    if lib is None or exp16 is None or next(iter(fns), None) != "avx512vnni" or w.k % 16:
        return None
    fn = lib.lmkit_qgemv_silu_avx512vnni
    qtype, wptr, n, k = w.qtype, w.data.data_ptr(), w.n, w.k
    empty, threads, f32 = torch.empty, torch.get_num_threads, torch.float32

    def linear(gate_up: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        m = gate_up.shape[0]
        out = empty(m, n, dtype=f32)
        if fn(qtype, exp16, gate_up.data_ptr(), gate_up.stride(0), wptr,
              None if bias is None else bias.data_ptr(), out.data_ptr(), n, m, n, k, threads()):
            raise MemoryError("the quantized GEMV kernel could not allocate its int8 activations")
        return out

    return linear


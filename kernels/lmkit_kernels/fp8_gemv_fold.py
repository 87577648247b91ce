"""The one-row FP8 product with its input transform folded in: ``rms_norm(x +
residual) @ W.T`` and ``(silu(gate) * up) @ W.T`` with FP8 e4m3 weights and
per-channel scales, one kernel each (the batch-1 decode step's QKV / gate-up and down
projections, without the separate residual-add + RMSNorm and SiLU-and-multiply
kernels and their launches).

Both run :mod:`lmkit_kernels.fp8_gemv`'s one-row kernel: each program streams
``BLOCK_N`` weight rows over the whole ``K`` and computes the transform itself on every
``BLOCK_K`` slice of the input it reads (a few KiB, in L2). The transform rounds
exactly where the separate kernels round (:mod:`lmkit_kernels.norm`,
:mod:`lmkit_kernels.activation`), and the products and sums are the plain kernel's
with the same ``block_k``: the result is that of the separate kernels followed by
:func:`~lmkit_kernels.fp8_gemv.fp8_row_linear`, bit for bit in Triton's interpreter
and on the GPU up to the order of the norm's float32 sum of squares.

RMSNorm needs ``1 / rms`` before the first product: every program computes it in a
prologue (one pass over the row); the residual sum ``x + residual``, the next layer's
residual stream, is stored by program 0 alone.
"""

from __future__ import annotations

import torch

from lmkit_kernels.activation import silu_and_mul_ref
from lmkit_kernels.checks import check_tensor
from lmkit_kernels.fp8 import fp8_linear_ref
from lmkit_kernels.fp8_gemv import ROW_TILES, check_row_launch, launch_row_kernel
from lmkit_kernels.gemv_fold import check_norm_inputs
from lmkit_kernels.norm import rms_norm_ref

__all__ = ["norm_fp8_row_linear", "norm_fp8_row_linear_ref", "silu_mul_fp8_row_linear",
           "silu_mul_fp8_row_linear_ref"]


def norm_fp8_row_linear(x: torch.Tensor, residual: torch.Tensor | None,
                        norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                        weight_scale: torch.Tensor, bias: torch.Tensor | None = None, *,
                        block_n: int = ROW_TILES[0], block_k: int = ROW_TILES[1],
                        num_warps: int = ROW_TILES[2], pipeline: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(h) @ (weight * weight_scale[:, None]).T (+ bias), h)`` with ``h = x +
    residual`` (``x`` when ``residual`` is None), for one row: the result of
    :func:`lmkit_kernels.norm.rms_norm` then :func:`~lmkit_kernels.fp8_gemv.fp8_row_linear`
    with the same tiles, in one kernel.

    :param x: ``[1, K]``, float16 or bfloat16, unit last stride.
    :param residual: optional ``[1, K]`` in ``x``'s dtype, unit last stride.
    :param norm_weight: ``[K]`` in ``x``'s dtype, contiguous.
    :param eps: added to the mean square before the reciprocal square root.
    :param weight: ``[N, K]`` float8_e4m3fn, unit last stride; ``weight_scale`` float32
        ``[N]``; ``bias`` optional ``[N]`` in ``x``'s dtype.
    :param block_n: weight rows per program, ``block_k``: ``K`` slice per iteration
        (powers of two); ``pipeline``: as :func:`~lmkit_kernels.fp8_gemv.fp8_row_linear`.
    :return: a new ``[1, N]`` tensor and the residual sum (a new ``[1, K]`` tensor, or
        ``x`` itself without ``residual``); inputs are not modified.
    :raises ValueError: on a shape, dtype, device or stride mismatch, or more than one row.
    """
    k = x.shape[-1]
    n = check_row_launch(x, weight, weight_scale, bias, k, block_n, block_k,
                         "norm_fp8_row_linear")
    res_out = check_norm_inputs(x, residual, norm_weight)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    launch_row_kernel("norm", x, weight, weight_scale, bias, out, k, residual=residual,
                      norm_weight=norm_weight, res_out=res_out, eps=eps, block_n=block_n,
                      block_k=block_k, num_warps=num_warps, pipeline=pipeline)
    return out, (res_out if res_out is not None else x)


def silu_mul_fp8_row_linear(gate_up: torch.Tensor, weight: torch.Tensor,
                            weight_scale: torch.Tensor, bias: torch.Tensor | None = None, *,
                            block_n: int = ROW_TILES[0], block_k: int = ROW_TILES[1],
                            num_warps: int = ROW_TILES[2], pipeline: bool = False
                            ) -> torch.Tensor:
    """``(silu(gate) * up) @ (weight * weight_scale[:, None]).T (+ bias)`` for one row
    ``gate_up = [gate | up]``: the result of :func:`lmkit_kernels.activation.silu_and_mul`
    then :func:`~lmkit_kernels.fp8_gemv.fp8_row_linear` with the same tiles, in one kernel.

    :param gate_up: ``[1, 2 * I]``, float16 or bfloat16, unit last stride.
    :param weight: ``[N, I]`` float8_e4m3fn, unit last stride; ``weight_scale`` float32
        ``[N]``; ``bias`` optional ``[N]`` in ``gate_up``'s dtype.
    :return: a new ``[1, N]`` tensor in ``gate_up``'s dtype.
    :raises ValueError: on a shape, dtype, device or stride mismatch, an odd width, or
        more than one row.
    """
    check_tensor("gate_up", gate_up, ndim=2, dtypes=(torch.float16, torch.bfloat16),
                 last_dim_contiguous=True)
    width = gate_up.shape[1]
    if width % 2:
        raise ValueError(f"gate_up must have an even last dimension (gate, then up); got {width}")
    k = width // 2
    n = check_row_launch(gate_up, weight, weight_scale, bias, k, block_n, block_k,
                         "silu_mul_fp8_row_linear", "gate_up")
    out = torch.empty((1, n), dtype=gate_up.dtype, device=gate_up.device)
    launch_row_kernel("silu_mul", gate_up, weight, weight_scale, bias, out, k,
                      block_n=block_n, block_k=block_k, num_warps=num_warps,
                      pipeline=pipeline)
    return out


def norm_fp8_row_linear_ref(x: torch.Tensor, residual: torch.Tensor | None,
                            norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                            weight_scale: torch.Tensor, bias: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of :func:`norm_fp8_row_linear`."""
    out = rms_norm_ref(x, norm_weight, eps, residual)
    normed, h = out if isinstance(out, tuple) else (out, x)
    return fp8_linear_ref(normed, weight, weight_scale, bias), h


def silu_mul_fp8_row_linear_ref(gate_up: torch.Tensor, weight: torch.Tensor,
                                weight_scale: torch.Tensor, bias: torch.Tensor | None = None
                                ) -> torch.Tensor:
    """The torch reference of :func:`silu_mul_fp8_row_linear`."""
    return fp8_linear_ref(silu_and_mul_ref(gate_up), weight, weight_scale, bias)

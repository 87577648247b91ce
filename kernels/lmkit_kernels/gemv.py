"""``x @ weight.T`` for a handful of rows (decode at small batch): a weight-streaming
kernel.

At batch 1-16 a projection is a matrix-vector product bound by reading the weight
once. This kernel gives each program ``BLOCK_N`` output columns (weight rows) and
streams their full ``K`` extent through shared memory in ``BLOCK_K`` slices, with the
(at most 16) input rows padded to one 16-row ``tl.dot`` tile. Enough programs to fill
the GPU come from a small ``BLOCK_N`` rather than from splitting ``K``, so there is no
reduction pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmkit_kernels.checks import check_scale_and_bias, check_shape, check_tensor, dot_needs_f32
from lmkit_kernels.pdl import pdl_launch_args, pdl_wait, prefetch_args, prefetch_weight_rows

__all__ = ["MAX_ROWS", "small_m_linear", "small_m_linear_ref"]

MAX_ROWS = 16
HALF_DTYPES = (torch.float16, torch.bfloat16)


@triton.jit
def _small_m_linear_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, s_ptr=None, HAS_SCALE: tl.constexpr = False,
    USE_PDL: tl.constexpr = False, PF_LINE: tl.constexpr = 1, PF_LINES: tl.constexpr = 0,
):
    # program n: out[:, n * BLOCK_N:(n + 1) * BLOCK_N] over the whole K
    pid = tl.program_id(0)
    rows = tl.arange(0, 16)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    x_base = x_ptr + rows[:, None] * stride_xm
    w_base = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    prefetch_weight_rows(w_ptr, cols, N, K, stride_wn, PF_LINE, PF_LINES)
    pdl_wait(USE_PDL)  # the weights are the step's constants; x is the previous kernel's
    for k in range(0, K, BLOCK_K):
        k_ok = (k + ks) < K
        x = tl.load(x_base + (k + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + (k + ks)[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if HAS_SCALE:  # FP8 weights: converted to the activations' dtype for the dot
            w = w.to(x.dtype)
        if DOT_F32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_SCALE:  # per-output-channel weight scales, float32 [N]
        acc *= tl.load(s_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                   block_n: int = 16, block_k: int = 512, num_warps: int = 4,
                   num_stages: int = 4, weight_scale: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for at most :data:`MAX_ROWS` rows of ``x``.

    :param x: ``[M, K]``, float16 or bfloat16, ``M <= 16``, unit last stride.
    :param weight: ``[N, K]`` in ``x``'s dtype, unit last stride (the usual layout);
        float8_e4m3fn with ``weight_scale``.
    :param bias: optional ``[N]``.
    :param weight_scale: float32 ``[N]``, contiguous: FP8 weights' per-output-channel
        scales (``out = x @ (weight * weight_scale[:, None]).T``).
    :param block_n: output columns per program (a power of two >= 16).
    :param block_k: ``K`` slice per loop iteration (a power of two >= 16).
    :return: a new ``[M, N]`` tensor in ``x``'s dtype (float32 accumulation).
    :raises ValueError: on a shape, dtype, device or stride mismatch, or ``M > 16``.
    """
    check_tensor("x", x, ndim=2, dtypes=HALF_DTYPES, last_dim_contiguous=True)
    m, k = x.shape
    if m > MAX_ROWS:
        raise ValueError(f"small_m_linear takes at most {MAX_ROWS} rows, got {m}; use F.linear")
    check_tensor("weight", weight, ndim=2, device=x.device, last_dim_contiguous=True,
                 dtypes=(x.dtype,) if weight_scale is None else (torch.float8_e4m3fn,))
    check_shape("weight", weight, (None, k))
    n = weight.shape[0]
    check_scale_and_bias(x, n, weight_scale, bias)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        _small_m_linear_kernel[(triton.cdiv(n, block_n),)](
            x, weight, bias if bias is not None else weight, out, m, n, k,
            x.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
            DOT_F32=dot_needs_f32(x.dtype), num_warps=num_warps, num_stages=num_stages,
            s_ptr=weight_scale, HAS_SCALE=weight_scale is not None,
            **prefetch_args(weight, block_k), **pdl_launch_args(x.device),
        )
    return out


def small_m_linear_ref(x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference of :func:`small_m_linear` (float32 accumulation)."""
    out = x.float() @ weight.float().T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)

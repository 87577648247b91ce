"""``x @ weight.T`` for a handful of rows (decode at small batch): a weight-streaming
kernel.

At batch 1-16 a projection is a matrix-vector product bound by reading the weight
once. This kernel gives each program ``BLOCK_N`` output columns (weight rows) and
streams their full ``K`` extent through shared memory in ``BLOCK_K`` slices, with the
(at most 16) input rows padded to one 16-row ``tl.dot`` tile. Enough programs to fill
the GPU come from a small ``BLOCK_N`` rather than from splitting ``K``, so there is no
reduction pass.

With ``glu_out`` the weight is a fused gate-up projection ``[gate | up]`` (``2 I`` rows)
and the kernel stores SwiGLU's ``silu(gate) * up`` (``I`` columns) instead of the
gate-up output: each program's tile interleaves gate rows with the up rows of the same
columns, so both halves of an output column meet in one program's accumulator and
the activation runs in its epilogue, with no separate kernel and no gate-up tensor.
The gate and up values are rounded to the output dtype first and the activation
rounds as :func:`lmkit_kernels.activation.silu_and_mul` does, so the result is that
kernel's after :func:`small_m_linear` (each output column's sum over ``K`` runs over
the same slices whichever tile row holds it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from lmkit_kernels.checks import (
    check_scale_and_bias,
    check_shape,
    check_tensor,
    dot_needs_f32,
    is_interpreting,
)
from lmkit_kernels.pdl import pdl_launch_args, pdl_wait, prefetch_args, prefetch_weight_rows

__all__ = ["MAX_ROWS", "glu_store", "glu_tile_rows", "glu_width", "small_m_linear",
           "small_m_linear_ref"]

MAX_ROWS = 16
HALF_DTYPES = (torch.float16, torch.bfloat16)


@triton.jit
def glu_tile_rows(pid, N, BLOCK_N: tl.constexpr, GLU_OUT: tl.constexpr):
    """The weight rows of program ``pid``'s tile and which are real: ``BLOCK_N``
    consecutive rows, or with ``GLU_OUT`` (``N = 2 I`` rows ``[gate | up]``) gate row
    ``j`` at even and up row ``I + j`` at odd tile columns, for ``j`` in the program's
    ``BLOCK_N / 2`` output columns."""
    c = tl.arange(0, BLOCK_N)
    if GLU_OUT:
        j = pid * (BLOCK_N // 2) + c // 2
        half = N // 2
        return j + (c % 2) * half, j < half
    cols = pid * BLOCK_N + c
    return cols, cols < N


@triton.jit
def glu_store(acc, out_ptr, rows, row_ok, pid, N, stride_om, BLOCK_N: tl.constexpr,
              ACCURATE_EXP: tl.constexpr):
    """Store ``silu(gate) * up`` of a :func:`glu_tile_rows` tile's float32 accumulator
    ``[16, BLOCK_N]`` (gate and up interleaved) into output columns ``pid * BLOCK_N / 2
    ..``, rounded as the gate-up output and :mod:`lmkit_kernels.activation` round."""
    y = acc.to(out_ptr.dtype.element_ty)  # the gate-up projection's output
    gate, up = tl.split(tl.reshape(y, (16, BLOCK_N // 2, 2)))
    gate = gate.to(tl.float32)
    if ACCURATE_EXP:  # libdevice expf, as torch's CUDA kernel (tl.exp is ex2.approx)
        e = libdevice.exp(-gate)
    else:  # the CPU interpreter: numpy's exp
        e = tl.exp(-gate)
    act = tl.math.div_rn(gate, 1.0 + e).to(out_ptr.dtype.element_ty)
    out = (act.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
    j = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    tl.store(out_ptr + rows[:, None] * stride_om + j[None, :], out,
             mask=row_ok[:, None] & (j < N // 2)[None, :])


@triton.jit
def _small_m_linear_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, s_ptr=None, HAS_SCALE: tl.constexpr = False,
    USE_PDL: tl.constexpr = False, PF_LINE: tl.constexpr = 1, PF_LINES: tl.constexpr = 0,
    GLU_OUT: tl.constexpr = False, ACCURATE_EXP: tl.constexpr = True,
):
    # program n: out[:, n * BLOCK_N:(n + 1) * BLOCK_N] over the whole K (GLU_OUT: the
    # tile of glu_tile_rows, stored as silu(gate) * up)
    pid = tl.program_id(0)
    rows = tl.arange(0, 16)
    cols, col_ok = glu_tile_rows(pid, N, BLOCK_N, GLU_OUT)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
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
    if GLU_OUT:
        glu_store(acc, out_ptr, rows, row_ok, pid, N, stride_om, BLOCK_N, ACCURATE_EXP)
    else:
        out = out_ptr + rows[:, None] * stride_om + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def glu_width(n: int, glu_out: bool) -> int:
    """The output columns of a projection with ``n`` outputs: ``n / 2`` with ``glu_out``.

    :raises ValueError: ``glu_out`` with an odd ``n`` (not a ``[gate | up]`` weight).
    """
    if not glu_out:
        return n
    if n % 2:
        raise ValueError(f"glu_out needs a [gate | up] weight with an even number of rows, "
                         f"got {n}")
    return n // 2


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                   block_n: int = 16, block_k: int = 512, num_warps: int = 4,
                   num_stages: int = 4, weight_scale: torch.Tensor | None = None,
                   glu_out: bool = False) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for at most :data:`MAX_ROWS` rows of ``x``; with
    ``glu_out``, ``silu(gate) * up`` of that output ``[gate | up]`` (module docstring).

    :param x: ``[M, K]``, float16 or bfloat16, ``M <= 16``, unit last stride.
    :param weight: ``[N, K]`` in ``x``'s dtype, unit last stride (the usual layout);
        float8_e4m3fn with ``weight_scale``.
    :param bias: optional ``[N]``.
    :param weight_scale: float32 ``[N]``, contiguous: FP8 weights' per-output-channel
        scales (``out = x @ (weight * weight_scale[:, None]).T``).
    :param block_n: output columns per program (a power of two >= 16).
    :param block_k: ``K`` slice per loop iteration (a power of two >= 16).
    :param glu_out: store ``silu(out[:, :N/2]) * out[:, N/2:]`` (``N`` even).
    :return: a new ``[M, N]`` tensor (``[M, N / 2]`` with ``glu_out``) in ``x``'s dtype
        (float32 accumulation).
    :raises ValueError: on a shape, dtype, device or stride mismatch, ``M > 16``, or an
        odd ``N`` with ``glu_out``.
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
    out = torch.empty((m, glu_width(n, glu_out)), dtype=x.dtype, device=x.device)
    if m and n:
        _small_m_linear_kernel[(triton.cdiv(n, block_n),)](
            x, weight, bias if bias is not None else weight, out, m, n, k,
            x.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
            DOT_F32=dot_needs_f32(x.dtype), num_warps=num_warps, num_stages=num_stages,
            s_ptr=weight_scale, HAS_SCALE=weight_scale is not None,
            GLU_OUT=glu_out, ACCURATE_EXP=not is_interpreting(),
            **prefetch_args(weight, block_k), **pdl_launch_args(x.device),
        )
    return out


def small_m_linear_ref(x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None = None, glu_out: bool = False) -> torch.Tensor:
    """The torch reference of :func:`small_m_linear` (float32 accumulation)."""
    out = x.float() @ weight.float().T
    if bias is not None:
        out = out + bias.float()
    out = out.to(x.dtype)
    if glu_out:
        gate, up = out.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    return out

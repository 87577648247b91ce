"""``x @ (W * s[:, None]).T`` for one row of ``x`` with FP8 (e4m3) weights: the batch-1
decode product, without tensor cores.

:func:`lmkit_kernels.gemv.small_m_linear` pads its rows to a 16-row ``tl.dot`` tile and
stages the activations beside the weight in shared memory: with FP8 weights the
padded activation tile is as large as the weight tile, so few programs fit on an SM
and small projections leave SMs idle (on an H100, Llama-8B's QKV and output
projections read their weight at about half the copy bandwidth). One row needs no
tile: each program keeps ``BLOCK_N`` weight rows' partial products for a ``BLOCK_K``
slice in registers (``w * x`` element by element, float32), sums them once at the
end and scales by the rows' per-channel scales. Without shared memory, narrow programs
(16 rows by default) are many and several fit on each SM.

The same kernel also runs with the projection's input transform folded in
(:mod:`lmkit_kernels.fp8_gemv_fold`: residual add + RMSNorm, SiLU-and-multiply), and
launches with programmatic dependent launch (:mod:`lmkit_kernels.pdl`: each program
asks for its first weight slice before it waits for the previous kernel). With
``pipeline`` each program issues the loads of the next ``block_k`` slice before it
accumulates the current one (two slices in flight per program; the same sums in the
same order, so the same result).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmkit_kernels.checks import (
    check_scale_and_bias,
    check_shape,
    check_tensor,
    is_interpreting,
    next_power_of_2,
)
from lmkit_kernels.gemv_fold import _normed_tile, _silu_mul_tile
from lmkit_kernels.pdl import pdl_launch_args, pdl_wait, prefetch_args, prefetch_weight_rows

__all__ = ["ROW_TILES", "check_row_launch", "fp8_row_linear", "launch_row_kernel"]

HALF_DTYPES = (torch.float16, torch.bfloat16)
#: default launch: (block_n, block_k, num_warps); the fastest summed over Llama-8B's four
#: projections on an H100 (``bench/gemv_bandwidth.py --fp8 --rows 1``, session 11: 94.7
#: us per layer against 107.3 for the tiled GEMV's best launches)
ROW_TILES = (8, 1024, 4)
#: the folded norm's prologue reads the row in slices of at most this many elements
#: (as :mod:`lmkit_kernels.gemv_fold`)
MAX_NORM_BLOCK = 8192
#: what the kernel's input is: the row itself, or the transform folded into the product
MODES = {"plain": 0, "norm": 1, "silu_mul": 2}


@triton.jit
def _mul_rn(a, b, GPU_MATH: tl.constexpr):
    # a * b rounded to nearest, never contracted into an FMA with a following add (PTX
    # does not contract instructions with an explicit rounding mode); the interpreter's
    # numpy multiply is that already
    if GPU_MATH:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return a * b


@triton.jit
def _row_rstd(x_ptr, res_ptr, res_out_ptr, K, inv_k, eps, HAS_RESIDUAL: tl.constexpr,
              NORM_BLOCK: tl.constexpr, GPU_MATH: tl.constexpr):
    # 1 / rms of the row x (+ residual), rounded as lmkit_kernels.norm rounds (its kernel
    # compiles without FMA contraction; this one contracts the main loop's products as
    # the plain one-row kernel does, so the norm's products are explicit round-to-nearest
    # multiplies on the GPU); with a residual, program 0 also stores the rounded sum
    cs = tl.arange(0, NORM_BLOCK)
    store_end = tl.where(tl.program_id(0) == 0, K, 0)  # (a mask bound: the interpreter
    # rejects a vector mask and-ed with a scalar one)
    ss = tl.zeros((1,), dtype=tl.float32)
    for k in range(0, K, NORM_BLOCK):
        ok = (k + cs) < K
        h = tl.load(x_ptr + k + cs, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + k + cs, mask=ok, other=0.0)
            h = (h.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(res_out_ptr + k + cs, h, mask=(k + cs) < store_end)
        hf = h.to(tl.float32)
        ss += tl.sum(_mul_rn(hf, hf, GPU_MATH), axis=0)
    return tl.rsqrt(_mul_rn(ss, inv_k, GPU_MATH) + eps)


@triton.jit
def _input_slice(x_ptr, res_ptr, g_ptr, ks, k_ok, K, rstd, MODE: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr, GPU_MATH: tl.constexpr):
    # [1, BLOCK_K] of the product's input, float32: x itself (MODE 0), rms_norm(x +
    # residual) * g (1), silu(gate) * up (2), each rounded to x's dtype where the
    # separate kernels round
    row = tl.arange(0, 1)
    row_ok = row < 1
    if MODE == 1:
        a = _normed_tile(x_ptr, res_ptr, g_ptr, row, ks, row_ok, k_ok, rstd, 0, 0,
                         HAS_RESIDUAL)
    elif MODE == 2:
        a = _silu_mul_tile(x_ptr, row, ks, row_ok, k_ok, 0, K, GPU_MATH)
    else:
        a = tl.load(x_ptr + ks, mask=k_ok, other=0.0)[None, :]
    return a.to(tl.float32)


@triton.jit
def _fp8_row_kernel(
    x_ptr, res_ptr, g_ptr, w_ptr, s_ptr, b_ptr, out_ptr, res_out_ptr, N, K, stride_wn,
    inv_k, eps, MODE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PIPELINE: tl.constexpr,
    NORM_BLOCK: tl.constexpr, GPU_MATH: tl.constexpr, USE_PDL: tl.constexpr,
    PF_LINE: tl.constexpr, PF_LINES: tl.constexpr,
):
    # program n: out[n * BLOCK_N:(n + 1) * BLOCK_N] = s * (W[rows] @ a) (+ bias), a the
    # input row (MODE 0) or its transform (see _input_slice)
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    w_base = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    prefetch_weight_rows(w_ptr, cols, N, K, stride_wn, PF_LINE, PF_LINES)
    pdl_wait(USE_PDL)  # the weights are the step's constants; x is the previous kernel's
    rstd = tl.zeros((1,), dtype=tl.float32)
    if MODE == 1:
        rstd += _row_rstd(x_ptr, res_ptr, res_out_ptr, K, inv_k, eps, HAS_RESIDUAL,
                          NORM_BLOCK, GPU_MATH)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if PIPELINE:
        # the next slice's loads are issued before the current slice's products: two
        # slices per program in flight (the same sums, in the same order)
        k_ok = ks < K
        a = _input_slice(x_ptr, res_ptr, g_ptr, ks, k_ok, K, rstd, MODE, HAS_RESIDUAL,
                         GPU_MATH)
        w = tl.load(w_base + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        for k in range(BLOCK_K, K, BLOCK_K):
            k_ok = (k + ks) < K
            a_next = _input_slice(x_ptr, res_ptr, g_ptr, k + ks, k_ok, K, rstd, MODE,
                                  HAS_RESIDUAL, GPU_MATH)
            w_next = tl.load(w_base + (k + ks)[None, :],
                             mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc += w.to(tl.float32) * a
            a, w = a_next, w_next
        acc += w.to(tl.float32) * a
    else:
        for k in range(0, K, BLOCK_K):
            k_ok = (k + ks) < K
            a = _input_slice(x_ptr, res_ptr, g_ptr, k + ks, k_ok, K, rstd, MODE,
                             HAS_RESIDUAL, GPU_MATH)
            w = tl.load(w_base + (k + ks)[None, :], mask=col_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            acc += w * a
    out = tl.sum(acc, axis=1) * tl.load(s_ptr + cols, mask=col_ok, other=0.0)
    if HAS_BIAS:
        out += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=col_ok)


def check_row_launch(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None, k: int, block_n: int, block_k: int,
                     what: str, x_name: str = "x") -> int:
    """Check a one-row launch's ``x`` (``[1, *]``), FP8 ``weight`` (``[N, k]``), scales,
    bias and tiles; return ``N``.

    :raises ValueError: on a shape, dtype, device or stride mismatch, or more than one row.
    """
    check_tensor(x_name, x, ndim=2, dtypes=HALF_DTYPES, last_dim_contiguous=True)
    if x.shape[0] != 1:
        raise ValueError(f"{what} takes one row, got {x.shape[0]}; use small_m_linear")
    check_tensor("weight", weight, ndim=2, device=x.device, last_dim_contiguous=True,
                 dtypes=(torch.float8_e4m3fn,))
    check_shape("weight", weight, (None, k))
    n = weight.shape[0]
    check_scale_and_bias(x, n, weight_scale, bias)
    for name, value in (("block_n", block_n), ("block_k", block_k)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {value}")
    return n


def launch_row_kernel(mode: str, x: torch.Tensor, weight: torch.Tensor,
                      weight_scale: torch.Tensor, bias: torch.Tensor | None,
                      out: torch.Tensor, k: int, *, residual: torch.Tensor | None = None,
                      norm_weight: torch.Tensor | None = None,
                      res_out: torch.Tensor | None = None, eps: float = 0.0, block_n: int,
                      block_k: int, num_warps: int, pipeline: bool) -> None:
    """Launch the one-row kernel over checked arguments (:func:`fp8_row_linear`,
    :mod:`lmkit_kernels.fp8_gemv_fold`): ``mode`` one of :data:`MODES`, ``k`` the
    product's inner size, ``res_out`` where program 0 stores ``x + residual``."""
    n = out.shape[1]
    if not n and res_out is None:
        return
    _fp8_row_kernel[(max(1, triton.cdiv(n, block_n)),)](
        x, residual if residual is not None else x,
        norm_weight if norm_weight is not None else x, weight, weight_scale,
        bias if bias is not None else weight_scale, out,
        res_out if res_out is not None else x, n, k, weight.stride(0),
        1.0 / k if k else 0.0, float(eps), MODE=MODES[mode],
        HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, BLOCK_N=block_n,
        BLOCK_K=block_k, PIPELINE=pipeline,
        NORM_BLOCK=min(max(16, next_power_of_2(k)), MAX_NORM_BLOCK),
        GPU_MATH=not is_interpreting(), num_warps=num_warps,
        **prefetch_args(weight, block_k), **pdl_launch_args(x.device))


def fp8_row_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None, *, block_n: int = ROW_TILES[0],
                   block_k: int = ROW_TILES[1], num_warps: int = ROW_TILES[2],
                   pipeline: bool = False) -> torch.Tensor:
    """``x @ (weight * weight_scale[:, None]).T (+ bias)`` for one row of ``x``.

    :param x: ``[1, K]``, float16 or bfloat16, unit last stride.
    :param weight: ``[N, K]`` float8_e4m3fn, unit last stride.
    :param weight_scale: float32 ``[N]``, contiguous (per output channel).
    :param bias: optional ``[N]`` in ``x``'s dtype.
    :param block_n: weight rows per program, ``block_k``: ``K`` slice per iteration
        (powers of two).
    :param pipeline: issue the next slice's loads before the current slice's products
        (the same result).
    :return: a new ``[1, N]`` tensor in ``x``'s dtype (float32 accumulation: products
        summed per slice position over the slices, then across the slice).
    :raises ValueError: on a shape, dtype, device or stride mismatch, or more than one row.
    """
    k = x.shape[-1]
    n = check_row_launch(x, weight, weight_scale, bias, k, block_n, block_k, "fp8_row_linear")
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    launch_row_kernel("plain", x, weight, weight_scale, bias, out, k, block_n=block_n,
                      block_k=block_k, num_warps=num_warps, pipeline=pipeline)
    return out

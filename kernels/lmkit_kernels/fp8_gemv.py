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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmkit_kernels.checks import check_scale_and_bias, check_shape, check_tensor

__all__ = ["ROW_TILES", "fp8_row_linear"]

HALF_DTYPES = (torch.float16, torch.bfloat16)
#: default launch: (block_n, block_k, num_warps); the fastest summed over Llama-8B's four
#: projections on an H100 (``bench/gemv_bandwidth.py --fp8 --rows 1``, session 11: 94.7
#: us per layer against 107.3 for the tiled GEMV's best launches)
ROW_TILES = (8, 1024, 4)


@triton.jit
def _fp8_row_linear_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, N, K, stride_wn,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # program n: out[n * BLOCK_N:(n + 1) * BLOCK_N] = s * (W[rows] @ x) (+ bias)
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    w_base = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = (k + ks) < K
        x = tl.load(x_ptr + k + ks, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_base + (k + ks)[None, :], mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += w * x[None, :]
    out = tl.sum(acc, axis=1) * tl.load(s_ptr + cols, mask=col_ok, other=0.0)
    if HAS_BIAS:
        out += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=col_ok)


def fp8_row_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None, *, block_n: int = ROW_TILES[0],
                   block_k: int = ROW_TILES[1], num_warps: int = ROW_TILES[2]
                   ) -> torch.Tensor:
    """``x @ (weight * weight_scale[:, None]).T (+ bias)`` for one row of ``x``.

    :param x: ``[1, K]``, float16 or bfloat16, unit last stride.
    :param weight: ``[N, K]`` float8_e4m3fn, unit last stride.
    :param weight_scale: float32 ``[N]``, contiguous (per output channel).
    :param bias: optional ``[N]`` in ``x``'s dtype.
    :param block_n: weight rows per program, ``block_k``: ``K`` slice per iteration
        (powers of two).
    :return: a new ``[1, N]`` tensor in ``x``'s dtype (float32 accumulation: products
        summed per slice position over the slices, then across the slice).
    :raises ValueError: on a shape, dtype, device or stride mismatch, or more than one row.
    """
    check_tensor("x", x, ndim=2, dtypes=HALF_DTYPES, last_dim_contiguous=True)
    m, k = x.shape
    if m != 1:
        raise ValueError(f"fp8_row_linear takes one row, got {m}; use small_m_linear")
    check_tensor("weight", weight, ndim=2, device=x.device, last_dim_contiguous=True,
                 dtypes=(torch.float8_e4m3fn,))
    check_shape("weight", weight, (None, k))
    n = weight.shape[0]
    check_scale_and_bias(x, n, weight_scale, bias)
    for name, value in (("block_n", block_n), ("block_k", block_k)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {value}")
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if n:
        _fp8_row_linear_kernel[(triton.cdiv(n, block_n),)](
            x, weight, weight_scale, bias if bias is not None else weight_scale, out, n, k,
            weight.stride(0), HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=num_warps)
    return out

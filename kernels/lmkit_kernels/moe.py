"""Fused mixture-of-experts: two grouped GEMMs over tokens sorted by expert.

:func:`moe_align` lays the ``T * top_k`` ``(token, slot)`` pairs out by expert, each
expert's run padded to a multiple of ``BLOCK_M`` rows, so that every row block belongs
to one expert. Then:

1. ``_moe_gate_up_kernel``: per (row block, column tile), ``x[tokens] @ w13[e]^T`` for
   the tile's gate and up columns at once, then ``silu(gate) * up`` in the epilogue;
   the ``[T * top_k, I]`` activations are written at each pair's row.
2. ``_moe_down_kernel``: per (row block, column tile), ``act[rows] @ w2[e]^T`` times
   the pair's router weight, written at the pair's row of ``[T * top_k, H]``.

The weighted outputs of a token's ``top_k`` slots are then summed (one torch reduction
over ``[T, top_k, H]``). Every size the launch depends on is known from the shapes
(padding blocks exit at once), and nothing synchronises with the host, so a launch can
be captured in a CUDA graph. Roundings follow torch's modules (each projection rounded
to the dtype, SiLU with an accurate ``exp``), float32 accumulation throughout; float32
inputs multiply in IEEE float32 (no TF32). The reference is
:func:`lmkit_kernels.moe_ref.fused_moe_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from lmkit_kernels.checks import FLOAT_DTYPES, check_tensor, dot_needs_f32, is_interpreting
from lmkit_kernels.moe_ref import check_moe_args, fused_moe_ref
from lmkit_kernels.paged_prefill import attention_dot

__all__ = ["fused_moe", "fused_moe_ref", "moe_align"]


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the flattened ``(token, slot)`` pairs by expert, padding each expert's run.

    :param topk_ids: ``[T, top_k]`` expert ids.
    :return: ``(sorted_ids, block_experts, num_padded)``: ``sorted_ids`` (int32, length
        a multiple of ``block_m`` big enough for any routing) holds flat pair indices
        ``t * top_k + k`` grouped by expert, padding slots set to ``T * top_k``;
        ``block_experts[b]`` (int32) is the expert of rows ``b * block_m ..``;
        ``num_padded`` (int32 ``[1]``) is the number of rows in use. Torch ops on the
        device without a host sync (CUDA-graph safe).
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    rank = torch.arange(n, device=device) - (counts.cumsum(0) - counts)[experts]
    positions = (ends - padded)[experts] + rank
    max_rows = triton.cdiv(n + min(num_experts, n) * (block_m - 1), block_m) * block_m
    sorted_ids = torch.full((max_rows,), n, dtype=torch.int32, device=device)
    sorted_ids[positions] = order.to(torch.int32)
    block_starts = torch.arange(0, max_rows, block_m, device=device)
    block_experts = torch.searchsorted(ends, block_starts, right=True)
    block_experts = block_experts.clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, block_experts, ends[-1:].to(torch.int32)


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_experts_ptr, num_padded_ptr,
    num_rows, TOP_K, N, K, stride_xm, stride_we, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_IEEE: tl.constexpr, ACCURATE_EXP: tl.constexpr,
):
    # program (m, n): act[rows of block m, n-tile] = silu(x w_gate^T) * (x w_up^T)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < num_rows
    tokens = rows // TOP_K
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_base = x_ptr + tokens[:, None] * stride_xm
    w_gate = w_ptr + expert * stride_we + cols.to(tl.int64)[None, :] * stride_wn
    w_up = w_gate + N * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = (k + ks) < K
        a = tl.load(x_base + (k + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        bg = tl.load(w_gate + (k + ks)[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        bu = tl.load(w_up + (k + ks)[:, None], mask=w_mask, other=0.0)
        if DOT_F32:
            a = a.to(tl.float32)
            bg = bg.to(tl.float32)
            bu = bu.to(tl.float32)
        acc_gate += attention_dot(a, bg, DOT_IEEE)
        acc_up += attention_dot(a, bu, DOT_IEEE)
    dtype = out_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)  # each projection rounded, as torch's linear
    up = acc_up.to(dtype).to(tl.float32)
    if ACCURATE_EXP:  # libdevice expf, as torch's CUDA SiLU
        e = libdevice.exp(-gate)
    else:  # the CPU interpreter: numpy's exp
        e = tl.exp(-gate)
    act = tl.math.div_rn(gate, 1.0 + e).to(dtype).to(tl.float32)
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, (act * up).to(dtype), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _moe_down_kernel(
    a_ptr, w_ptr, weights_ptr, out_ptr, sorted_ids_ptr, block_experts_ptr, num_padded_ptr,
    num_rows, N, K, stride_am, stride_we, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_IEEE: tl.constexpr,
):
    # program (m, n): out[rows of block m, n-tile] = weight[row] * (act[row] @ w2[e]^T)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < num_rows
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_base = a_ptr + rows[:, None] * stride_am
    w_base = w_ptr + expert * stride_we + cols.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = (k + ks) < K
        a = tl.load(a_base + (k + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_base + (k + ks)[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += attention_dot(a, b, DOT_IEEE)
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    y = acc.to(dtype).to(tl.float32) * weight[:, None]
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, y.to(dtype), mask=row_ok[:, None] & col_ok[None, :])


def _block_m(num_rows: int, num_experts: int) -> int:
    # decode-sized batches: 16-row blocks (tl.dot's minimum) waste less on padding
    return 16 if num_rows <= 2 * num_experts * 16 else 64


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
              block_m: int | None = None, block_n: int = 64, block_k: int = 64,
              num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """The MoE experts of :func:`~lmkit_kernels.moe_ref.fused_moe_ref`, in two kernels.

    :param x: ``[T, H]`` float32, float16 or bfloat16, unit last stride.
    :param w13: ``[E, 2 * I, H]`` in ``x``'s dtype, unit last stride (gate rows, then up).
    :param w2: ``[E, H, I]`` in ``x``'s dtype, unit last stride.
    :param topk_weights: ``[T, top_k]`` router weights (float32 usually).
    :param topk_ids: ``[T, top_k]`` integer expert ids in ``[0, E)``.
    :param block_m: rows per block (a power of two >= 16; default by the token count).
    :param block_n: output columns per program, ``block_k``: the reduction slice (powers
        of two >= 16).
    :return: a new ``[T, H]`` tensor in ``x``'s dtype.
    :raises ValueError: on a shape, dtype, device or stride mismatch.
    """
    check_moe_args(x, w13, w2, topk_weights, topk_ids)
    check_tensor("x", x, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_tensor("w13", w13, last_dim_contiguous=True)
    check_tensor("w2", w2, last_dim_contiguous=True)
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    num_rows = num_tokens * top_k
    if num_rows == 0:
        return torch.zeros_like(x)
    block_m = block_m or _block_m(num_rows, num_experts)
    sorted_ids, block_experts, num_padded = moe_align(topk_ids, num_experts, block_m)
    num_blocks = sorted_ids.numel() // block_m
    act = torch.empty((num_rows, inter), dtype=x.dtype, device=x.device)
    common = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                  DOT_F32=dot_needs_f32(x.dtype), DOT_IEEE=x.dtype == torch.float32,
                  num_warps=num_warps, num_stages=num_stages)
    _moe_gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, w13, act, sorted_ids, block_experts, num_padded, num_rows, top_k, inter, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        ACCURATE_EXP=not is_interpreting(), **common)
    weights = topk_weights.reshape(-1).contiguous()
    out = torch.empty((num_rows, hidden), dtype=x.dtype, device=x.device)
    _moe_down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        act, w2, weights, out, sorted_ids, block_experts, num_padded, num_rows, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0), **common)
    return out.view(num_tokens, top_k, hidden).sum(dim=1)

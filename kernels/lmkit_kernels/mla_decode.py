"""Triton kernels: MLA decode in the absorbed form over the paged latent cache.

MLA has one latent "KV head" shared by every query head, so a program takes a tile of
``HEAD_TILE`` query heads times the request's ``Q_PAD`` query tokens (``ROWS = Q_PAD *
HEAD_TILE`` rows; one token for plain decode, a few for speculative verification) and
reads each latent tile of its slice of the context once for all of them -- the
bandwidth win of absorbing ``kv_b_proj`` into the query and output. The launcher sizes
the tile by head count (:func:`lmkit_kernels.mla_attention.decode_geometry`): every head
up to 16 (V2-Lite: one read per request, four warps), 64-row tiles over eight warps
above (V2/V3's 128 heads on one GPU: two reads per request instead of the eight of
16-head tiles, and ``tl.dot`` operands of a full Hopper warpgroup MMA); more context
slices make up for the fewer head tiles at small batches. The grid is ``(head tiles,
requests, splits)`` with the head tiles fastest, so the programs reading the same slice
run together and share it through L2. Per row::

    s = scale * (q_lat . c_kv + q_pe . k_pe)      # q_lat = q_nope @ w_uk, [kv_lora_rank]
    out_lat = softmax(s) @ c_kv                   # [kv_lora_rank], then @ w_uv^T outside

Split-K (flash-decoding) as in :mod:`lmkit_kernels.paged_decode`: ``NUM_SPLITS`` slices
of whole ``BLOCK_N`` tiles sized from each request's ``seq_len`` on the device (a grid
fixed at CUDA-graph capture stays right for any length); a one-slice context writes its
output directly, otherwise :func:`mla_reduce_splits_kernel` merges the partials (the
merge is :func:`lmkit_kernels.paged_decode.merge_partials`).

Launch through :func:`lmkit_kernels.mla_attention.mla_decode`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lmkit_kernels.paged_decode import decode_split, merge_partials
from lmkit_kernels.paged_prefill import attention_dot, online_softmax_update


@triton.jit(do_not_specialize=["stride_bt_req"])
def mla_decode_kernel(
    q_lat_ptr, q_pe_ptr, cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    scale_log2,
    stride_ql_tok, stride_ql_head, stride_qp_tok, stride_qp_head,
    stride_o_tok, stride_o_head, stride_c_block, stride_c_slot, stride_bt_req,
    NUM_HEADS: tl.constexpr, HEAD_TILE: tl.constexpr, Q_PAD: tl.constexpr,
    ROWS: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
    RANK: tl.constexpr, RANK_PAD: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, DOT_F32: tl.constexpr, DOT_IEEE: tl.constexpr,
):
    # head tiles vary fastest: the programs reading one context slice for different
    # heads run side by side, so the slice comes from DRAM once and then from L2
    head_tile = tl.program_id(0)
    req = tl.program_id(1)
    split = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    split_len, active = decode_split(seq_len, NUM_SPLITS, BLOCK_N)
    # a request with no query row (padding) has nothing to write; idle slices exit
    if (q_len > 0) & (split < active):
        kv_start = split * split_len
        kv_end = tl.minimum(kv_start + split_len, seq_len)
        # rows: token-major, head-minor
        offs_m = tl.arange(0, ROWS)
        tok = offs_m // HEAD_TILE
        head = head_tile * HEAD_TILE + offs_m % HEAD_TILE
        row_ok = (tok < q_len) & (head < NUM_HEADS)
        q_rows = (q_start + tok).to(tl.int64)
        q_pos = seq_len - q_len + tok  # each row's token position: it sees keys <= it
        offs_r = tl.arange(0, RANK_PAD)
        r_ok = offs_r < RANK
        offs_p = tl.arange(0, ROPE_PAD)
        p_ok = offs_p < ROPE
        q_lat = tl.load(q_lat_ptr + q_rows[:, None] * stride_ql_tok
                        + head[:, None] * stride_ql_head + offs_r[None, :],
                        mask=row_ok[:, None] & r_ok[None, :], other=0.0)  # [ROWS, RANK_PAD]
        q_pe = tl.load(q_pe_ptr + q_rows[:, None] * stride_qp_tok
                       + head[:, None] * stride_qp_head + offs_p[None, :],
                       mask=row_ok[:, None] & p_ok[None, :], other=0.0)  # [ROWS, ROPE_PAD]
        if DOT_F32:
            q_lat = q_lat.to(tl.float32)
            q_pe = q_pe.to(tl.float32)

        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, RANK_PAD], tl.float32)
        bt_row = block_tables_ptr + req.to(tl.int64) * stride_bt_req
        for start_n in range(kv_start, kv_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_ok = offs_n < kv_end
            block = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
            entry = cache_ptr + block * stride_c_block + (offs_n % PAGE_SIZE) * stride_c_slot
            c_kv = tl.load(entry[:, None] + offs_r[None, :],
                           mask=n_ok[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_N, RANK_PAD]
            k_pe = tl.load(entry[:, None] + RANK + offs_p[None, :],
                           mask=n_ok[:, None] & p_ok[None, :], other=0.0)  # [BLOCK_N, ROPE_PAD]
            if DOT_F32:
                c_kv = c_kv.to(tl.float32)
                k_pe = k_pe.to(tl.float32)
            s = (attention_dot(q_lat, tl.trans(c_kv), DOT_IEEE)
                 + attention_dot(q_pe, tl.trans(k_pe), DOT_IEEE)) * scale_log2
            s = tl.where((offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :], s, float("-inf"))
            acc, m_i, l_i = online_softmax_update(acc, m_i, l_i, s, c_kv, DOT_IEEE)

        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        if active == 1:
            tl.store(out_ptr + q_rows[:, None] * stride_o_tok + head[:, None] * stride_o_head
                     + offs_r[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & r_ok[None, :])
        else:
            # partials: out [num_tokens, NUM_HEADS, NUM_SPLITS, RANK_PAD], lse [.., NUM_SPLITS]
            # (log2 domain; -inf for a row that sees no key of this slice)
            rows = q_rows * NUM_HEADS + head
            tl.store(part_out_ptr + (rows * NUM_SPLITS + split)[:, None] * RANK_PAD
                     + offs_r[None, :], out, mask=row_ok[:, None])
            lse = m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i))
            tl.store(part_lse_ptr + rows * NUM_SPLITS + split, lse, mask=row_ok)


@triton.jit
def mla_reduce_splits_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, query_start_loc_ptr, seq_lens_ptr,
    stride_o_tok, stride_o_head,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
    RANK: tl.constexpr, RANK_PAD: tl.constexpr,
):
    """Merge the slice partials of one (request, query head, query token); one-slice
    requests were written by the decode kernel."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    tok = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    _, active = decode_split(tl.load(seq_lens_ptr + req), NUM_SPLITS, BLOCK_N)
    if (tok < q_len) & (active > 1):
        q_row = (q_start + tok).to(tl.int64)
        rows = q_row * NUM_HEADS + head + tl.arange(0, 1)  # [1]
        merged = merge_partials(part_out_ptr, part_lse_ptr, rows, rows >= 0, active,
                                NUM_SPLITS, 1, RANK_PAD)  # [1, RANK_PAD]
        offs_r = tl.arange(0, RANK_PAD)
        tl.store(out_ptr + q_row * stride_o_tok + head * stride_o_head + offs_r[None, :],
                 merged.to(out_ptr.dtype.element_ty), mask=offs_r[None, :] < RANK)

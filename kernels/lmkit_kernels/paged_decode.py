"""Triton kernels: one new token per request over a paged cache (flash-decoding).

Decode is bound by reading the cache, so the work is spread over
``num_reqs x num_kv_heads x NUM_SPLITS`` programs: each reads one slice of one request's
context for one KV head -- once for all ``GROUP`` query heads sharing it. Slices are
whole ``BLOCK_N`` tiles sized from each request's own ``seq_len`` on the device, so a
grid fixed at CUDA-graph capture stays correct for any context length, and a short
context uses fewer slices than the grid has (the rest exit at once): a context of at
most ``BLOCK_N`` tokens is one slice, whose program writes the output directly.

With several slices, each leaves a partial result (normalised output and log-sum-exp)
that must be merged:

* ``FUSED_MERGE`` (one launch): after storing its partial, each program counts itself
  in on a per-(request, KV head) counter (an acquire-release atomic); the last to arrive
  merges all partials, writes the output and resets the counter to zero, so the
  zeroed counter buffer can be reused by the next launch (and CUDA-graph replay).
* otherwise :func:`reduce_splits_kernel` merges them in a second launch.

Launch through :func:`lmkit_kernels.paged_attention.paged_attention`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lmkit_kernels.paged_prefill import attention_dot, fp16_query, online_softmax_update
from lmkit_kernels.pdl import pdl_wait, prefetch_l2


@triton.jit
def decode_split(seq_len, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(split_len, active)``: each slice's length (whole tiles) and how many slices a
    context of ``seq_len`` tokens fills (at least 1: an empty context writes zeros)."""
    split_len = ((seq_len + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    active = tl.maximum((seq_len + split_len - 1) // tl.maximum(split_len, 1), 1)
    return split_len, active


# The eager block table's row stride changes as the runner's buffer grows; a 16-divisible
# specialisation of it would compile a new variant mid-run (seconds on a busy step).
@triton.jit(do_not_specialize=["stride_bt_req"])
def paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr, counter_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    scale_log2, v_scale,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head,
    stride_bt_req,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    ROWS: tl.constexpr, NUM_SPLITS: tl.constexpr, FUSED_MERGE: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, DOT_F32: tl.constexpr, DOT_IEEE: tl.constexpr,
    USE_PDL: tl.constexpr = False, KV_LINE: tl.constexpr = 1, KV_LINES: tl.constexpr = 0,
    KV_FP8: tl.constexpr = False, K_ROWS: tl.constexpr = False, V_PRESCALE: tl.constexpr = False,
    MERGE_AT_ONCE: tl.constexpr = True, MERGE_ROWS: tl.constexpr = 16,
):
    # K_ROWS: keys loaded token-major ([BLOCK_N, HEAD_PAD]) and transposed in registers;
    # V_PRESCALE: FP8 values widened and times v_scale where loaded (both for FP8 caches,
    # see paged_attention._fp8_decode_layout)
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # before the PDL wait only what the step's host copies wrote is read (query starts,
    # sequence lengths, block tables): the previous kernel writes q and the newest K/V
    q_row = tl.load(query_start_loc_ptr + req).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + req)
    split_len, active = decode_split(seq_len, NUM_SPLITS, BLOCK_N)
    # a request with no query row (padding) has nothing to write; idle slices exit
    has_work = (tl.load(query_start_loc_ptr + req + 1) > q_row) & (split < active)
    if KV_LINES > 0:  # the slice's first K and V tile into L2 while the previous kernel ends
        if has_work:
            offs_p = split * split_len + tl.arange(0, BLOCK_N)
            p_ok = offs_p < seq_len
            p_block = tl.load(block_tables_ptr + req.to(tl.int64) * stride_bt_req
                              + offs_p // PAGE_SIZE, mask=p_ok, other=0).to(tl.int64)
            lines = tl.arange(0, KV_LINES) * KV_LINE
            p_slot = tl.where(p_ok, offs_p % PAGE_SIZE, 0)
            prefetch_l2(k_cache_ptr + p_block[:, None] * stride_kc_block
                        + p_slot[:, None] * stride_kc_slot + kv_head * stride_kc_head
                        + lines[None, :])
            prefetch_l2(v_cache_ptr + p_block[:, None] * stride_vc_block
                        + p_slot[:, None] * stride_vc_slot + kv_head * stride_vc_head
                        + lines[None, :])
    pdl_wait(USE_PDL)
    if has_work:
        kv_start = split * split_len
        kv_end = tl.minimum(kv_start + split_len, seq_len)

        # ROWS: the group's heads padded to a power of two >= 16 (tl.dot's minimum)
        offs_g = tl.arange(0, ROWS)
        g_ok = offs_g < GROUP
        head = kv_head * GROUP + offs_g
        offs_d = tl.arange(0, HEAD_PAD)
        d_ok = offs_d < HEAD_SIZE
        q = tl.load(q_ptr + q_row * stride_q_tok + head[:, None] * stride_q_head
                    + offs_d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        elif KV_FP8 and q.dtype != tl.float32:  # half precision: dots in float16, which
            q = fp16_query(q)  # e4m3 widens to in one instruction

        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD_PAD], tl.float32)
        bt_row = block_tables_ptr + req.to(tl.int64) * stride_bt_req
        for start_n in range(kv_start, kv_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_ok = offs_n < kv_end
            block = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
            slot = offs_n % PAGE_SIZE
            if K_ROWS:
                k = tl.trans(tl.load(k_cache_ptr + block[:, None] * stride_kc_block
                                     + slot[:, None] * stride_kc_slot + kv_head * stride_kc_head
                                     + offs_d[None, :],
                                     mask=n_ok[:, None] & d_ok[None, :], other=0.0))
            else:
                k = tl.load(k_cache_ptr + block[None, :] * stride_kc_block
                            + slot[None, :] * stride_kc_slot + kv_head * stride_kc_head
                            + offs_d[:, None],
                            mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # [HEAD_PAD, BLOCK_N]
            v = tl.load(v_cache_ptr + block[:, None] * stride_vc_block
                        + slot[:, None] * stride_vc_slot + kv_head * stride_vc_head
                        + offs_d[None, :],
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, HEAD_PAD]
            if DOT_F32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            elif KV_FP8:  # float8 K/V: k_scale is in scale_log2, v_scale on the output
                k = k.to(q.dtype)
                if V_PRESCALE:
                    v = (v.to(q.dtype) * v_scale).to(q.dtype)
                else:
                    v = v.to(q.dtype)
            s = attention_dot(q, k, DOT_IEEE) * scale_log2  # [ROWS, BLOCK_N]
            s = tl.where(n_ok[None, :], s, float("-inf"))
            acc, m_i, l_i = online_softmax_update(acc, m_i, l_i, s, v, DOT_IEEE)

        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        if KV_FP8 and not V_PRESCALE:
            out = out * v_scale
        mask = g_ok[:, None] & d_ok[None, :]
        out_ptrs = out_ptr + q_row * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :]
        if active == 1:
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            # partials: out [num_reqs, NUM_HEADS, NUM_SPLITS, HEAD_PAD], lse [.., NUM_SPLITS]
            # (log2 domain)
            rows = req.to(tl.int64) * NUM_HEADS + head  # [ROWS]
            tl.store(part_out_ptr + (rows * NUM_SPLITS + split)[:, None] * HEAD_PAD
                     + offs_d[None, :], out, mask=g_ok[:, None])
            lse = m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i))
            tl.store(part_lse_ptr + rows * NUM_SPLITS + split, lse, mask=g_ok)
            if FUSED_MERGE:
                # every thread's partial is stored before one thread releases the count
                tl.debug_barrier()
                counter = counter_ptr + req.to(tl.int64) * NUM_KV_HEADS + kv_head
                arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                if arrived == active - 1:  # the last slice: merge, then reset the counter
                    if MERGE_AT_ONCE:  # over the group's heads only, not the dot's rows
                        offs_m = tl.arange(0, MERGE_ROWS)
                        m_ok = offs_m < GROUP
                        m_head = kv_head * GROUP + offs_m
                        merged = merge_partials(part_out_ptr, part_lse_ptr,
                                                req.to(tl.int64) * NUM_HEADS + m_head, m_ok,
                                                active, NUM_SPLITS, MERGE_ROWS, HEAD_PAD, True)
                        tl.store(out_ptr + q_row * stride_o_tok + m_head[:, None] * stride_o_head
                                 + offs_d[None, :], merged.to(out_ptr.dtype.element_ty),
                                 mask=m_ok[:, None] & d_ok[None, :])
                    else:
                        merged = merge_partials(part_out_ptr, part_lse_ptr, rows, g_ok, active,
                                                NUM_SPLITS, ROWS, HEAD_PAD, False)
                        tl.store(out_ptrs, merged.to(out_ptr.dtype.element_ty), mask=mask)
                    tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def merge_partials(part_out_ptr, part_lse_ptr, rows, row_ok, active,
                   NUM_SPLITS: tl.constexpr, ROWS: tl.constexpr, HEAD_PAD: tl.constexpr,
                   AT_ONCE: tl.constexpr = False):
    """``[ROWS, HEAD_PAD]``: the first ``active`` partials of each of ``rows``, weighted
    by their sums of exps. Loads bypass L1 (``.cg``): other programs wrote them.

    ``AT_ONCE`` unrolls the loop over all ``NUM_SPLITS`` slices with masked loads, so
    that no partial's load waits for the previous one's (a loop to ``active`` issues
    them one round trip after another: the merge's latency at batch 1); the sum runs in
    the same order, so the result is the same bits."""
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_PAD)
    s_ok = offs_s < active
    lse = tl.load(part_lse_ptr + rows[:, None] * NUM_SPLITS + offs_s[None, :],
                  mask=row_ok[:, None] & s_ok[None, :], other=float("-inf"),
                  cache_modifier=".cg")  # [ROWS, NUM_SPLITS]
    lse_max = tl.max(lse, axis=1)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp2(lse - lse_max[:, None])  # 0 past the active slices
    total = tl.sum(w, axis=1)
    acc = tl.zeros([ROWS, HEAD_PAD], tl.float32)
    if AT_ONCE:
        for s in tl.static_range(NUM_SPLITS):
            live = (row_ok & (tl.full([ROWS], s, tl.int32) < active))[:, None]  # [ROWS, 1]
            part = tl.load(part_out_ptr + (rows * NUM_SPLITS + s)[:, None] * HEAD_PAD
                           + offs_d[None, :], mask=live, other=0.0, cache_modifier=".cg")
            w_s = tl.sum(tl.where(offs_s[None, :] == s, w, 0.0), axis=1)
            acc = tl.where(live, acc + part * w_s[:, None], acc)
    else:
        for s in range(0, active):
            part = tl.load(part_out_ptr + (rows * NUM_SPLITS + s)[:, None] * HEAD_PAD
                           + offs_d[None, :], mask=row_ok[:, None], other=0.0,
                           cache_modifier=".cg")
            w_s = tl.sum(tl.where(offs_s[None, :] == s, w, 0.0), axis=1)
            acc += part * w_s[:, None]
    return acc / tl.where(total == 0.0, 1.0, total)[:, None]


@triton.jit
def reduce_splits_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, query_start_loc_ptr, seq_lens_ptr,
    stride_o_tok, stride_o_head,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """Merge one (request, query head)'s slice partials (the second launch, when the
    decode kernel does not merge them itself); one-slice requests are already written."""
    pdl_wait(USE_PDL)
    req = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(query_start_loc_ptr + req).to(tl.int64)
    _, active = decode_split(tl.load(seq_lens_ptr + req), NUM_SPLITS, BLOCK_N)
    if (tl.load(query_start_loc_ptr + req + 1) > q_row) & (active > 1):
        rows = req.to(tl.int64) * NUM_HEADS + head + tl.arange(0, 1)  # [1]
        merged = merge_partials(part_out_ptr, part_lse_ptr, rows, rows >= 0, active,
                                NUM_SPLITS, 1, HEAD_PAD)  # [1, HEAD_PAD]
        offs_d = tl.arange(0, HEAD_PAD)
        tl.store(out_ptr + q_row * stride_o_tok + head * stride_o_head + offs_d[None, :],
                 merged.to(out_ptr.dtype.element_ty), mask=offs_d[None, :] < HEAD_SIZE)

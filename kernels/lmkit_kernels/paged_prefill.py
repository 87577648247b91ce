"""Triton kernel: causal attention of several new tokens per request over a paged cache.

Serves prefill, prefill with a cached prefix, chunked prefill and multi-token decode
(speculative verification) alike: request ``r`` has ``q_len`` new tokens at positions
``seq_len - q_len .. seq_len - 1`` and attends to all ``seq_len`` cached tokens up to
each query's own position. Launch through :func:`lmkit_kernels.paged_attention.paged_attention`.

GQA without repeated loads: one program takes ``BLOCK_Q`` query tokens of one request
times all ``GROUP`` query heads that share one KV head, flattened into
``BLOCK_M = BLOCK_Q * GROUP_PAD`` rows, so every K/V tile is read once for the group.

Causal tile skipping: a program reads only the keys its last token sees, in two loops:
the keys before its first token, visible to every row, in whole tiles with no mask
(most of a long prompt's work), then the few tiles along the diagonal with the causal
mask. Programs are launched heaviest first (the last query tiles of each request see
the most keys), so the short ones fill in at the end of the wave.

Draft trees (``HAS_TREE``, speculative decoding with a token tree): a request whose tree
region ``R = tree_region[req]`` is positive lets each query token see the keys before
``seq_len - R`` (the unmasked loop) and, of the region's keys ``seq_len - R + j``, those
whose bit ``j`` is set in the token's int64 ``tree_mask`` entry (the masked loop, which
then runs to ``seq_len``); a request with ``R = 0`` stays causal. Launches without a tree
compile the variant they always did (``HAS_TREE`` false, the two tree pointers unused).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attention_dot(a, b, IEEE: tl.constexpr):
    """``a @ b`` accumulated in float32; exact float32 products when ``IEEE`` (else TF32
    for float32 inputs on tensor cores; fp16/bf16 inputs are unaffected)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def fp16_query(q):
    """Half-precision queries as float16, for dots with float8 K/V widened to float16:
    e4m3 widens to float16 in one instruction per pair, to bfloat16 only through
    float32 (which made an FP8 decode slower than a bf16 one). Magnitudes beyond
    float16's 65504 are clamped (no real query comes near)."""
    return tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)


@triton.jit
def online_softmax_update(acc, m_i, l_i, s, v, IEEE: tl.constexpr):
    """One key tile of an online softmax: ``s`` the tile's log2-scaled scores (hidden
    keys at ``-inf``), ``v`` its values; returns ``(acc, m, l)`` updated. Rows that have
    seen no visible key yet keep ``m = -inf`` and are shifted by 0."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + attention_dot(p.to(v.dtype), v, IEEE)
    return acc, m_new, l_i


@triton.jit
def tree_visible(offs_n, tree_lo, tree_bits):
    """``[BLOCK_M, BLOCK_N]``: whether each row's token sees keys ``offs_n`` in a draft
    tree whose region starts at key ``tree_lo``: every key before it, and the region's
    key ``tree_lo + j`` when bit ``j`` of the row's int64 mask ``tree_bits`` is set (an
    arithmetic shift, so bit 63, the sign bit, reads as any other)."""
    j = offs_n - tree_lo
    shift = tl.minimum(tl.maximum(j, 0), 63).to(tl.int64)
    bit = (tree_bits[:, None] >> shift[None, :]) & 1
    return (j[None, :] < 0) | (bit != 0)


@triton.jit
def _attend_tile(acc, m_i, l_i, q, q_pos, start_n, kv_end, bt_row, k_base, v_base,
                 stride_kc_block, stride_kc_slot, stride_vc_block, stride_vc_slot,
                 scale_log2, offs_d, d_ok, is_tree, tree_lo, tree_bits,
                 BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
                 DOT_F32: tl.constexpr, DOT_IEEE: tl.constexpr, KV_FP8: tl.constexpr,
                 HAS_TREE: tl.constexpr):
    """One online-softmax step over keys ``start_n .. start_n + BLOCK_N``. Without
    ``CAUSAL`` every key of the tile is visible to every row (no masks). ``KV_FP8``: the
    cache holds float8 K/V, widened to float16 like ``q`` (:func:`fp16_query`; their
    scales are applied by the caller: ``k_scale`` inside ``scale_log2``, ``v_scale`` on
    the output). ``HAS_TREE`` and ``is_tree``: the masked tile shows each row the keys
    :func:`tree_visible` names instead of those up to its position."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if CAUSAL:
        n_ok = offs_n < kv_end
        block = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
        kv_mask = n_ok[:, None] & d_ok[None, :]
    else:
        block = tl.load(bt_row + offs_n // PAGE_SIZE).to(tl.int64)
        kv_mask = d_ok[None, :]
    slot = (offs_n % PAGE_SIZE)[:, None]
    # k, v: [BLOCK_N, HEAD_PAD], gathered page by page
    k = tl.load(k_base + block[:, None] * stride_kc_block + slot * stride_kc_slot
                + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_base + block[:, None] * stride_vc_block + slot * stride_vc_slot
                + offs_d[None, :], mask=kv_mask, other=0.0)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    elif KV_FP8:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    s = attention_dot(q, tl.trans(k), DOT_IEEE) * scale_log2  # [BLOCK_M, BLOCK_N]
    if CAUSAL:
        visible = offs_n[None, :] <= q_pos[:, None]
        if HAS_TREE:
            visible = tl.where(is_tree, tree_visible(offs_n, tree_lo, tree_bits), visible)
        s = tl.where(visible & n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # rows that have seen no visible key yet keep m = -inf; shift them by 0
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_safe = tl.maximum(m_i, tl.max(s, axis=1))
        m_new = m_safe
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + attention_dot(p.to(v.dtype), v, DOT_IEEE)
    return acc, m_new, l_i


# The backend passes the prefill part of a mixed step as views starting after its
# decode requests: those int32 arrays begin at any 4-byte offset. Specialising on their
# 16-byte alignment would compile a second kernel (about a second, in the middle of
# serving) the first time a step has a number of decodes not divisible by 4. Likewise
# the block table's row stride, which changes as the runner's eager buffer grows.
# The tree pointers (dummies without a tree) are not specialised either.
@triton.jit(do_not_specialize_on_alignment=["query_start_loc_ptr", "seq_lens_ptr",
                                            "block_tables_ptr", "tree_region_ptr",
                                            "tree_mask_ptr"],
            do_not_specialize=["stride_bt_req"])
def paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    tree_region_ptr,  # int32 [num_reqs]: each request's draft-tree region (HAS_TREE)
    tree_mask_ptr,  # int64 [num_tokens]: each query token's region bits (HAS_TREE)
    scale_log2,  # softmax scale * log2(e) (* k_scale): scores go through exp2
    v_scale,  # an FP8 cache's value scale (1.0 otherwise)
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head,
    stride_bt_req,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_IEEE: tl.constexpr, KV_FP8: tl.constexpr = False,
    HAS_TREE: tl.constexpr = False,
):
    q_tile = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest (last) tiles first
    req = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if q_tile * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + req)
        ctx_len = seq_len - q_len  # cached tokens before this step's first query

        # BLOCK_M = BLOCK_Q * GROUP_PAD rows: token-major, head-minor within the group
        offs_m = tl.arange(0, BLOCK_M)
        tok = q_tile * BLOCK_Q + offs_m // GROUP_PAD
        head = kv_head * GROUP + offs_m % GROUP_PAD
        row_ok = (tok < q_len) & (offs_m % GROUP_PAD < GROUP)
        offs_d = tl.arange(0, HEAD_PAD)
        d_ok = offs_d < HEAD_SIZE
        q_rows = (q_start + tok).to(tl.int64)
        q = tl.load(q_ptr + q_rows[:, None] * stride_q_tok + head[:, None] * stride_q_head
                    + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        elif KV_FP8 and q.dtype != tl.float32:
            q = fp16_query(q)
        q_pos = ctx_len + tok  # [BLOCK_M] absolute position of each row's token
        if HAS_TREE:
            region = tl.load(tree_region_ptr + req)
            is_tree = region > 0
            tree_lo = seq_len - region  # the region's first key
            tree_bits = tl.load(tree_mask_ptr + q_rows, mask=row_ok, other=0)
        else:
            is_tree = False
            tree_lo = seq_len
            tree_bits = q_rows  # unused

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
        bt_row = block_tables_ptr + req.to(tl.int64) * stride_bt_req
        k_base = k_cache_ptr + kv_head * stride_kc_head
        v_base = v_cache_ptr + kv_head * stride_vc_head
        # keys before the tile's first token: visible to all rows, whole tiles, no mask
        first_pos = ctx_len + q_tile * BLOCK_Q
        if HAS_TREE:  # a tree's rows see the keys before its region (below first_pos)
            first_pos = tl.where(is_tree, tree_lo, first_pos)
        full_end = first_pos // BLOCK_N * BLOCK_N
        for start_n in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, q_pos, start_n, seq_len, bt_row, k_base, v_base,
                stride_kc_block, stride_kc_slot, stride_vc_block, stride_vc_slot,
                scale_log2, offs_d, d_ok, is_tree, tree_lo, tree_bits, BLOCK_N, PAGE_SIZE,
                False, DOT_F32, DOT_IEEE, KV_FP8, HAS_TREE)
        # the diagonal: the tile's last token sees keys up to its own position (a tree's
        # rows: the whole region)
        kv_end = ctx_len + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q)
        if HAS_TREE:
            kv_end = tl.where(is_tree, seq_len, kv_end)
        for start_n in range(full_end, kv_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, q_pos, start_n, kv_end, bt_row, k_base, v_base,
                stride_kc_block, stride_kc_slot, stride_vc_block, stride_vc_slot,
                scale_log2, offs_d, d_ok, is_tree, tree_lo, tree_bits, BLOCK_N, PAGE_SIZE,
                True, DOT_F32, DOT_IEEE, KV_FP8, HAS_TREE)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        if KV_FP8:
            out = out * v_scale
        tl.store(out_ptr + q_rows[:, None] * stride_o_tok + head[:, None] * stride_o_head
                 + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])

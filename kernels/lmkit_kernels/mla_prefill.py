"""Triton kernel: causal varlen attention over decompressed MLA keys and values.

Prefill, prefill over a cached prefix and chunked prefill of an MLA model decompress
each request's context (its latent entries through ``kv_b_proj``) into per-head
``k_nope`` ``[num_keys, num_heads, nope]`` and ``v`` ``[num_keys, num_heads, v_dim]``;
the RoPE key ``k_pe`` ``[num_keys, rope]`` is shared by all heads. The query/key width
(``nope + rope``, 192 in DeepSeek) differs from the value width (128), and neither
needs padding to a power of two: the score is two dots, ``q_nope . k_nope + q_pe .
k_pe``, each over a power-of-two (or masked) width. (lmkit's paged prefill kernel takes
one head size for keys and values, and would need the 128-wide values padded to 256.)

Request ``r`` has ``q_len`` query rows (``cu_seqlens_q``) at positions ``k_len - q_len
.. k_len - 1`` of its ``k_len`` keys (``cu_seqlens_k``); query ``i`` sees keys at
positions ``<=`` its own. Launch through :func:`lmkit_kernels.mla_attention.mla_prefill`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lmkit_kernels.paged_prefill import attention_dot, online_softmax_update


@triton.jit(do_not_specialize_on_alignment=["cu_seqlens_q_ptr", "cu_seqlens_k_ptr"])
def mla_prefill_kernel(
    q_nope_ptr, q_pe_ptr, k_nope_ptr, k_pe_ptr, v_ptr, out_ptr,
    cu_seqlens_q_ptr, cu_seqlens_k_ptr,
    scale_log2,
    stride_qn_tok, stride_qn_head, stride_qp_tok, stride_qp_head,
    stride_kn_tok, stride_kn_head, stride_kp_tok, stride_v_tok, stride_v_head,
    stride_o_tok, stride_o_head,
    NOPE: tl.constexpr, NOPE_PAD: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr,
    V_DIM: tl.constexpr, V_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_IEEE: tl.constexpr,
):
    q_tile = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest (last) tiles first
    req = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + req)
    q_len = tl.load(cu_seqlens_q_ptr + req + 1) - q_start
    if q_tile * BLOCK_M < q_len:
        k_start = tl.load(cu_seqlens_k_ptr + req)
        k_len = tl.load(cu_seqlens_k_ptr + req + 1) - k_start
        ctx_len = k_len - q_len
        tok = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = tok < q_len
        q_rows = (q_start + tok).to(tl.int64)
        q_pos = ctx_len + tok
        offs_n0 = tl.arange(0, NOPE_PAD)
        n0_ok = offs_n0 < NOPE
        offs_p = tl.arange(0, ROPE_PAD)
        p_ok = offs_p < ROPE
        offs_v = tl.arange(0, V_PAD)
        v_ok = offs_v < V_DIM
        q_nope = tl.load(q_nope_ptr + q_rows[:, None] * stride_qn_tok + head * stride_qn_head
                         + offs_n0[None, :], mask=m_ok[:, None] & n0_ok[None, :], other=0.0)
        q_pe = tl.load(q_pe_ptr + q_rows[:, None] * stride_qp_tok + head * stride_qp_head
                       + offs_p[None, :], mask=m_ok[:, None] & p_ok[None, :], other=0.0)
        if DOT_F32:
            q_nope = q_nope.to(tl.float32)
            q_pe = q_pe.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, V_PAD], tl.float32)
        # the tile's last token sees keys up to its own position
        kv_end = ctx_len + tl.minimum(q_len, (q_tile + 1) * BLOCK_M)
        for start_n in range(0, kv_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_ok = offs_n < kv_end
            k_rows = (k_start + offs_n).to(tl.int64)
            k_nope = tl.load(k_nope_ptr + k_rows[:, None] * stride_kn_tok
                             + head * stride_kn_head + offs_n0[None, :],
                             mask=n_ok[:, None] & n0_ok[None, :], other=0.0)
            k_pe = tl.load(k_pe_ptr + k_rows[:, None] * stride_kp_tok + offs_p[None, :],
                           mask=n_ok[:, None] & p_ok[None, :], other=0.0)
            v = tl.load(v_ptr + k_rows[:, None] * stride_v_tok + head * stride_v_head
                        + offs_v[None, :], mask=n_ok[:, None] & v_ok[None, :], other=0.0)
            if DOT_F32:
                k_nope = k_nope.to(tl.float32)
                k_pe = k_pe.to(tl.float32)
                v = v.to(tl.float32)
            s = (attention_dot(q_nope, tl.trans(k_nope), DOT_IEEE)
                 + attention_dot(q_pe, tl.trans(k_pe), DOT_IEEE)) * scale_log2
            s = tl.where((offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :], s, float("-inf"))
            acc, m_i, l_i = online_softmax_update(acc, m_i, l_i, s, v, DOT_IEEE)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_o_tok + head * stride_o_head
                 + offs_v[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & v_ok[None, :])

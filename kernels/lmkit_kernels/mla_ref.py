"""Plain-torch references for the MLA (multi-head latent attention) kernels.

The latent cache holds one entry per token, ``[num_blocks, block_size, kv_lora_rank +
qk_rope_head_dim]``: ``c_kv`` then ``k_pe`` (see ``lmkit.api.mla_attention``). Written
for clarity (per-request loops, float32 maths); the kernel tests compare with these:

* :func:`mla_cache_write_ref` -- :func:`lmkit_kernels.mla_cache_write.mla_cache_write`
* :func:`mla_latent_attention_ref` -- :func:`lmkit_kernels.mla_attention.mla_decode`
  (attention in the absorbed form, over the latent itself)
* :func:`mla_attention_ref` -- the whole MLA attention of a step from the per-head
  query, as the contract defines it (decompressed keys and values), which both the
  absorbed decode path and the decompressed prefill path must reproduce
"""

from __future__ import annotations

import torch

__all__ = ["mla_attention_ref", "mla_cache_write_ref", "mla_latent_attention_ref",
           "split_kv_b"]


def split_kv_b(w_kv_b: torch.Tensor, num_heads: int, qk_nope_head_dim: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w_uk, w_uv)`` views of HF's ``kv_b_proj`` weight ``[num_heads * (nope + v),
    kv_lora_rank]``: ``w_uk`` ``[num_heads, nope, kv_lora_rank]`` (key rows of each
    head) and ``w_uv`` ``[num_heads, v, kv_lora_rank]`` (value rows)."""
    w = w_kv_b.view(num_heads, -1, w_kv_b.shape[-1])
    return w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:]


def mla_cache_write_ref(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
    """Write ``[kv_c | k_pe]`` rows to ``kv_cache[slot // bs, slot % bs]`` (slot >= 0)."""
    block_size, rank = kv_cache.shape[1], kv_c.shape[-1]
    n = slot_mapping.shape[0]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, offsets, :rank] = kv_c[:n][keep].to(kv_cache.dtype)
    kv_cache[blocks, offsets, rank:] = k_pe[:n][keep].to(kv_cache.dtype)


def _context(kv_cache: torch.Tensor, block_tables: torch.Tensor, r: int, seq_len: int
             ) -> torch.Tensor:
    """Request ``r``'s latent entries, ``[seq_len, kv_lora_rank + rope]`` in float32."""
    block_size = kv_cache.shape[1]
    blocks = block_tables[r, : -(-seq_len // block_size)].long()
    return kv_cache[blocks].reshape(-1, kv_cache.shape[-1])[:seq_len].float()


def _causal_softmax(scores: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Softmax of ``scores`` ``[heads, q_len, seq_len]`` with query ``i`` at position
    ``seq_len - q_len + i`` seeing keys at positions ``<=`` its own."""
    q_len = scores.shape[1]
    q_pos = torch.arange(seq_len - q_len, seq_len, device=scores.device)
    k_pos = torch.arange(seq_len, device=scores.device)
    return scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None],
                              float("-inf")).softmax(dim=-1)


def mla_latent_attention_ref(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                             query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                             block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention over the latent itself (the absorbed form), in float32.

    ``scores = scale * (q_lat . c_kv + q_pe . k_pe)``, ``out = softmax(scores) @ c_kv``.

    :param q_lat: ``[num_tokens, num_heads, kv_lora_rank]`` (``q_nope @ w_uk`` per head)
    :param q_pe: ``[num_tokens, num_heads, rope]``
    :return: ``[num_tokens, num_heads, kv_lora_rank]`` in ``q_lat``'s dtype; rows past
        ``query_start_loc[-1]`` and rows of empty contexts are zero.
    """
    rank = q_lat.shape[-1]
    out = torch.zeros(q_lat.shape, dtype=torch.float32, device=q_lat.device)
    starts = query_start_loc.tolist()
    for r, seq_len in enumerate(seq_lens.tolist()):
        a, b = starts[r], starts[r + 1]
        if a == b or seq_len == 0:
            continue
        latent = _context(kv_cache, block_tables, r, seq_len)
        c_kv, k_pe = latent[:, :rank], latent[:, rank:]
        scores = (torch.einsum("qhr,kr->hqk", q_lat[a:b].float(), c_kv)
                  + torch.einsum("qhp,kp->hqk", q_pe[a:b].float(), k_pe)) * scale
        out[a:b] = torch.einsum("hqk,kr->qhr", _causal_softmax(scores, seq_len), c_kv)
    return out.to(q_lat.dtype)


def mla_attention_ref(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                      w_kv_b: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, block_tables: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """MLA attention as the contract defines it, with decompressed keys and values.

    Per head ``h``: ``[k_nope | v] = c_kv @ w_kv_b[h].T``, key ``[k_nope | k_pe]``,
    ``out = softmax(scale * q . key) @ v``, causal within each request.

    :param q_nope: ``[num_tokens, num_heads, nope]``; ``q_pe``: ``[.., rope]``
    :param w_kv_b: ``[num_heads * (nope + v), kv_lora_rank]`` (HF's ``kv_b_proj``)
    :return: ``[num_tokens, num_heads, v]`` in ``q_nope``'s dtype; rows past
        ``query_start_loc[-1]`` are zero.
    """
    num_tokens, num_heads, nope = q_nope.shape
    rank = w_kv_b.shape[-1]
    w = w_kv_b.float().view(num_heads, -1, rank)
    v_dim = w.shape[1] - nope
    out = torch.zeros((num_tokens, num_heads, v_dim), dtype=torch.float32,
                      device=q_nope.device)
    starts = query_start_loc.tolist()
    for r, seq_len in enumerate(seq_lens.tolist()):
        a, b = starts[r], starts[r + 1]
        if a == b or seq_len == 0:
            continue
        latent = _context(kv_cache, block_tables, r, seq_len)
        kv = torch.einsum("kr,hdr->khd", latent[:, :rank], w)  # [seq_len, heads, nope + v]
        k_nope, v = kv[..., :nope], kv[..., nope:]
        scores = (torch.einsum("qhd,khd->hqk", q_nope[a:b].float(), k_nope)
                  + torch.einsum("qhp,kp->hqk", q_pe[a:b].float(), latent[:, rank:])) * scale
        out[a:b] = torch.einsum("hqk,khd->qhd", _causal_softmax(scores, seq_len), v)
    return out.to(q_nope.dtype)

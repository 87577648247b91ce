"""Plain-torch references for every kernel in :mod:`lmkit_kernels`.

Written for clarity, not speed (per-request Python loops, float32 maths); the kernel
tests compare each kernel with its reference here. The semantics are the kernels'
contract:

* :func:`reshape_and_cache_ref` -- :func:`lmkit_kernels.cache_write.reshape_and_cache`
* :func:`paged_attention_ref` -- :func:`lmkit_kernels.paged_attention.paged_attention`

(:func:`lmkit_kernels.sampling.sample_ref` and
:func:`lmkit_kernels.rejection_sample.rejection_sample_ref` live beside their kernels.)
"""

from __future__ import annotations

import torch

__all__ = ["paged_attention_ref", "reshape_and_cache_ref"]


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    """Write rows of ``key``/``value`` to ``kv_cache[:, slot // bs, slot % bs]`` (slot >= 0)."""
    block_size = kv_cache.shape[2]
    num_tokens = slot_mapping.shape[0]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, offsets] = key[:num_tokens][keep].to(kv_cache.dtype)
    kv_cache[1, blocks, offsets] = value[:num_tokens][keep].to(kv_cache.dtype)


def paged_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, block_tables: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """Causal attention of each request's new tokens over its paged context, in float32.

    Request ``r`` owns query rows ``query_start_loc[r]:query_start_loc[r+1]`` (its last
    ``q_len`` tokens) and ``seq_lens[r]`` cached tokens (its prefix plus these), found
    through ``block_tables[r]``. Query ``i`` sits at position ``seq_len - q_len + i`` and
    sees keys at positions ``<=`` its own. GQA: query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)``.

    :return: ``[num_tokens, num_heads, head_size]`` in ``q``'s dtype; rows past
        ``query_start_loc[-1]`` are zero.
    """
    num_heads, head_size = q.shape[1], q.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    starts = query_start_loc.tolist()
    for r, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[r], starts[r + 1]
        q_len = q_end - q_start
        if q_len == 0 or seq_len == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = block_tables[r, :num_blocks].long()
        # keys/values: [seq_len, num_kv_heads, head_size] -> per query head
        keys = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_size)[:seq_len].float()
        values = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_size)[:seq_len].float()
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        queries = q[q_start:q_end].float()  # [q_len, num_heads, head_size]
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = scores.softmax(dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, values)
    return out.to(q.dtype)

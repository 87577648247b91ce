"""Reference multi-head latent attention (MLA, DeepSeek-V2/V3) in plain torch (CPU and CUDA).

Cache layout per layer: ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``,
one latent entry per token (``c_kv`` then ``k_pe``; see
:class:`lmkit.api.MLAAttentionBackend`). Planning is :class:`TorchAttention`'s, with the
query heads folded over one latent "KV head" (MQA-style): the step's requests split
into decodes and the rest, each group gathers its requests' blocks once per layer.

Two forms of the same maths, ``[k_nope | v] = c_kv @ w_kv_b.T`` per head:

* **absorbed** (decode groups, one query token per request): the query's no-RoPE part
  is folded into the latent space, ``q_lat = q_nope @ W_UK`` (``[heads, kv_lora_rank]``),
  attention runs over the latent cache as one shared head (scores ``q_lat . c_kv +
  q_pe . k_pe``, values ``c_kv``), and the output leaves the latent space through
  ``W_UV``: only the latent entries are read, never per-head keys and values.
* **decompressed** (prefill, chunked prefill, prefill over a cached prefix, multi-token
  queries): the gathered latent entries are expanded to per-head keys and values
  through ``w_kv_b`` and attended as ordinary multi-head attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lmkit.api import MLAAttentionBackend

from lmkit_plugins.attention.encoder_groups import place_rows
from lmkit_plugins.attention.torch_ref import TorchAttention, _Group


class MLATorchAttention(MLAAttentionBackend, TorchAttention):
    """Paged MLA with ``torch.nn.functional.scaled_dot_product_attention``.

    Handles prefill, prefill over a cached prefix, chunked prefill, decode and
    multi-token queries in one mixed batch; the reference the MLA kernels are tested
    against (:mod:`lmkit.testing.mla_attention`). Causal only, no sliding window, no
    draft trees.
    """

    #: the reference's planning would build tree masks, but the MLA path is not checked
    #: with them (the spec does not claim tree_mask): its plan refuses tree steps
    supports_tree_mask = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        if not self.causal:
            raise ValueError("mla_torch attends causally only (MLA models are decoders); "
                             "it was built with causal=False")
        if self.sliding_window is not None:
            raise ValueError(f"mla_torch has no sliding window (asked: {self.sliding_window})")
        if self.num_kv_heads != 1:
            raise ValueError(f"MLA stores one latent entry per token: num_kv_heads must be 1, "
                             f"got {self.num_kv_heads}")
        width = self.kv_lora_rank + self.qk_rope_head_dim
        if self.head_size != width:
            raise ValueError(f"MLA head_size must be kv_lora_rank + qk_rope_head_dim = {width}, "
                             f"got {self.head_size}")

    def run_mla(self, layer: int, q_nope: torch.Tensor, q_pe: torch.Tensor,
                kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                w_kv_b: torch.Tensor) -> torch.Tensor:
        """Write the latent entries at ``slot_mapping``, then attend every request causally
        (see :meth:`lmkit.api.MLAAttentionBackend.run_mla`).

        :return: ``[num_tokens, num_heads, v_head_dim]``
        """
        plan = self._plan
        if plan is None:
            raise RuntimeError("MLATorchAttention.run_mla() called before plan() for this step")
        n = plan.num_tokens
        width = kv_cache.shape[-1]
        # one write: [num_slots, width] <- [n, kv_lora_rank + qk_rope_head_dim]
        kv_cache.view(-1, width).index_copy_(
            0, plan.slot_mapping, torch.cat((kv_c[:n], k_pe[:n]), dim=-1).to(kv_cache.dtype))
        # w_kv_b: [heads * (nope + v), rank] -> [heads, nope + v, rank]
        w = w_kv_b.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, -1)
        out = q_nope.new_zeros(q_nope.shape[0], self.num_heads, self.v_head_dim)
        for group in plan.groups:
            if group.max_query_len == 1:
                o = self._attend_absorbed(group, q_nope, q_pe, kv_cache, w)
            else:
                o = self._attend_decompressed(group, q_nope, q_pe, kv_cache, w)
            if group.valid_rows is not None:
                o = o.index_select(0, group.valid_rows)
            place_rows(out, group.out_rows, o)
        return out

    # ------------------------------------------------------------------ attend

    def _latents(self, g: _Group, kv_cache: torch.Tensor) -> torch.Tensor:
        """The group's gathered latent entries, ``[R, kv_len, kv_lora_rank + rope]``."""
        width = kv_cache.shape[-1]
        blocks = kv_cache.view(kv_cache.shape[0], -1).index_select(0, g.block_ids)
        return blocks.view(g.num_reqs, g.num_kv_blocks * self.block_size, width)[:, :g.kv_len]

    @staticmethod
    def _rows(x: torch.Tensor, g: _Group) -> torch.Tensor:
        if isinstance(g.query_rows, slice):
            return x[g.query_rows]
        return x.index_select(0, g.query_rows)

    def _attend_absorbed(self, g: _Group, q_nope: torch.Tensor, q_pe: torch.Tensor,
                         kv_cache: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """One query token per request over the latent cache; ``[R, heads, v_head_dim]``."""
        rank, nope = self.kv_lora_rank, self.qk_nope_head_dim
        latent = self._latents(g, kv_cache).unsqueeze(1)  # [R, 1, kv_len, rank + rope]
        # q_lat[r, h] = q_nope[r, h] @ W_UK[h]: [R, heads, nope] x [heads, nope, rank]
        q_lat = torch.einsum("rhd,hdc->rhc", self._rows(q_nope, g), w[:, :nope])
        query = torch.cat((q_lat, self._rows(q_pe, g).to(q_lat.dtype)), dim=-1).unsqueeze(1)
        o = F.scaled_dot_product_attention(query, latent, latent[..., :rank], attn_mask=g.mask,
                                           scale=self.scale)  # [R, 1, heads, rank]
        # out[r, h] = o[r, h] @ W_UV[h].T: [R, heads, rank] x [heads, v, rank]
        return torch.einsum("rhc,hvc->rhv", o.squeeze(1), w[:, nope:])

    def _attend_decompressed(self, g: _Group, q_nope: torch.Tensor, q_pe: torch.Tensor,
                             kv_cache: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Per-head keys and values from the latents; ``[R * max_q, heads, v_head_dim]``."""
        r, max_q, heads = g.num_reqs, g.max_query_len, self.num_heads
        rank, nope = self.kv_lora_rank, self.qk_nope_head_dim
        latent = self._latents(g, kv_cache)  # [R, kv_len, rank + rope]
        kv = latent[..., :rank] @ w.reshape(-1, rank).t()  # [R, kv_len, heads * (nope + v)]
        kv = kv.view(r, g.kv_len, heads, -1).transpose(1, 2)  # [R, heads, kv_len, nope + v]
        k_pe = latent[..., rank:].unsqueeze(1).expand(r, heads, g.kv_len, -1)
        key = torch.cat((kv[..., :nope], k_pe), dim=-1)
        value = kv[..., nope:]
        query = torch.cat((self._rows(q_nope, g), self._rows(q_pe, g)), dim=-1)
        query = query.view(r, max_q, heads, -1).transpose(1, 2)  # [R, heads, max_q, d]
        # the plan's mask folds heads into the query axis: [R, 1, heads * max_q, kv_len]
        mask = None if g.mask is None else g.mask.view(r, heads, max_q, g.kv_len)
        o = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=self.scale)
        return o.transpose(1, 2).reshape(r * max_q, heads, self.v_head_dim)

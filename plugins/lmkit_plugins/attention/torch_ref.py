"""Reference paged attention in plain torch (CPU and CUDA).

KV cache layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_size]``
(index 0 keys, 1 values). :meth:`TorchAttention.plan` splits the step's requests into
at most two groups, decodes (one query token) and the rest, and builds per group, once
per step: the block ids whose keys it gathers, the query rows and the boolean mask.
:meth:`TorchAttention.run` then writes the new K/V through ``slot_mapping`` and runs one
``scaled_dot_product_attention`` per group over the gathered, padded K/V (scores and
softmax spelled out when built with a ``logits_soft_cap``). Query heads
that share a KV head are folded into the query axis, so K/V are never repeated.

Query token ``i`` of a request whose context before this step is ``c`` sits at position
``c + i`` and sees the keys at positions ``<= c + i`` (and ``> c + i - window`` with a
sliding window); built with ``causal=False`` (an encoder), every query sees all of its
request's keys (an encoder step is planned in :mod:`lmkit_plugins.attention.encoder_groups`).
A draft-tree step (metadata ``tree_mask``, see :mod:`lmkit_plugins.attention.tree_mask`)
is planned like any other with the tree's visibility in each tree request's mask (a
sliding window still applies on top, by the key index of each query token's slot).
The backend reads only blocks listed in ``block_tables``; stale slots in
a request's last block are masked out. KV caches must be allocated zeroed (the model
runner does), so that masked-out padding never holds NaN bit patterns.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from lmkit.api import AttentionBackend, AttentionMetadata

from lmkit_plugins.attention.encoder_groups import (
    MAX_LENGTH_GROUPS,
    BidirectionalGroup,
    BidirectionalPlan,
    Rows,
    contiguous_rows,
    fused_qkv_rows,
    place_rows,
    plan_bidirectional,
)
from lmkit_plugins.attention.fp8_kv import dequantize_kv, store_kv
from lmkit_plugins.attention.tree_mask import apply_tree, tree_regions

#: a group's draft trees: each request's region (host) and its query rows' mask bits
_Tree = tuple[np.ndarray, torch.Tensor]


@dataclass
class _Group:
    """Requests attended by one padded SDPA call."""

    num_reqs: int
    max_query_len: int
    kv_len: int  # keys gathered per request (the group's longest context)
    num_kv_blocks: int
    block_ids: torch.Tensor  # int64 [num_reqs * num_kv_blocks], on device
    query_rows: Rows  # packed token rows; [num_reqs * max_query_len] when padded
    out_rows: Rows  # packed token rows the valid outputs go to
    valid_rows: torch.Tensor | None  # rows of the padded output that are real tokens
    mask: torch.Tensor | None  # bool [num_reqs, 1, heads_per_kv * max_query_len, kv_len]


@dataclass
class _Plan:
    num_tokens: int
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    groups: list[_Group]
    covers_all: bool  # one group, all tokens in order, no padding: return its output as is


class TorchAttention(AttentionBackend):
    """Paged attention with ``torch.nn.functional.scaled_dot_product_attention``.

    Handles prefill, prefill over a cached prefix, chunked prefill, decode and
    multi-token decode queries (speculative decoding) in one mixed batch; GQA and an
    optional sliding window and attention-score soft cap; an FP8 (e4m3) cache; draft
    trees. It is the reference the fast backends are tested against.
    """

    supports_logits_soft_cap = True
    supports_fp8_kv_cache = True  # stored quantized, gathered blocks dequantized
    supports_tree_mask = True  # tree requests' masks built from their mask bits

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        self.heads_per_kv = self.num_heads // self.num_kv_heads
        self._plan: _Plan | None = None
        self._bidirectional: BidirectionalPlan | None = None
        # encoder steps: at most this many padded calls, over requests of similar length
        self.max_length_groups = MAX_LENGTH_GROUPS

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """``(2, num_blocks, block_size, num_kv_heads, head_size)``."""
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_size)

    # ------------------------------------------------------------------ plan

    def plan(self, metadata: AttentionMetadata) -> None:
        """Group the step's requests and build their gather indices and masks."""
        md = metadata
        self.refuse_tree_metadata(md)  # (subclasses that do not declare trees)
        regions = tree_regions(md)
        num_tokens = md.num_actual_tokens
        seq_lens = md.seq_lens_cpu[: md.num_reqs].numpy().astype(np.int64)
        self._bidirectional = None
        if regions is None and not self.causal and int(seq_lens.sum()) == num_tokens > 0:
            # an encoder's step: every key is this step's, so attend straight from k/v
            self._bidirectional = self._plan_bidirectional(md, seq_lens)
            self._plan = _Plan(num_tokens, md.slot_mapping[:num_tokens], [], False)
            return
        if regions is None and num_tokens == md.num_reqs > 0:
            # decodes only (one token each; no tree): one group, in order
            self._plan = _Plan(num_tokens, md.slot_mapping[:num_tokens],
                               [self._plan_decodes(md, seq_lens)], covers_all=True)
            return
        qsl = md.query_start_loc_cpu[: md.num_reqs + 1].numpy().astype(np.int64)
        query_lens = np.diff(qsl)
        is_decode = query_lens == 1
        groups = []
        for reqs in (np.flatnonzero(is_decode), np.flatnonzero(~is_decode)):
            if len(reqs):
                groups.append(self._plan_group(md, reqs, qsl, query_lens, seq_lens, regions))
        covers_all = (len(groups) == 1 and groups[0].valid_rows is None
                      and groups[0].query_rows == slice(0, num_tokens))
        self._plan = _Plan(num_tokens, md.slot_mapping[:num_tokens], groups, covers_all)

    def _plan_bidirectional(self, md: AttentionMetadata, lens: np.ndarray
                            ) -> BidirectionalPlan:
        return plan_bidirectional(md, lens, self.dtype, self.max_length_groups)

    def _plan_decodes(self, md: AttentionMetadata, seq_lens: np.ndarray) -> _Group:
        """:meth:`_plan_group` for a step whose every request decodes one token (the
        common step of single-stream and batched decoding), with less host work."""
        num_reqs = md.num_reqs
        kv_len = int(seq_lens.max())
        num_kv_blocks = -(-kv_len // self.block_size)
        block_ids = md.block_tables[:num_reqs, :num_kv_blocks].reshape(-1).to(torch.int64)
        mask = None
        if self.sliding_window is not None or bool((seq_lens != kv_len).any()):
            mask = self._build_mask(np.ones(num_reqs, dtype=np.int64), seq_lens, 1, kv_len,
                                    md.block_tables.device)
        rows = slice(0, num_reqs)
        return _Group(num_reqs, 1, kv_len, num_kv_blocks, block_ids, rows, rows, None, mask)

    def _plan_group(self, md: AttentionMetadata, reqs: np.ndarray, qsl: np.ndarray,
                    query_lens: np.ndarray, seq_lens: np.ndarray,
                    regions: np.ndarray | None = None) -> _Group:
        device = md.block_tables.device
        num_reqs = len(reqs)
        q_lens, s_lens = query_lens[reqs], seq_lens[reqs]
        max_q, kv_len = int(q_lens.max()), int(s_lens.max())
        num_kv_blocks = -(-kv_len // self.block_size)
        req_slice = contiguous_rows(reqs)
        if req_slice is not None:
            tables = md.block_tables[req_slice, :num_kv_blocks]
        else:
            tables = md.block_tables[torch.from_numpy(reqs).to(device), :num_kv_blocks]
        block_ids = tables.reshape(-1).to(torch.int64)

        starts = qsl[reqs]
        if max_q == 1:  # decodes: one row each, no padding
            rows: Rows = contiguous_rows(starts) or torch.from_numpy(starts).to(device)
            query_rows, out_rows, valid_rows = rows, rows, None
        elif num_reqs == 1:
            rows = slice(int(starts[0]), int(starts[0]) + max_q)
            query_rows, out_rows, valid_rows = rows, rows, None
        else:  # pad every request to max_q rows; padding repeats its last token
            offsets = np.arange(max_q)
            padded = starts[:, None] + np.minimum(offsets[None, :], q_lens[:, None] - 1)
            valid = (offsets[None, :] < q_lens[:, None]).reshape(-1)
            query_rows = torch.from_numpy(padded.reshape(-1)).to(device)
            valid_rows = torch.from_numpy(np.flatnonzero(valid)).to(device)
            dest = padded.reshape(-1)[valid]
            out_rows = contiguous_rows(dest) or torch.from_numpy(dest).to(device)

        tree: _Tree | None = None
        if md.tree_mask is not None and regions is not None and bool(regions[reqs].any()):
            # each padded query row's mask entry (padding repeats its request's last token)
            token_rows = starts[:, None] + np.minimum(np.arange(max_q)[None, :],
                                                      q_lens[:, None] - 1)
            rows_t = torch.from_numpy(token_rows.reshape(-1)).to(md.tree_mask.device)
            bits = md.tree_mask.index_select(0, rows_t).view(num_reqs, max_q)
            tree = (regions[reqs], bits.to(device))
        mask = None
        needs_mask = ((max_q > 1 and (self.causal or num_reqs > 1)) or tree is not None
                      or self.sliding_window is not None or bool((s_lens != kv_len).any()))
        if needs_mask:
            mask = self._build_mask(q_lens, s_lens, max_q, kv_len, device, tree)
        return _Group(num_reqs, max_q, kv_len, num_kv_blocks, block_ids, query_rows,
                      out_rows, valid_rows, mask)

    def _build_mask(self, q_lens: np.ndarray, s_lens: np.ndarray, max_q: int, kv_len: int,
                    device: torch.device, tree: _Tree | None = None) -> torch.Tensor:
        """bool ``[R, 1, heads_per_kv * max_q, kv_len]``: query i of request r sees key j
        (``tree``: the requests' tree regions and their query rows' mask bits)."""
        q_lens_t = torch.from_numpy(q_lens).to(device)
        ctx = torch.from_numpy(s_lens - q_lens).to(device)
        offsets = torch.arange(max_q, device=device)
        keys = torch.arange(kv_len, device=device)
        q_pos = ctx[:, None] + offsets[None, :]  # [R, max_q]
        if self.causal:
            allowed = keys[None, None, :] <= q_pos[:, :, None]  # [R, max_q, kv_len]
        else:  # bidirectional: every key of the request
            s_lens_t = torch.from_numpy(s_lens).to(device)
            allowed = (keys[None, None, :] < s_lens_t[:, None, None]).expand(-1, max_q, -1)
        if tree is not None:
            allowed = apply_tree(allowed, keys, s_lens, *tree)
        if self.sliding_window is not None:
            allowed &= keys[None, None, :] > (q_pos - self.sliding_window)[:, :, None]
        # padded query rows attend to key 0 only, so that no row is empty (NaN)
        pad = offsets[None, :] >= q_lens_t[:, None]
        allowed = torch.where(pad[:, :, None], keys[None, None, :] == 0, allowed)
        num_reqs = len(q_lens)
        return (allowed[:, None].expand(num_reqs, self.heads_per_kv, max_q, kv_len)
                .reshape(num_reqs, 1, self.heads_per_kv * max_q, kv_len))

    # ------------------------------------------------------------------ run

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            kv_cache: torch.Tensor) -> torch.Tensor:
        """Write ``k``/``v`` at ``slot_mapping``, then attend every request causally.

        :param q: ``[num_tokens, num_heads, head_size]``
        :param k: ``[num_tokens, num_kv_heads, head_size]``
        :param v: ``[num_tokens, num_kv_heads, head_size]``
        :return: ``[num_tokens, num_heads, head_size]``
        """
        plan = self._plan
        if plan is None:
            raise RuntimeError("TorchAttention.run() called before plan() for this step")
        n = plan.num_tokens
        if self._bidirectional is not None:  # (no K/V write: nothing reads an encoder's KV)
            return self._attend_bidirectional(self._bidirectional, q[:n], k[:n], v[:n])
        if k.shape[0] != n:  # padded (CUDA graph) inputs: only the first n rows are tokens
            k, v = k[:n], v[:n]
        scales = self.kv_scales(layer) if self.fp8_kv_cache else (1.0, 1.0)
        if self.fp8_kv_cache:
            store_kv(kv_cache, plan.slot_mapping, k, v, *scales)
        else:  # one write for keys and values: [2, num_slots, hkv, d] <- [2, n, hkv, d]
            kv_cache.view(2, -1, self.num_kv_heads, self.head_size).index_copy_(
                1, plan.slot_mapping, torch.stack((k, v)))
        if plan.covers_all and q.shape[0] == n:
            return self._attend(plan.groups[0], q, kv_cache, scales).view(
                n, self.num_heads, self.head_size)
        out = q.new_zeros(q.shape[0], self.num_heads, self.head_size)
        for group in plan.groups:
            o = self._attend(group, q, kv_cache, scales)
            if group.valid_rows is not None:
                o = o.index_select(0, group.valid_rows)
            place_rows(out, group.out_rows, o)
        return out

    def _sdpa(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              mask: torch.Tensor | None) -> torch.Tensor:
        """``softmax(scale * q k^T) v`` over the allowed keys (``mask``: boolean, ``True``
        where a query may see a key, or additive, ``-inf`` on hidden keys); scores
        soft-capped first when built with a ``logits_soft_cap`` (spelled out: SDPA has no
        soft cap)."""
        cap = self.logits_soft_cap
        if cap is None:
            return F.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                                  scale=self.scale)
        scores = torch.matmul(query, key.transpose(-1, -2)).mul_(self.scale / cap)
        scores = torch.tanh_(scores).mul_(cap)
        if mask is not None and mask.dtype == torch.bool:
            scores.masked_fill_(~mask, torch.finfo(scores.dtype).min)  # no NaN rows
        elif mask is not None:
            scores.add_(mask)
        probs = torch.softmax(scores, dim=-1,
                              dtype=torch.promote_types(scores.dtype, torch.float32))
        return torch.matmul(probs.to(value.dtype), value)

    def _attend_bidirectional(self, b: BidirectionalPlan, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor) -> torch.Tensor:
        """Every request's queries over all of its keys, from this step's k/v. Each group's
        padded output is copied once, whole, into the output: its padding rows land in
        spare rows after the tokens', which are then cut off (a view)."""
        fused = fused_qkv_rows(q, k, v)
        if b.covers_all:
            return self._attend_group(b.groups[0], q, k, v, fused)
        out = q.new_empty(b.num_tokens + b.num_padding, self.num_heads, self.head_size)
        for g in b.groups:
            o = self._attend_group(g, q, k, v, fused)
            place_rows(out, g.out_rows, o)
        return out[:b.num_tokens]

    def _attend_group(self, g: BidirectionalGroup, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, fused: torch.Tensor | None) -> torch.Tensor:
        """One group's padded call; returns its output ``[num_reqs * max_q, heads, d]``
        (padding rows included). ``fused``: q, k and v as one ``[tokens, width]`` row view
        (see :func:`fused_qkv_rows`), gathered in one call when given."""
        r, max_q, hkv, gq, d = (g.num_reqs, g.max_query_len, self.num_kv_heads,
                                self.heads_per_kv, self.head_size)

        def rows(x: torch.Tensor) -> torch.Tensor:
            return x[g.rows] if isinstance(g.rows, slice) else x.index_select(0, g.rows)

        if fused is not None:  # one gather; q, k, v are column slices of its rows
            qkv = rows(fused)
            qw, kw = self.num_heads * d, hkv * d
            gq_rows, gk_rows, gv_rows = (qkv[:, :qw], qkv[:, qw:qw + kw],
                                         qkv[:, qw + kw:qw + 2 * kw])
        else:
            gq_rows, gk_rows, gv_rows = rows(q), rows(k), rows(v)
        query = (gq_rows.reshape(r, max_q, hkv, gq, d).permute(0, 2, 3, 1, 4)
                 .reshape(r, hkv, gq * max_q, d))
        key = gk_rows.reshape(r, max_q, hkv, d).transpose(1, 2)  # [R, hkv, max_q, d]
        value = gv_rows.reshape(r, max_q, hkv, d).transpose(1, 2)
        o = self._sdpa(query, key, value, g.mask)
        return (o.view(r, hkv, gq, max_q, d).permute(0, 3, 1, 2, 4)
                .reshape(r * max_q, self.num_heads, d))

    def _attend(self, g: _Group, q: torch.Tensor, kv_cache: torch.Tensor,
                scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
        """One group's attention; returns ``[R * max_q, num_heads, head_size]``
        (``scales``: an FP8 cache's ``(k_scale, v_scale)``)."""
        num_blocks = kv_cache.shape[1]
        r, max_q, hkv, gq, d = (g.num_reqs, g.max_query_len, self.num_kv_heads,
                                self.heads_per_kv, self.head_size)
        # kv: [2, R * num_kv_blocks, block_size * hkv * d], contiguous; key j of request i,
        # head h starts at i * per_req + j * hkv * d + h * d (values after all keys)
        kv = kv_cache.view(2, num_blocks, -1).index_select(1, g.block_ids)
        if self.fp8_kv_cache:
            kv = dequantize_kv(kv, q.dtype, *scales)
        per_req = g.num_kv_blocks * self.block_size * hkv * d
        size, stride = (r, hkv, g.kv_len, d), (per_req, d, hkv * d, 1)
        key = kv.as_strided(size, stride)  # [R, hkv, kv_len, d]
        value = kv.as_strided(size, stride, r * per_req)
        if isinstance(g.query_rows, slice):
            # [R * max_q, heads, d]; all of q as is when the group is the whole step
            rows = q if g.query_rows == slice(0, q.shape[0]) else q[g.query_rows]
        else:
            rows = q.index_select(0, g.query_rows)
        if max_q == 1:
            query = rows.reshape(r, hkv, gq, d)
        else:  # [R, max_q, hkv, gq, d] -> [R, hkv, gq * max_q, d]
            query = (rows.reshape(r, max_q, hkv, gq, d).permute(0, 2, 3, 1, 4)
                     .reshape(r, hkv, gq * max_q, d))
        o = self._sdpa(query, key, value, g.mask)
        if max_q == 1:
            return o.reshape(r, self.num_heads, d)
        return (o.view(r, hkv, gq, max_q, d).permute(0, 3, 1, 2, 4)
                .reshape(r * max_q, self.num_heads, d))

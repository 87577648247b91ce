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
request's keys. The backend reads only blocks listed in ``block_tables``; stale slots in
a request's last block are masked out. KV caches must be allocated zeroed (the model
runner does), so that masked-out padding never holds NaN bit patterns.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from lmkit.api import AttentionBackend, AttentionMetadata

Rows = slice | torch.Tensor  # token or request rows: a slice when contiguous


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
class _BidirectionalPlan:
    """A non-causal step in which every request's keys are all this step's tokens."""

    num_reqs: int
    max_query_len: int
    rows: Rows  # packed token rows, [num_reqs * max_query_len] when padded
    valid_rows: torch.Tensor | None  # rows of the padded output that are real tokens
    mask: torch.Tensor | None  # bool [num_reqs, 1, heads_per_kv * max_q, max_q]
    # CPU: each request's token rows, attended one request at a time (no padding, no
    # gathers: faster there than one padded call); None: the padded call
    bounds: list[tuple[int, int]] | None = None


@dataclass
class _Plan:
    num_tokens: int
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    groups: list[_Group]
    covers_all: bool  # one group, all tokens in order, no padding: return its output as is


def _contiguous(idx: np.ndarray) -> slice | None:
    """``slice(a, b)`` when ``idx`` is ``a, a+1, ..., b-1``, else None."""
    if len(idx) and idx[-1] - idx[0] == len(idx) - 1:
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return None


class TorchAttention(AttentionBackend):
    """Paged attention with ``torch.nn.functional.scaled_dot_product_attention``.

    Handles prefill, prefill over a cached prefix, chunked prefill, decode and
    multi-token decode queries (speculative decoding) in one mixed batch; GQA and an
    optional sliding window and attention-score soft cap. It is the reference the fast
    backends are tested against.
    """

    supports_logits_soft_cap = True

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        self.heads_per_kv = self.num_heads // self.num_kv_heads
        self._plan: _Plan | None = None
        self._bidirectional: _BidirectionalPlan | None = None
        # encoder steps: one padded call for the step's requests (a key mask hides the
        # padding). One call per request avoids the padding but costs a call per request
        # per layer: for MiniLM batches of 64 on 2 CPU cores about even on a quiet machine
        # and 1.3x-6.7x slower when other jobs share the cores (in-process A/B)
        self.attend_per_request = False

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """``(2, num_blocks, block_size, num_kv_heads, head_size)``."""
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_size)

    # ------------------------------------------------------------------ plan

    def plan(self, metadata: AttentionMetadata) -> None:
        """Group the step's requests and build their gather indices and masks."""
        md = metadata
        num_tokens = md.num_actual_tokens
        seq_lens = md.seq_lens_cpu[: md.num_reqs].numpy().astype(np.int64)
        self._bidirectional = None
        if not self.causal and int(seq_lens.sum()) == num_tokens > 0:
            # an encoder's step: every key is this step's, so attend straight from k/v
            self._bidirectional = self._plan_bidirectional(md, seq_lens)
            self._plan = _Plan(num_tokens, md.slot_mapping[:num_tokens], [], False)
            return
        if num_tokens == md.num_reqs > 0:  # decodes only (one token each): one group, in order
            self._plan = _Plan(num_tokens, md.slot_mapping[:num_tokens],
                               [self._plan_decodes(md, seq_lens)], covers_all=True)
            return
        qsl = md.query_start_loc_cpu[: md.num_reqs + 1].numpy().astype(np.int64)
        query_lens = np.diff(qsl)
        is_decode = query_lens == 1
        groups = []
        for reqs in (np.flatnonzero(is_decode), np.flatnonzero(~is_decode)):
            if len(reqs):
                groups.append(self._plan_group(md, reqs, qsl, query_lens, seq_lens))
        covers_all = (len(groups) == 1 and groups[0].valid_rows is None
                      and groups[0].query_rows == slice(0, num_tokens))
        self._plan = _Plan(num_tokens, md.slot_mapping[:num_tokens], groups, covers_all)

    def _plan_bidirectional(self, md: AttentionMetadata, lens: np.ndarray
                            ) -> _BidirectionalPlan:
        """Rows padding each request to the longest, and the key-length mask."""
        device = md.block_tables.device
        num_reqs, max_q = md.num_reqs, int(lens.max())
        if num_reqs == 1 or bool((lens == max_q).all()):
            return _BidirectionalPlan(num_reqs, max_q, slice(0, num_reqs * max_q), None, None)
        starts = md.query_start_loc_cpu[:num_reqs].numpy().astype(np.int64)
        if self.attend_per_request:
            bounds = [(int(a), int(a + n)) for a, n in zip(starts, lens, strict=True)]
            return _BidirectionalPlan(num_reqs, max_q, slice(0), None, None, bounds)
        offsets = np.arange(max_q)
        padded = starts[:, None] + np.minimum(offsets[None, :], lens[:, None] - 1)
        valid = (offsets[None, :] < lens[:, None]).reshape(-1)
        allowed = torch.from_numpy(offsets[None, :] < lens[:, None]).to(device)  # [R, max_q]
        mask = allowed[:, None, None, :].expand(num_reqs, 1, self.heads_per_kv * max_q, max_q)
        return _BidirectionalPlan(num_reqs, max_q,
                                  torch.from_numpy(padded.reshape(-1)).to(device),
                                  torch.from_numpy(np.flatnonzero(valid)).to(device), mask)

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
                    query_lens: np.ndarray, seq_lens: np.ndarray) -> _Group:
        device = md.block_tables.device
        num_reqs = len(reqs)
        q_lens, s_lens = query_lens[reqs], seq_lens[reqs]
        max_q, kv_len = int(q_lens.max()), int(s_lens.max())
        num_kv_blocks = -(-kv_len // self.block_size)
        req_slice = _contiguous(reqs)
        if req_slice is not None:
            tables = md.block_tables[req_slice, :num_kv_blocks]
        else:
            tables = md.block_tables[torch.from_numpy(reqs).to(device), :num_kv_blocks]
        block_ids = tables.reshape(-1).to(torch.int64)

        starts = qsl[reqs]
        if max_q == 1:  # decodes: one row each, no padding
            rows: Rows = _contiguous(starts) or torch.from_numpy(starts).to(device)
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
            out_rows = _contiguous(dest) or torch.from_numpy(dest).to(device)

        mask = None
        needs_mask = ((max_q > 1 and (self.causal or num_reqs > 1))
                      or self.sliding_window is not None or bool((s_lens != kv_len).any()))
        if needs_mask:
            mask = self._build_mask(q_lens, s_lens, max_q, kv_len, device)
        return _Group(num_reqs, max_q, kv_len, num_kv_blocks, block_ids, query_rows,
                      out_rows, valid_rows, mask)

    def _build_mask(self, q_lens: np.ndarray, s_lens: np.ndarray, max_q: int, kv_len: int,
                    device: torch.device) -> torch.Tensor:
        """bool ``[R, 1, heads_per_kv * max_q, kv_len]``: query i of request r sees key j."""
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
        # one write for keys and values: [2, num_slots, hkv, d] <- [2, n, hkv, d] at the slots
        kv_cache.view(2, -1, self.num_kv_heads, self.head_size).index_copy_(
            1, plan.slot_mapping, torch.stack((k, v)))
        if plan.covers_all and q.shape[0] == n:
            return self._attend(plan.groups[0], q, kv_cache).view(n, self.num_heads,
                                                                   self.head_size)
        out = q.new_zeros(q.shape[0], self.num_heads, self.head_size)
        for group in plan.groups:
            o = self._attend(group, q, kv_cache)
            if group.valid_rows is not None:
                o = o.index_select(0, group.valid_rows)
            if isinstance(group.out_rows, slice):
                out[group.out_rows] = o
            else:
                out.index_copy_(0, group.out_rows, o)
        return out

    def _sdpa(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              mask: torch.Tensor | None) -> torch.Tensor:
        """``softmax(scale * q k^T) v`` over the allowed keys (``mask``: ``True`` where a
        query may see a key); scores soft-capped first when built with a
        ``logits_soft_cap`` (spelled out: SDPA has no soft cap)."""
        cap = self.logits_soft_cap
        if cap is None:
            return F.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                                  scale=self.scale)
        scores = torch.matmul(query, key.transpose(-1, -2)).mul_(self.scale / cap)
        scores = torch.tanh_(scores).mul_(cap)
        if mask is not None:
            scores.masked_fill_(~mask, torch.finfo(scores.dtype).min)  # no NaN rows
        probs = torch.softmax(scores, dim=-1,
                              dtype=torch.promote_types(scores.dtype, torch.float32))
        return torch.matmul(probs.to(value.dtype), value)

    def _attend_bidirectional(self, b: _BidirectionalPlan, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor) -> torch.Tensor:
        """Every request's queries over all of its keys, from this step's k/v."""
        r, max_q, hkv, gq, d = (b.num_reqs, b.max_query_len, self.num_kv_heads,
                                self.heads_per_kv, self.head_size)
        if b.bounds is not None:
            out = q.new_empty(q.shape[0], self.num_heads, d)
            for start, end in b.bounds:  # [n, heads, d] -> [hkv, gq * n, d] per request
                n = end - start
                o = self._sdpa(
                    q[start:end].view(n, hkv, gq, d).permute(1, 2, 0, 3).reshape(hkv, gq * n, d),
                    k[start:end].transpose(0, 1), v[start:end].transpose(0, 1), None)
                out[start:end] = o.view(hkv, gq, n, d).permute(2, 0, 1, 3).reshape(n, -1, d)
            return out

        def rows(x: torch.Tensor) -> torch.Tensor:
            return x[b.rows] if isinstance(b.rows, slice) else x.index_select(0, b.rows)

        query = (rows(q).reshape(r, max_q, hkv, gq, d).permute(0, 2, 3, 1, 4)
                 .reshape(r, hkv, gq * max_q, d))
        key = rows(k).reshape(r, max_q, hkv, d).transpose(1, 2)  # [R, hkv, max_q, d]
        value = rows(v).reshape(r, max_q, hkv, d).transpose(1, 2)
        o = self._sdpa(query, key, value, b.mask)
        o = (o.view(r, hkv, gq, max_q, d).permute(0, 3, 1, 2, 4)
             .reshape(r * max_q, self.num_heads, d))
        return o if b.valid_rows is None else o.index_select(0, b.valid_rows)

    def _attend(self, g: _Group, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """One group's attention; returns ``[R * max_q, num_heads, head_size]``."""
        num_blocks = kv_cache.shape[1]
        r, max_q, hkv, gq, d = (g.num_reqs, g.max_query_len, self.num_kv_heads,
                                self.heads_per_kv, self.head_size)
        # kv: [2, R * num_kv_blocks, block_size * hkv * d], contiguous; key j of request i,
        # head h starts at i * per_req + j * hkv * d + h * d (values after all keys)
        kv = kv_cache.view(2, num_blocks, -1).index_select(1, g.block_ids)
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

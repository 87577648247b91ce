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
class _BidirectionalGroup:
    """Requests of an encoder step attended by one padded SDPA call."""

    num_reqs: int
    max_query_len: int
    rows: Rows  # packed token rows, [num_reqs * max_query_len] when padded
    # where each row of the padded output goes: its token's row, or for a padding row
    # one of the spare rows after the step's tokens (see _BidirectionalPlan.num_padding)
    out_rows: Rows
    mask: torch.Tensor | None  # additive [num_reqs, 1, 1, max_q]: -inf on padding keys


@dataclass
class _BidirectionalPlan:
    """A non-causal step in which every request's keys are all this step's tokens:
    its requests in groups of similar length (see :func:`length_groups`)."""

    num_tokens: int
    groups: list[_BidirectionalGroup]
    covers_all: bool  # one group, all tokens in order, no padding
    num_padding: int = 0  # padding rows of all groups: the output's spare rows


# length_groups' estimate of one SDPA call's fixed cost, in padded (query, key) pairs
# per head: about one 64-token request's worth
_CALL_COST = 64 * 64
_MAX_GROUPS = 8
# In bfloat16 on the CPU, encoder groups are padded to a multiple of this many tokens:
# torch's CPU flash-attention kernel runs sequence lengths that are multiples of 16 two
# to four times faster than the lengths just below them (head size 32: 16 x 12 heads
# at 46 tokens 1.7 ms, at 48 tokens 0.9 ms; at 15 tokens slower than at 16), so the
# masked padding costs less than it saves (MiniLM batches of 64: 1.1x the texts/s in
# bfloat16; in float32, where the matmuls dominate, no gain was measured)
_CPU_SDPA_ALIGN = 16


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def length_groups(lens: np.ndarray, max_groups: int = _MAX_GROUPS, align: int = 1
                  ) -> list[np.ndarray]:
    """Split requests of (key) lengths ``lens`` into at most ``max_groups`` groups
    attended by one padded call each, with the smallest estimated cost: padded
    query-key pairs (each group padded to its longest, rounded up to a multiple of
    ``align``) plus :data:`_CALL_COST` per call. Groups are runs of the requests sorted
    by length; a small dynamic program over the distinct padded lengths finds the best
    cut points exactly (cutting between requests of the same padded length never
    helps). Padding every request of a step to the longest wastes most of the attention
    work when lengths vary (MiniLM batches of 6 to 40 word sentences: 2.7x the real
    pairs); one call per request costs a call per request per layer."""
    order = np.argsort(lens, kind="stable")
    padded = -(-lens[order].astype(np.int64) // align) * align
    sizes, counts = np.unique(padded, return_counts=True)  # ascending padded lengths
    m = len(sizes)
    cum = np.concatenate(([0], np.cumsum(counts)))
    # cost[i, j]: one call over the requests of padded lengths sizes[i..j]
    members = cum[None, 1:] - cum[:-1, None]
    with np.errstate(invalid="ignore"):
        cost = np.where(members > 0, members * sizes[None, :].astype(np.float64) ** 2
                        + _CALL_COST, np.inf)
    # best[g][j]: cheapest cover of sizes[0..j] by g + 1 calls; cut[g][j]: where the
    # last call starts
    best = [cost[0]]
    cuts = [np.zeros(m, dtype=np.int64)]
    for _ in range(1, min(max_groups, m)):
        prev = np.concatenate(([np.inf], best[-1][:-1]))  # best cover of sizes[0..i-1]
        total = prev[:, None] + cost  # [i, j]: last call over sizes[i..j]
        cuts.append(np.argmin(total, axis=0))
        best.append(total[cuts[-1], np.arange(m)])
    g = int(np.argmin([b[m - 1] for b in best]))
    bounds, j = [], m - 1
    while g >= 0:
        i = int(cuts[g][j]) if g else 0
        bounds.append((int(cum[i]), int(cum[j + 1])))
        j, g = i - 1, g - 1
    return [order[a:b] for a, b in reversed(bounds)]


@dataclass
class _Plan:
    num_tokens: int
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    groups: list[_Group]
    covers_all: bool  # one group, all tokens in order, no padding: return its output as is


def _contiguous(idx: np.ndarray) -> slice | None:
    """``slice(a, b)`` when ``idx`` is ``a, a+1, ..., b-1`` (in that order), else None."""
    if (len(idx) and idx[-1] - idx[0] == len(idx) - 1
            and (len(idx) == 1 or bool((np.diff(idx) == 1).all()))):
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return None


def _fused_qkv_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """``[tokens, width]``: the rows of one fused QKV projection output that ``q``, ``k``
    and ``v`` (``[tokens, heads, d]``) are adjacent column slices of (q, then k, then v,
    each row's heads contiguous), so that one gather moves all three; None otherwise."""
    if q.dim() != 3 or k.shape != v.shape or not (q.shape[0] == k.shape[0] > 0):
        return None
    qw, kw = q.shape[1] * q.shape[2], k.shape[1] * k.shape[2]
    size = q.element_size()
    row = q.stride(0)
    if (q.dtype != k.dtype or q.dtype != v.dtype or q.device != k.device
            or q.device != v.device or q.untyped_storage().data_ptr()
            != k.untyped_storage().data_ptr()
            or k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr()):
        return None
    for x in (q, k, v):
        if x.stride() != (row, x.shape[2], 1):
            return None
    if (k.data_ptr() - q.data_ptr() != qw * size or v.data_ptr() - k.data_ptr() != kw * size
            or row < qw + 2 * kw):
        return None
    return q.as_strided((q.shape[0], qw + 2 * kw), (row, 1))


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
        # encoder steps: at most this many padded calls, over requests of similar length
        self.max_length_groups = _MAX_GROUPS

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
        """The step's requests in groups of similar length (:func:`length_groups`), each
        padded to its longest (in bfloat16 on the CPU rounded up to a multiple of
        :data:`_CPU_SDPA_ALIGN`), with an additive mask hiding the padding keys."""
        device = md.block_tables.device
        num_reqs, n = md.num_reqs, int(lens.sum())
        align = (_CPU_SDPA_ALIGN if device.type == "cpu" and self.dtype == torch.bfloat16
                 else 1)
        if (num_reqs == 1 or bool((lens == lens[0]).all())) and lens[0] % align == 0:
            rows = slice(0, n)
            return _BidirectionalPlan(n, [_BidirectionalGroup(num_reqs, int(lens[0]), rows,
                                                              rows, None)], True)
        starts = md.query_start_loc_cpu[:num_reqs].numpy().astype(np.int64)
        groups = []
        spare = n  # the next spare output row (padding rows are written there, unread)
        for reqs in length_groups(lens, self.max_length_groups, align):
            g_lens, g_starts = lens[reqs], starts[reqs]
            max_q = _round_up(int(g_lens.max()), align)
            if len(reqs) == 1 and g_lens[0] == max_q:
                rows = slice(int(g_starts[0]), int(g_starts[0]) + max_q)
                groups.append(_BidirectionalGroup(1, max_q, rows, rows, None))
                continue
            offsets = np.arange(max_q)
            padded = (g_starts[:, None] + np.minimum(offsets[None, :], g_lens[:, None] - 1)
                      ).reshape(-1)
            valid = (offsets[None, :] < g_lens[:, None]).reshape(-1)
            mask = None
            dest = padded
            if not bool(valid.all()):
                mask = torch.zeros(len(reqs), 1, 1, max_q, dtype=self.dtype)
                mask.masked_fill_(torch.from_numpy(~valid.reshape(len(reqs), 1, 1, max_q)),
                                  float("-inf"))
                mask = mask.to(device)
                num_pad = int((~valid).sum())
                dest = padded.copy()
                dest[~valid] = np.arange(spare, spare + num_pad)
                spare += num_pad
            groups.append(_BidirectionalGroup(
                len(reqs), max_q, torch.from_numpy(padded).to(device),
                _contiguous(dest) or torch.from_numpy(dest).to(device), mask))
        return _BidirectionalPlan(n, groups, False, spare - n)

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

    def _attend_bidirectional(self, b: _BidirectionalPlan, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor) -> torch.Tensor:
        """Every request's queries over all of its keys, from this step's k/v. Each group's
        padded output is copied once, whole, into the output: its padding rows land in
        spare rows after the tokens', which are then cut off (a view)."""
        fused = _fused_qkv_rows(q, k, v)
        if b.covers_all:
            return self._attend_group(b.groups[0], q, k, v, fused)
        out = q.new_empty(b.num_tokens + b.num_padding, self.num_heads, self.head_size)
        for g in b.groups:
            o = self._attend_group(g, q, k, v, fused)
            if isinstance(g.out_rows, slice):
                out[g.out_rows] = o
            else:
                out.index_copy_(0, g.out_rows, o)
        return out[:b.num_tokens]

    def _attend_group(self, g: _BidirectionalGroup, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, fused: torch.Tensor | None) -> torch.Tensor:
        """One group's padded call; returns its output ``[num_reqs * max_q, heads, d]``
        (padding rows included). ``fused``: q, k and v as one ``[tokens, width]`` row view
        (see :func:`_fused_qkv_rows`), gathered in one call when given."""
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

"""Encoder (non-causal) steps of :class:`~lmkit_plugins.attention.torch_ref.TorchAttention`:
the step's requests in groups of similar length, each attended by one padded SDPA call.

In an encoder step every key a request sees is one of this step's tokens, so attention
reads the step's k/v directly (no KV cache). :func:`plan_bidirectional` builds, once per
step, the groups (:func:`length_groups`), each group's padded token rows, where its
output rows go, and its additive key mask; :func:`fused_qkv_rows` lets one gather move
q, k and v when they are column slices of a fused QKV projection's rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from lmkit.api import AttentionMetadata

Rows = slice | torch.Tensor  # token or request rows: a slice when contiguous


@dataclass
class BidirectionalGroup:
    """Requests of an encoder step attended by one padded SDPA call."""

    num_reqs: int
    max_query_len: int
    rows: Rows  # packed token rows, [num_reqs * max_query_len] when padded
    # where each row of the padded output goes: its token's row, or for a padding row
    # one of the spare rows after the step's tokens (see BidirectionalPlan.num_padding)
    out_rows: Rows
    mask: torch.Tensor | None  # additive [num_reqs, 1, 1, max_q]: -inf on padding keys


@dataclass
class BidirectionalPlan:
    """A non-causal step in which every request's keys are all this step's tokens:
    its requests in groups of similar length (see :func:`length_groups`)."""

    num_tokens: int
    groups: list[BidirectionalGroup]
    covers_all: bool  # one group, all tokens in order, no padding
    num_padding: int = 0  # padding rows of all groups: the output's spare rows


# length_groups' estimate of one SDPA call's fixed cost, in padded (query, key) pairs
# per head: about one 64-token request's worth
_CALL_COST = 64 * 64
MAX_LENGTH_GROUPS = 8
# In bfloat16 on the CPU, encoder groups are padded to a multiple of this many tokens:
# torch's CPU flash-attention kernel runs sequence lengths that are multiples of 16 two
# to four times faster than the lengths just below them (head size 32: 16 x 12 heads
# at 46 tokens 1.7 ms, at 48 tokens 0.9 ms; at 15 tokens slower than at 16), so the
# masked padding costs less than it saves (MiniLM batches of 64: 1.1x the texts/s in
# bfloat16; in float32, where the matmuls dominate, no gain was measured)
_CPU_SDPA_ALIGN = 16


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def length_groups(lens: np.ndarray, max_groups: int = MAX_LENGTH_GROUPS, align: int = 1
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


def place_rows(out: torch.Tensor, rows: Rows, values: torch.Tensor) -> None:
    """Write ``values`` into ``out``'s ``rows`` (a slice: a view copy; else an index copy)."""
    if isinstance(rows, slice):
        out[rows] = values
    else:
        out.index_copy_(0, rows, values)


def contiguous_rows(idx: np.ndarray) -> slice | None:
    """``slice(a, b)`` when ``idx`` is ``a, a+1, ..., b-1`` (in that order), else None."""
    if (len(idx) and idx[-1] - idx[0] == len(idx) - 1
            and (len(idx) == 1 or bool((np.diff(idx) == 1).all()))):
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return None


def fused_qkv_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
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


def plan_bidirectional(md: AttentionMetadata, lens: np.ndarray, dtype: torch.dtype,
                   max_groups: int = MAX_LENGTH_GROUPS) -> BidirectionalPlan:
    """The step's requests in groups of similar length (:func:`length_groups`), each
    padded to its longest (in bfloat16 on the CPU rounded up to a multiple of
    :data:`_CPU_SDPA_ALIGN`), with an additive mask hiding the padding keys."""
    device = md.block_tables.device
    num_reqs, n = md.num_reqs, int(lens.sum())
    align = (_CPU_SDPA_ALIGN if device.type == "cpu" and dtype == torch.bfloat16
             else 1)
    if (num_reqs == 1 or bool((lens == lens[0]).all())) and lens[0] % align == 0:
        rows = slice(0, n)
        return BidirectionalPlan(n, [BidirectionalGroup(num_reqs, int(lens[0]), rows,
                                                          rows, None)], True)
    starts = md.query_start_loc_cpu[:num_reqs].numpy().astype(np.int64)
    groups = []
    spare = n  # the next spare output row (padding rows are written there, unread)
    for reqs in length_groups(lens, max_groups, align):
        g_lens, g_starts = lens[reqs], starts[reqs]
        max_q = _round_up(int(g_lens.max()), align)
        if len(reqs) == 1 and g_lens[0] == max_q:
            rows = slice(int(g_starts[0]), int(g_starts[0]) + max_q)
            groups.append(BidirectionalGroup(1, max_q, rows, rows, None))
            continue
        offsets = np.arange(max_q)
        padded = (g_starts[:, None] + np.minimum(offsets[None, :], g_lens[:, None] - 1)
                  ).reshape(-1)
        valid = (offsets[None, :] < g_lens[:, None]).reshape(-1)
        mask = None
        dest = padded
        if not bool(valid.all()):
            mask = torch.zeros(len(reqs), 1, 1, max_q, dtype=dtype)
            mask.masked_fill_(torch.from_numpy(~valid.reshape(len(reqs), 1, 1, max_q)),
                              float("-inf"))
            mask = mask.to(device)
            num_pad = int((~valid).sum())
            dest = padded.copy()
            dest[~valid] = np.arange(spare, spare + num_pad)
            spare += num_pad
        groups.append(BidirectionalGroup(
            len(reqs), max_q, torch.from_numpy(padded).to(device),
            contiguous_rows(dest) or torch.from_numpy(dest).to(device), mask))
    return BidirectionalPlan(n, groups, False, spare - n)

"""The ``ngram`` proposer: prompt lookup decoding.

For each request, take its last ``n`` tokens (``n`` from ``prompt_lookup_max`` down to
``prompt_lookup_min``), find their latest earlier occurrence in the request's prompt
and output, and draft the (at most ``k``) tokens that followed it. Summaries,
rewrites, code edits and quoting repeat long stretches of the context, and there
several drafts in a row are right.

The whole batch is searched at once in numpy (:func:`find_drafts`): one pass of
vectorised comparisons per suffix length over a ``[batch, context]`` token matrix,
O(context x prompt_lookup_max) per request and no Python loop over tokens. Token
histories live in a persistent buffer, so each step copies only the tokens that are
new since the request was last seen.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from lmkit.api import Proposal, ProposerInput, SpecProposer


def find_drafts(tokens: np.ndarray, lens: np.ndarray, k: int, min_n: int, max_n: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """Prompt lookup for a batch.

    Args:
        tokens: int64 ``[batch, width]``, row ``b`` holding its history in
            ``[0, lens[b])`` (the rest is ignored).
        lens: int64 ``[batch]``, history lengths.
        k: most tokens to draft per row.
        min_n, max_n: suffix lengths to try, longest first.

    Returns:
        ``(drafts [batch, k] int64, counts [batch] int64)``: row ``b`` drafts
        ``drafts[b, :counts[b]]`` -- the tokens after the latest earlier occurrence of
        its longest matching suffix (``counts[b] == 0`` when none matches).
    """
    batch, width = tokens.shape
    if batch == 0 or width == 0 or k <= 0:
        return np.zeros((batch, max(k, 0)), dtype=np.int64), np.zeros(batch, dtype=np.int64)
    cols = np.arange(width)
    # suffix[b, j] = tokens[b, lens[b] - 1 - j]; -1 (matches nothing) before the start
    back = lens[:, None] - 1 - np.arange(max_n)[None, :]  # [batch, max_n]
    suffix = np.where(back >= 0, np.take_along_axis(tokens, np.maximum(back, 0), axis=1), -1)
    # match[b, e]: the j tokens ending at e equal the last j tokens, for j = 1, 2, ...;
    # e <= lens[b] - 2 so that at least one token follows the match
    match = (tokens == suffix[:, :1]) & (cols[None, :] <= lens[:, None] - 2)
    best_end = np.full(batch, -1, dtype=np.int64)
    found: list[tuple[int, np.ndarray]] = []
    for j in range(1, max_n + 1):
        if j > 1:
            shifted = np.zeros_like(match)
            shifted[:, j - 1:] = match[:, j - 1:] & (tokens[:, :width - j + 1]
                                                    == suffix[:, j - 1:j])
            match = shifted
        if j >= min_n:
            found.append((j, match))
        if not match.any():
            break
    for _, m in reversed(found):  # longest first; within one length, the latest match
        has = m.any(axis=1) & (best_end < 0)
        if has.any():
            latest = width - 1 - np.argmax(m[:, ::-1], axis=1)
            best_end = np.where(has, latest, best_end)
    idx = best_end[:, None] + 1 + np.arange(k)[None, :]  # [batch, k]
    valid = (best_end[:, None] >= 0) & (idx < lens[:, None])
    drafts = np.take_along_axis(tokens, np.minimum(idx, width - 1), axis=1)
    return np.where(valid, drafts, 0), valid.sum(axis=1)


class NgramProposer(SpecProposer):
    """Prompt-lookup drafts (see the module docstring).

    Args:
        config: the engine config (``speculative.num_speculative_tokens`` is ``k``).
        options: :class:`lmkit_plugins.spec.NgramOptions`.
    """

    def __init__(self, config: Any, options: Any = None) -> None:
        from lmkit_plugins.spec import NgramOptions

        opts = options if options is not None else NgramOptions()
        self.k = config.speculative.num_speculative_tokens
        self.min_n = opts.prompt_lookup_min
        self.max_n = opts.prompt_lookup_max
        self.row_of: dict[str, int] = {}
        self.free_rows: list[int] = list(range(7, -1, -1))  # popped lowest first
        self.tokens = np.zeros((8, 256), dtype=np.int64)  # [rows, width] histories
        self.lens = np.zeros(8, dtype=np.int64)

    def propose(self, batch: ProposerInput) -> Proposal:
        """Draft up to ``batch.num_spec_tokens`` tokens per request by prompt lookup."""
        if not batch.req_ids:
            return Proposal([])
        rows = np.fromiter((self._sync(rid, toks) for rid, toks in
                            zip(batch.req_ids, batch.token_ids, strict=True)),
                           dtype=np.int64, count=len(batch.req_ids))
        lens = self.lens[rows]
        width = int(lens.max())
        drafts, counts = find_drafts(self.tokens[rows, :width], lens, batch.num_spec_tokens,
                                     self.min_n, self.max_n)
        return Proposal([row[:c] for row, c in zip(drafts.tolist(), counts.tolist(),
                                                    strict=True)])

    def remove_requests(self, req_ids: set[str]) -> None:
        """Free the history rows of ``req_ids`` (unknown ids are ignored)."""
        for rid in req_ids:
            row = self.row_of.pop(rid, None)
            if row is not None:
                self.lens[row] = 0
                self.free_rows.append(row)

    def _sync(self, req_id: str, token_ids: Any) -> int:
        """The request's row, holding ``token_ids``; copies only the new tail."""
        row = self.row_of.get(req_id)
        if row is None:
            row = self._new_row(req_id)
        n = len(token_ids)
        have = int(self.lens[row])
        # a history that shrank or changed (not just grew) is copied again from scratch
        if have > n or (have and self.tokens[row, have - 1] != token_ids[have - 1]):
            have = 0
        if n > self.tokens.shape[1]:
            self._grow(self.tokens.shape[0], max(2 * self.tokens.shape[1], n))
        if n > have:
            self.tokens[row, have:n] = token_ids[have:n]
        self.lens[row] = n
        return row

    def _new_row(self, req_id: str) -> int:
        if not self.free_rows:
            old = self.tokens.shape[0]
            self._grow(2 * old, self.tokens.shape[1])
            self.free_rows.extend(range(2 * old - 1, old - 1, -1))
        row = self.free_rows.pop()
        self.row_of[req_id] = row
        self.lens[row] = 0
        return row

    def _grow(self, num_rows: int, width: int) -> None:
        tokens = np.zeros((num_rows, width), dtype=np.int64)
        old_rows, old_width = self.tokens.shape
        tokens[:old_rows, :old_width] = self.tokens
        lens = np.zeros(num_rows, dtype=np.int64)
        lens[:old_rows] = self.lens
        self.tokens, self.lens = tokens, lens

"""One step's sampling with draft verification: the model runner's sampler when any
request carries draft tokens.

The runner computes logits at every draft position and the bonus position of each
request (``k_i + 1`` consecutive rows, see :mod:`lmkit.spec_decode.rejection`) and
builds :class:`~lmkit.sample.metadata.SamplingMetadata` with one row per position (the
request's parameters repeated, its output extended by the drafts before that position),
so logit bias, penalties, the min_tokens ban and the filters act at every position
exactly as they would have one token at a time. Then, all batched:

1. raw logprobs (rows asking) -> :func:`~lmkit.sample.sampler.adjust_logits`;
2. greedy rows: argmax; random rows: :func:`~lmkit.sample.sampler.compute_probs`, the
   recovery distributions, one draw per row, one acceptance uniform per draft;
3. accepted prefix per request, output tokens, one device-to-host copy.

A step whose rows are all greedy and ask no logprobs (the common case of a copy
workload) takes a shorter path, :meth:`SpecDecodeSampler.verify_greedy`: one argmax
over the (adjusted) logits, one device-to-host copy of the targets, and the accepted
prefixes found on the host. The model runner calls it directly, without building
sampling metadata, when no request needs its logits adjusted.

Seeded requests draw every random number from their own generator (per row, in row
order, then per draft), so they stay reproducible whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from lmkit.api.outputs import TokenLogprob
from lmkit.sample.logprobs import to_token_logprobs
from lmkit.sample.metadata import SamplingMetadata
from lmkit.sample.sampler import Sampler, adjust_logits, compute_probs, sample_from_probs
from lmkit.spec_decode import rejection


@dataclass
class VerifiedTokens:
    """Per request, the tokens to append (``num_accepted[i] + 1`` of them) and, for
    requests asking, their logprobs."""

    token_ids: list[list[int]]
    num_accepted: list[int]
    logprobs: list[list[TokenLogprob]] | None = None


@dataclass
class _DraftLayout:
    """Where the drafts sit among the flat rows (host arrays turned into tensors)."""

    num_drafts: list[int]
    row_starts: list[int]  # first row of each request
    rows: torch.Tensor  # int64 [num_drafts_total]
    token_ids: torch.Tensor  # int64 [num_drafts_total]
    req: torch.Tensor  # int64 [num_drafts_total]
    pos: torch.Tensor  # int64 [num_drafts_total]

    @classmethod
    def build(cls, drafts: Sequence[Sequence[int]], device: torch.device) -> _DraftLayout:
        num_drafts = np.fromiter(map(len, drafts), dtype=np.int64, count=len(drafts))
        per_req = num_drafts + 1
        starts = np.cumsum(per_req) - per_req
        total = int(num_drafts.sum())
        req = np.repeat(np.arange(len(drafts)), num_drafts)
        pos = np.arange(total) - np.repeat(np.cumsum(num_drafts) - num_drafts, num_drafts)
        token_ids = np.fromiter(chain.from_iterable(drafts), dtype=np.int64, count=total)

        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device, non_blocking=True)

        return cls(num_drafts.tolist(), starts.tolist(), dev(starts[req] + pos), dev(token_ids),
                   dev(req), dev(pos))


class SpecDecodeSampler:
    """Samples a step whose requests may carry drafts; verifies the drafts.

    Args:
        sampler: the plain sampler, used unchanged for a step without drafts.
    """

    def __init__(self, sampler: Sampler | None = None) -> None:
        self.sampler = sampler or Sampler()

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata,
                 drafts: Sequence[Sequence[int]],
                 draft_probs: Sequence[torch.Tensor | None] | None = None) -> VerifiedTokens:
        """Verify every request's drafts and sample its next token.

        Args:
            logits: ``[num_rows, vocab]``, ``len(drafts[i]) + 1`` consecutive rows per
                request; not modified.
            md: one row per logits row.
            drafts: per request its draft token ids (empty: a plain decode or the last
                prefill chunk).
            draft_probs: per request ``[len(drafts[i]), vocab]`` draft distributions, or
                ``None`` (deterministic drafts, one-hot).

        Returns:
            per request the accepted drafts then one target token.
        """
        if not any(drafts):
            out = self.sampler(logits, md)
            tokens = out.sampled_token_ids.tolist()
            lps = None if out.logprobs is None else [[lp] if lp else [] for lp in out.logprobs]
            return VerifiedTokens([[t] for t in tokens], [0] * len(tokens), lps)
        num_rows = len(drafts) + sum(map(len, drafts))
        if logits.dim() != 2 or logits.shape[0] != md.num_rows or md.num_rows != num_rows:
            raise ValueError(f"SpecDecodeSampler expects logits and metadata with one row per "
                             f"draft plus one per request ({num_rows}); got logits "
                             f"{tuple(logits.shape)}, metadata {md.num_rows} rows")
        if md.all_greedy and md.logprob_rows is None:
            if md.needs_logit_adjustment:
                logits = adjust_logits(logits.to(torch.float32, copy=True), md)
            return self.verify_greedy(logits, drafts)
        layout = _DraftLayout.build(drafts, logits.device)
        raw_logprobs = None
        if md.logprob_rows is not None:
            raw_logprobs = logits[md.logprob_rows].float().log_softmax(dim=-1)
        if md.all_greedy and not md.needs_logit_adjustment:
            adjusted = logits  # only read (argmax): no copy
        else:
            adjusted = adjust_logits(logits.to(torch.float32, copy=True), md)
        greedy_ids = None if md.all_random else adjusted.argmax(dim=-1)
        if md.all_greedy:
            assert greedy_ids is not None
            row_tokens = greedy_ids
            accepted = layout.token_ids == greedy_ids[layout.rows]
        else:
            row_tokens, accepted = self._sample_random(adjusted, md, layout, draft_probs)
            if greedy_ids is not None:
                row_tokens = torch.where(md.is_greedy, greedy_ids, row_tokens)
                accepted = torch.where(md.is_greedy[layout.rows],
                                       layout.token_ids == greedy_ids[layout.rows], accepted)
        out_tokens = rejection.select_output_tokens(row_tokens, layout.rows, layout.token_ids,
                                                    accepted)
        num_accepted = rejection.count_accepted(accepted, layout.req, layout.pos, len(drafts),
                                                max(layout.num_drafts))
        host = torch.cat([out_tokens, num_accepted]).tolist()  # the one device-to-host copy
        rows_out, accepted_l = host[:md.num_rows], host[md.num_rows:]
        token_ids = [rows_out[s:s + n + 1] for s, n in zip(layout.row_starts, accepted_l,
                                                             strict=True)]
        logprobs = None
        if raw_logprobs is not None:
            logprobs = self._logprobs(out_tokens, raw_logprobs, md, layout, accepted_l)
        return VerifiedTokens(token_ids, accepted_l, logprobs)

    @staticmethod
    def verify_greedy(logits: torch.Tensor, drafts: Sequence[Sequence[int]]
                      ) -> VerifiedTokens:
        """Verify a step whose rows are all greedy on these logits (already adjusted, or
        needing no adjustment) and ask no logprobs: one argmax on the device, one
        device-to-host copy of the ``[num_rows]`` targets, then the accepted prefixes
        on the host (O(drafts) Python, no further device work).

        Args:
            logits: ``[num_rows, vocab]``, ``len(drafts[i]) + 1`` rows per request.
            drafts: per request its draft token ids (empty: a plain decode).

        Returns:
            per request the accepted drafts then the target token after them.
        """
        targets = logits.argmax(dim=-1).tolist()  # the one device-to-host copy
        if len(targets) != len(drafts) + sum(map(len, drafts)):
            raise ValueError(f"verify_greedy expects one logits row per draft plus one per "
                             f"request; got {len(targets)} rows for {len(drafts)} requests "
                             f"with {sum(map(len, drafts))} drafts")
        token_ids, num_accepted = [], []
        start = 0
        for draft in drafts:
            k = len(draft)
            accepted = 0
            while accepted < k and draft[accepted] == targets[start + accepted]:
                accepted += 1
            # accepted drafts equal the targets at their rows: emit targets up to the
            # first mismatch (its target is the correction) or the bonus row
            token_ids.append(targets[start:start + accepted + 1])
            num_accepted.append(accepted)
            start += k + 1
        return VerifiedTokens(token_ids, num_accepted)

    @staticmethod
    def _sample_random(probs_in: torch.Tensor, md: SamplingMetadata, layout: _DraftLayout,
                       draft_probs: Sequence[torch.Tensor | None] | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rejection sampling for the random rows: (row tokens, accepted per draft)."""
        probs = compute_probs(probs_in, md)  # [num_rows, vocab]
        device, vocab = probs.device, probs.shape[1]
        q_rows, q, q_at_draft = None, None, torch.ones(len(layout.rows), device=device)
        if draft_probs is not None and any(p is not None for p in draft_probs):
            q_rows, q = _gather_draft_probs(draft_probs, layout, vocab, device)
            draft_first = np.cumsum(layout.num_drafts) - np.asarray(layout.num_drafts)
            idx = [np.arange(draft_first[i], draft_first[i] + n)
                   for i, (n, p) in enumerate(zip(layout.num_drafts, draft_probs, strict=True))
                   if p is not None and n]
            q_idx = torch.from_numpy(np.concatenate(idx)).to(device)
            q_at_draft[q_idx] = q.gather(1, layout.token_ids[q_idx].unsqueeze(1)).squeeze(1)
        weights = rejection.recovery_weights(probs, layout.rows, layout.token_ids, q_rows, q)
        row_tokens = sample_from_probs(weights, md.generators)
        uniform = torch.rand(len(layout.rows), device=device)
        _seeded_uniforms(uniform, md, layout)
        accepted = rejection.accept_probabilistic(probs, layout.rows, layout.token_ids,
                                                  q_at_draft, uniform)
        return row_tokens, accepted

    @staticmethod
    def _logprobs(out_tokens: torch.Tensor, raw_logprobs: torch.Tensor, md: SamplingMetadata,
                  layout: _DraftLayout, num_accepted: list[int]) -> list[list[TokenLogprob]]:
        assert md.logprob_rows is not None
        asking = [n for n in md.num_logprobs if n is not None]
        entries = to_token_logprobs(out_tokens[md.logprob_rows], raw_logprobs, asking)
        per_row: list[TokenLogprob | None] = [None] * md.num_rows
        for row, entry in zip(md.logprob_rows.tolist(), entries, strict=True):
            per_row[row] = entry
        return [[lp for lp in per_row[s:s + n + 1] if lp is not None]
                for s, n in zip(layout.row_starts, num_accepted, strict=True)]


def _gather_draft_probs(draft_probs: Sequence[torch.Tensor | None], layout: _DraftLayout,
                        vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows with draft distributions and those distributions, ``[num_q, vocab]``."""
    rows, blocks = [], []
    for start, n, p in zip(layout.row_starts, layout.num_drafts, draft_probs, strict=True):
        if p is None or n == 0:
            continue
        if p.dim() != 2 or p.shape[0] < n or p.shape[1] > vocab:
            raise ValueError(f"draft_probs of shape {tuple(p.shape)} for {n} drafts: expected "
                             f"[{n}, vocab <= {vocab}] (one distribution per draft)")
        block = p[:n].to(device=device, dtype=torch.float32)
        if block.shape[1] < vocab:  # a draft vocabulary that is a prefix of the target's
            block = torch.nn.functional.pad(block, (0, vocab - block.shape[1]))
        rows.append(torch.arange(start, start + n))
        blocks.append(block)
    return torch.cat(rows).to(device), torch.cat(blocks)


def _seeded_uniforms(uniform: torch.Tensor, md: SamplingMetadata, layout: _DraftLayout) -> None:
    """Redraw the acceptance uniforms of seeded requests from their own generators."""
    if not md.generators:
        return
    first = 0
    for start, n in zip(layout.row_starts, layout.num_drafts, strict=True):
        gen = md.generators.get(start)
        if gen is not None and n:
            uniform[first:first + n] = torch.rand(n, generator=gen, device=gen.device).to(
                uniform.device)
        first += n

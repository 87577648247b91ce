"""One step's sampled drafting for a draft head (:mod:`lmkit.worker.draft_runner`).

When the head :attr:`~lmkit.api.RunnerProposer.samples_drafts` and some drafting request
has ``temperature > 0``, the step's drafts are drawn by
:func:`~lmkit.sample.draft_sampling.sample_draft_tokens` (greedy requests in the same
passes keep the argmax), inside the captured passes or eagerly, all on the device:

* before the passes, the drafting requests' filters go to the device and ``k`` uniforms
  per request are drawn (seeded requests from their own generator);
* each pass (the catch-up pass's last kept rows are draft 1) leaves its rows'
  candidates and their probabilities, kept here on the device;
* after the passes, the sampled requests' distributions are scattered into float32
  ``[num_drafts, vocab]`` blocks over the target vocabulary (0 outside the candidates,
  and outside an EAGLE-3 head's draft vocabulary), kept (:class:`SampledDrafts`) until
  the runner hands them to the verification of those drafts in the next step.

Memory: the candidates are ``[rows, 256]`` per pass; the dense blocks are
``num_sampled * k * vocab * 4`` bytes, e.g. 48 MiB at 32 sampled requests, ``k = 3``
and a 128k vocabulary (greedy requests take none).
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from lmkit.sample.draft_sampling import (
    DraftRowParams,
    candidates_to_dense,
    draw_draft_uniforms,
    sample_draft_tokens,
)

if TYPE_CHECKING:
    from lmkit.api.spec_decode import RunnerProposer
    from lmkit.worker.input_batch import CachedRequestState
    from lmkit.worker.staging import StepStaging


class StepDraftSampler:
    """The sampled drafting of one step, for its ``n`` drafting requests.

    Args:
        proposer: the head (its :meth:`~lmkit.api.RunnerProposer.draft_logits`).
        params: the drafting requests' rows (greedy ones: temperature 0).
        uniforms: float32 ``[n, k]``, column ``j`` for draft ``j``.
        sampled: bool ``[n]``, the requests whose drafts are sampled.
        staging: the step's index uploads; ``vocab_size``: the target's.
    """

    def __init__(self, proposer: RunnerProposer, params: DraftRowParams,
                 uniforms: torch.Tensor, sampled: np.ndarray, staging: StepStaging,
                 vocab_size: int) -> None:
        self.proposer = proposer
        self.params = params
        self.uniforms = uniforms
        self.sampled = sampled
        self.staging = staging
        self.vocab_size = vocab_size
        # per pass: (draft column j, its rows among the drafters, candidates, their q)
        self.passes: list[tuple[int, np.ndarray, torch.Tensor, torch.Tensor]] = []

    @classmethod
    def maybe(cls, proposer: RunnerProposer, states: Sequence[CachedRequestState],
              k: int, staging: StepStaging, vocab_size: int,
              device: torch.device) -> StepDraftSampler | None:
        """The sampler of a step drafting for ``states``; ``None`` when the head does not
        sample drafts or every drafting request is greedy (the argmax path, unchanged)."""
        if not proposer.samples_drafts:
            return None
        params = [s.sampling_params for s in states]
        sampled = np.fromiter((not p.is_greedy for p in params), dtype=bool,
                              count=len(params))
        if not sampled.any():
            return None
        generators: Mapping[int, torch.Generator] = {
            i: s.generator for i, s in enumerate(states)
            if sampled[i] and s.generator is not None}
        return cls(proposer, DraftRowParams.from_params(params, device),
                   draw_draft_uniforms(len(states), k, generators, device), sampled, staging,
                   vocab_size)

    def rows(self, act: np.ndarray, j: int) -> DraftRowParams:
        """The parameters of drafting requests ``act`` for draft ``j`` (its uniforms)."""
        index = self.staging.put(act)
        return self.params.select(index, self.uniforms[:, j].index_select(0, index))

    def catch_up_rows(self, last_rows: np.ndarray, num_rows: int) -> DraftRowParams:
        """A catch-up pass's ``num_rows`` rows: greedy, but each drafting request's last
        kept row (``last_rows``, in drafter order) with its parameters for draft 0."""
        return self.params.scatter(self.staging.put(last_rows), num_rows, self.uniforms[:, 0])

    def sample(self, features: torch.Tensor, act: np.ndarray, j: int) -> torch.Tensor:
        """Eagerly draw draft ``j`` of requests ``act`` from the head's outputs
        ``features`` (``[len(act), hidden]``); returns the ids and records the pass."""
        logits, target_ids = self.proposer.draft_logits(features)
        ids, cand, q = sample_draft_tokens(logits, target_ids, self.rows(act, j))
        self.record(j, act, cand, q)
        return ids

    def record(self, j: int, act: np.ndarray, cand: torch.Tensor, q: torch.Tensor) -> None:
        """Keep a pass's candidates (copies: a graph's buffers are overwritten)."""
        self.passes.append((j, act, cand.clone(), q.clone()))

    def draft_probs(self, num_drafts: np.ndarray) -> dict[int, torch.Tensor]:
        """Drafter index -> float32 ``[num_drafts, vocab]`` draft distributions, for the
        sampled requests with drafts."""
        mine = np.flatnonzero(self.sampled & (num_drafts > 0))
        if not len(mine):
            return {}
        k = int(num_drafts.max())
        dense = torch.zeros(len(mine) * k, self.vocab_size, dtype=torch.float32,
                            device=self.uniforms.device)  # [sampled requests * k, vocab]
        slot = np.full(len(self.sampled), -1, dtype=np.int64)
        slot[mine] = np.arange(len(mine)) * k
        for j, act, cand, q in self.passes:
            take = np.flatnonzero(slot[act] >= 0)
            if not len(take):
                continue
            index = self.staging.put(take)
            rows = candidates_to_dense(cand.index_select(0, index), q.index_select(0, index),
                                       self.vocab_size)
            dense.index_copy_(0, self.staging.put(slot[act[take]] + j), rows)
        blocks = dense.view(len(mine), k, self.vocab_size)
        return {int(d): blocks[i, :int(num_drafts[d])] for i, d in enumerate(mine)}


class SampledDrafts:
    """The sampled drafts' distributions, kept on the device from the step that drew
    them to the step that verifies them: request id -> (its drafts, float32
    ``[num_drafts, vocab]``)."""

    def __init__(self) -> None:
        self.probs: dict[str, tuple[list[int], torch.Tensor]] = {}

    def keep(self, live: Container[str], req_ids: Sequence[str],
             drafts: Sequence[list[int]], probs: Mapping[int, torch.Tensor]) -> None:
        """After a step's drafting: keep ``probs`` (by index into ``req_ids``, the
        drafting requests, whose ``drafts`` they are); forget those of requests drafted
        again without any, and of requests no longer ``live``."""
        self.probs = {r: v for r, v in self.probs.items() if r in live}
        for n, rid in enumerate(req_ids):
            block = probs.get(n)
            if block is None:
                self.probs.pop(rid, None)
            else:
                self.probs[rid] = (drafts[n], block)

    def take(self, req_ids: Sequence[str], drafts: Sequence[Sequence[int]]
             ) -> list[torch.Tensor | None] | None:
        """Per request of a verification step, the distributions its scheduled drafts
        were sampled from (``[len(drafts), vocab]``: the leading rows when the scheduler
        or a grammar cut them), or ``None`` (argmax drafts: one-hot); ``None`` when no
        request has any. Each request's are handed out once."""
        if not self.probs:
            return None
        out: list[torch.Tensor | None] = []
        for rid, scheduled in zip(req_ids, drafts, strict=True):
            kept = self.probs.pop(rid, None) if scheduled else None
            n = len(scheduled)
            if kept is not None and kept[0][:n] == list(scheduled):
                out.append(kept[1][:n])
            else:
                out.append(None)
        return out if any(p is not None for p in out) else None

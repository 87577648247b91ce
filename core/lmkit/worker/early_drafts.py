"""A draft head's drafts after a step (:func:`head_drafts`), and its passes queued
before the step's greedy tokens are read.

After a step without drafts -- a prompt's step above all -- the head catches up on the
step's positions, each paired with the token after it; after a request's last position
that is the token the step just sampled. In the usual order the runner reads those
tokens first, so the GPU idles while the host stages the head's passes (about 0.9 ms
for a prompt on SmolLM2-135M with an EAGLE-3 head on an H200, the target's pass taking
about as long). When every planned request samples greedily and nothing else reads the
tokens first (no grammar, no offload, no pooling), :func:`early_greedy_targets` keeps
them on the device: the catch-up's input ids go up from the host as usual and the
sampled rows are patched on the device (:func:`sampled_patch`), the head's passes queue
behind the target's, and the drafts' read-back also waits for the tokens, which are
then read without waiting. The tokens and the drafts are the same as in the usual
order. Steps that verify drafts are not taken (launched-ahead verifications and device
steps do their own drafting). ``LMKIT_EARLY_DRAFTS=0`` turns it off (read once, when the
head's :class:`~lmkit.worker.draft_runner.DraftRunner` is built: :func:`early_drafts_on`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from lmkit.platform import switched_off
from lmkit.sample.drafts import VerifiedTokens, accept_greedy
from lmkit.worker.step_plan import kept_positions
from lmkit.worker.step_sampling import all_plain_greedy, plan_logits

if TYPE_CHECKING:
    from lmkit.api.scheduler_output import SchedulerOutput
    from lmkit.worker.input_batch import StepInputs
    from lmkit.worker.model_runner import ModelRunner
    from lmkit.worker.staging import StepStaging
    from lmkit.worker.step_plan import SamplingPlan

ENV = "LMKIT_EARLY_DRAFTS"


def early_drafts_on() -> bool:
    """Whether a draft head queues its passes before a step's tokens are read
    (``LMKIT_EARLY_DRAFTS`` not ``0``); read when the head's runner is built."""
    return not switched_off(ENV)


def early_greedy_targets(runner: ModelRunner, hidden: torch.Tensor, order: Sequence[str],
                         plan: SamplingPlan, so: SchedulerOutput) -> torch.Tensor | None:
    """The step's greedy tokens, one per planned request, left on the device (int64,
    plan order) when the head may draft before they are read; ``None``: sample as usual."""
    if (runner.drafter is None or not runner.drafter.early_drafts or runner.pooling
            or runner.offload is not None or not plan or so.grammar_bitmask is not None
            or any(drafts for _, _, drafts in plan) or not all_plain_greedy(runner, order, plan)):
        return None
    return runner.sampler.greedy_ids(plan_logits(runner, hidden, order, plan))


def read_greedy(targets: torch.Tensor) -> VerifiedTokens:
    """The tokens of :func:`early_greedy_targets`, read back: one per request, no drafts."""
    return accept_greedy(targets.tolist(), [()] * len(targets))


def sampled_patch(sampled: tuple[np.ndarray, torch.Tensor] | None, sel: np.ndarray,
                  cu_kept: np.ndarray, staging: StepStaging
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Where a catch-up pass takes the tokens sampled on the device: ``sampled`` is the
    sampling requests' step indices and their tokens; ``sel`` the step indices caught
    up on (ascending) and ``cu_kept`` their rows' running count. Returns the rows (each
    such request's last kept row, whose next token is the sampled one) and the tokens,
    both on the device; ``None``: nothing sampled on the device."""
    if sampled is None:
        return None
    steps, tokens = sampled
    at = np.searchsorted(sel, steps)
    hit = np.flatnonzero(at < len(sel))
    hit = hit[sel[at[hit]] == steps[hit]]
    if not len(hit):
        return None
    return staging.put(cu_kept[at[hit]] - 1), tokens.index_select(0, staging.put(hit))


def head_drafts(runner: ModelRunner, hidden: torch.Tensor, aux: list[torch.Tensor] | None,
                step: StepInputs, order: Sequence[str], plan: SamplingPlan,
                num_accepted: Sequence[int], so: SchedulerOutput,
                sampled: torch.Tensor | None = None) -> dict[int, list[int]]:
    """The runner's draft head caught up on the step and drafting for the requests that
    sampled (:meth:`~lmkit.worker.draft_runner.DraftRunner.propose`), over the target's
    features (``hidden``, or the tapped layers' inputs ``aux``); ``sampled``: the
    step's tokens still on the device (:func:`early_greedy_targets`), not committed."""
    assert runner.drafter is not None
    with torch.inference_mode():
        features = hidden if aux is None else torch.cat(aux, dim=-1)
        kept, drafting = kept_positions(order, step, plan, num_accepted, runner.requests,
                                        runner.config.speculative.disable_by_batch_size,
                                        so.spec_drafting, pending=sampled is not None)
        on_device = None if sampled is None else (
            np.fromiter((i for i, _, _ in plan), dtype=np.int64, count=len(plan)), sampled)
        return runner.drafter.propose(features, step, kept, drafting, sampled=on_device)

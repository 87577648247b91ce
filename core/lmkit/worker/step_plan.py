"""Which requests of a step sample, and what the step's sampled tokens do to the runner's
copies of them: the bookkeeping around :meth:`lmkit.worker.model_runner.ModelRunner.
execute_model`'s sampling, and which positions a draft head catches up on (pure host
work, no device calls)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from lmkit.api.outputs import TokenLogprob
from lmkit.api.runner_output import ModelRunnerOutput
from lmkit.sample.sampler import VerifiedTokens
from lmkit.worker.input_batch import CachedRequestState, InputBatch, StepInputs

#: per sampling request: (step index, first hidden row, its drafts)
SamplingPlan = list[tuple[int, int, list[int]]]


def sampling_plan(order: list[str], step: StepInputs, spec: Mapping[str, list[int]],
                  requests: Mapping[str, CachedRequestState]) -> SamplingPlan:
    """Which requests sample this step: ``(step index, first hidden row, drafts)``.

    A request samples when its chunk reaches the end of its known tokens; with
    draft tokens it gets logits at the last known token and at every draft
    (``len(drafts) + 1`` rows), which speculative verification consumes.
    """
    plan = []
    ends = step.num_computed + step.num_scheduled
    for i, rid in enumerate(order):
        drafts = spec.get(rid) or []
        if ends[i] - len(drafts) >= requests[rid].num_tokens:
            plan.append((i, int(step.cu_num_tokens[i]) - 1 - len(drafts), drafts))
    return plan


def commit_tokens(order: list[str], plan: SamplingPlan, verified: VerifiedTokens,
                  prompt_logprobs: dict[str, list[TokenLogprob | None]],
                  requests: Mapping[str, CachedRequestState], input_batch: InputBatch
                  ) -> ModelRunnerOutput:
    """Append the accepted tokens to the runner's copies (request states and the batch's
    token rows) and build the step's output."""
    out = ModelRunnerOutput(req_ids=order, sampled_token_ids=[[] for _ in order],
                            prompt_logprobs=prompt_logprobs)
    if verified.logprobs is not None:
        out.logprobs = [[] for _ in order]
    for n, (i, _, drafts) in enumerate(plan):
        rid = order[i]
        tokens = verified.token_ids[n]  # accepted drafts + 1
        if drafts:
            out.num_draft_tokens[rid] = len(drafts)
            out.num_accepted_tokens[rid] = verified.num_accepted[n]
        if out.logprobs is not None and verified.logprobs is not None:
            out.logprobs[i] = verified.logprobs[n]
        out.sampled_token_ids[i] = tokens
        requests[rid].output_token_ids.extend(tokens)
        input_batch.append_tokens(input_batch.row_of[rid], tokens)
    return out


def kept_positions(order: Sequence[str], step: StepInputs,
                   plan: Sequence[tuple[int, int, Sequence[int]]], num_accepted: Sequence[int],
                   requests: Mapping[str, CachedRequestState],
                   disable_by_batch_size: int | None = None,
                   drafting_on: bool = True, pending: bool = False
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Per step request (after the step's tokens are committed, or with ``pending``
    before: each planned request then holds one token fewer than it will): how many of
    its scheduled positions the head catches up on, and whether it drafts.

    Kept: the scheduled positions minus the rejected drafts, and only those whose next
    token is known (a pooling request's last prompt position has none). Drafting: the
    request sampled this step and does not opt out of speculation, and the step ran at
    most ``disable_by_batch_size`` requests (the engine proposes nothing after larger
    steps, so the draft passes are skipped; the head still catches up), and the step's
    plan did not turn drafting off (``drafting_on``: adaptive speculation).

    Args:
        plan: the runner's sampling plan, ``(step index, first hidden row, drafts)``.
        num_accepted: per plan entry, drafts accepted.
    """
    kept = step.num_scheduled.copy()
    drafting = np.zeros(len(order), dtype=bool)
    draft = step_drafts(len(order), disable_by_batch_size, drafting_on)
    for (i, _, drafts), accepted in zip(plan, num_accepted, strict=True):
        kept[i] -= len(drafts) - accepted
        drafting[i] = draft and requests[order[i]].sampling_params.use_spec_decode
    num_tokens = np.fromiter((requests[r].num_tokens for r in order), dtype=np.int64,
                             count=len(order))
    if pending:  # the tokens this step samples, not committed yet
        num_tokens[[i for i, _, _ in plan]] += 1
    return np.minimum(kept, num_tokens - 1 - step.num_computed), drafting


def step_drafts(num_reqs: int, disable_by_batch_size: int | None, drafting_on: bool) -> bool:
    """Whether the head drafts after a step of ``num_reqs`` requests: the step's plan
    lets it (``drafting_on``: adaptive speculation) and the step ran at most
    ``disable_by_batch_size`` requests (each request may still opt out)."""
    return drafting_on and (disable_by_batch_size is None
                            or num_reqs <= disable_by_batch_size)

"""Sampling one step: the model runner's logits, grammar masks, sampler and draft
verification for every request the step samples (:func:`sample_step`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lmkit.sample.bitmask import apply_grammar_bitmask
from lmkit.sample.metadata import SamplingMetadata
from lmkit.sample.sampler import VerifiedTokens
from lmkit.spec_decode.rows import hidden_rows, is_plain_greedy, sampling_rows

if TYPE_CHECKING:
    from lmkit.api.scheduler_output import SchedulerOutput
    from lmkit.worker.model_runner import ModelRunner
    from lmkit.worker.step_plan import SamplingPlan


def sample_step(runner: ModelRunner, hidden: torch.Tensor, order: list[str],
                plan: SamplingPlan, so: SchedulerOutput | None = None) -> VerifiedTokens:
    """Sample (and verify drafts) for every planned request of ``runner``'s step in one
    call: logits only at the planned rows of ``hidden``, the grammar bitmask, then one
    greedy argmax when every row may take it, else the full sampler."""
    if not plan:
        return VerifiedTokens([], [])
    by_state = [(runner.requests[order[i]], first_row, drafts)
                for i, first_row, drafts in plan]
    drafts = [d for _, _, d in plan]
    rows = hidden_rows(by_state)  # a slice when contiguous: no gather
    if isinstance(rows, slice):
        selected = hidden[rows]
    else:
        index = torch.tensor(rows, dtype=torch.int64).to(hidden.device, non_blocking=True)
        selected = hidden.index_select(0, index)
    logits = runner.model.compute_logits(selected)
    if so is not None and so.grammar_bitmask is not None:  # structured output
        apply_grammar_bitmask(logits, so.grammar_bitmask, so.structured_output_request_ids,
                              [order[i] for i, _, _ in plan],
                              [len(d) + 1 for d in drafts], runner.apply_token_bitmask)
    if not runner.logits_processors.affects_greedy and all(
            is_plain_greedy(s.sampling_params, len(s.output_token_ids))
            for s, _, _ in by_state):  # one argmax, one read: no sampling metadata
        return runner.sampler.verify_greedy(logits, drafts)
    # one row per sampled position; outputs extended by drafts are views, not copies
    r = sampling_rows(by_state)
    md = SamplingMetadata.build(r.params, r.prompts, r.outputs, r.generators,
                                r.eos_token_ids, runner.vocab_size, hidden.device,
                                runner.sampler.request_cache(runner.vocab_size, hidden.device),
                                [order[i] for i, _, d in plan for _ in range(len(d) + 1)])
    if runner.logits_processors.in_use:  # plugin processors: the slot of every row
        md.logits_processors, md.processor_slots = runner.logits_processors.for_step(
            [order[i] for i, _, d in plan for _ in range(len(d) + 1)], hidden.device)
    draft_probs = so.spec_draft_probs if so is not None else None
    probs = [draft_probs.get(order[i]) for i, _, _ in plan] if draft_probs else None
    if runner.drafter is not None:  # the head's sampled drafts' distributions
        probs = runner.drafter.take_probs([order[i] for i, _, _ in plan], drafts)
    return runner.sampler.sample_requests(logits, md, drafts, probs)

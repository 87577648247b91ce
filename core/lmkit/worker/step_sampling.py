"""Sampling one step: the model runner's logits, grammar masks, sampler and draft
verification for every request the step samples (:func:`sample_step`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from lmkit.sample.bitmask import apply_grammar_bitmask
from lmkit.sample.metadata import SamplingMetadata
from lmkit.sample.sampler import VerifiedTokens
from lmkit.sample.tree_verify import TreeVerified, verify_tree, verify_tree_greedy
from lmkit.spec_decode.rows import hidden_rows, is_plain_greedy, sampling_rows
from lmkit.worker.tree_step import compact_accepted

if TYPE_CHECKING:
    from lmkit.api.scheduler_output import SchedulerOutput
    from lmkit.spec_decode.tree import DraftTree
    from lmkit.worker.input_batch import StepInputs
    from lmkit.worker.model_runner import ModelRunner
    from lmkit.worker.step_plan import SamplingPlan


def sample_step(runner: ModelRunner, hidden: torch.Tensor, order: list[str],
                plan: SamplingPlan, so: SchedulerOutput | None = None,
                step: StepInputs | None = None, aux: list[torch.Tensor] | None = None
                ) -> VerifiedTokens:
    """Sample (and verify drafts) for every planned request of ``runner``'s step in one
    call: logits only at the planned rows of ``hidden``, the grammar bitmask, then one
    greedy argmax when every row may take it, else the full sampler. Draft trees
    (``runner.tree``) are walked instead, and the accepted nodes moved to a chain's rows
    and slots (in the KV caches, ``hidden`` and the head's features ``aux``; needs the
    ``step``)."""
    if not plan:
        return VerifiedTokens([], [])
    drafts = [d for _, _, d in plan]
    logits = plan_logits(runner, hidden, order, plan)
    if so is not None and so.grammar_bitmask is not None:  # structured output
        apply_grammar_bitmask(logits, so.grammar_bitmask, so.structured_output_request_ids,
                              [order[i] for i, _, _ in plan],
                              [len(d) + 1 for d in drafts], runner.apply_token_bitmask)
    if runner.tree is not None and any(drafts):  # draft trees: walk each request's
        assert step is not None
        verified = sample_tree_step(runner, logits, order, plan, runner.tree)
        compact_accepted(runner.kv_groups, runner.kv_caches, step, plan, verified.paths or [],
                         [hidden, *(aux or [])])
        return verified
    if all_plain_greedy(runner, order, plan):  # one argmax, one read: no sampling metadata
        return runner.sampler.verify_greedy(logits, drafts)
    md = step_metadata(runner, order, plan, hidden.device)
    draft_probs = so.spec_draft_probs if so is not None else None
    probs = [draft_probs.get(order[i]) for i, _, _ in plan] if draft_probs else None
    if runner.drafter is not None:  # the head's sampled drafts' distributions
        probs = runner.drafter.take_probs([order[i] for i, _, _ in plan], drafts)
    return runner.sampler.sample_requests(logits, md, drafts, probs)


def plan_logits(runner: ModelRunner, hidden: torch.Tensor, order: Sequence[str],
                plan: SamplingPlan) -> torch.Tensor:
    """The logits at the rows of ``hidden`` the step samples or verifies at, in plan
    order (each request's draft rows then its last one)."""
    by_state = [(runner.requests[order[i]], first_row, drafts)
                for i, first_row, drafts in plan]
    rows = hidden_rows(by_state)  # a slice when contiguous: no gather
    if isinstance(rows, slice):
        selected = hidden[rows]
    else:
        index = torch.tensor(rows, dtype=torch.int64).to(hidden.device, non_blocking=True)
        selected = hidden.index_select(0, index)
    return runner.model.compute_logits(selected)


def all_plain_greedy(runner: ModelRunner, order: Sequence[str], plan: SamplingPlan) -> bool:
    """Whether every planned row takes the argmax of its logits as they are (no plugin
    processor that may change it, every request :func:`is_plain_greedy`)."""
    return not runner.logits_processors.affects_greedy and all(
        is_plain_greedy((s := runner.requests[order[i]]).sampling_params,
                        len(s.output_token_ids)) for i, _, _ in plan)


def sample_tree_step(runner: ModelRunner, logits: torch.Tensor, order: Sequence[str],
                     plan: SamplingPlan, tree: DraftTree) -> TreeVerified:
    """Verify a step's draft trees: the requests with drafts through
    :func:`~lmkit.sample.tree_verify.verify_tree`, the others (no drafts: prefill ends,
    requests that opted out) through the sampler as usual;
    ``logits`` has ``len(drafts) + 1`` rows per plan entry. Returns the results in
    plan order, with the accepted nodes (:class:`~lmkit.sample.tree_verify.TreeVerified`)."""
    sizes = np.fromiter((len(d) + 1 for _, _, d in plan), dtype=np.int64, count=len(plan))
    starts = np.cumsum(sizes) - sizes
    treed = [n for n, (_, _, d) in enumerate(plan) if d]
    plain = [n for n, (_, _, d) in enumerate(plan) if not d]
    out = TreeVerified([[] for _ in plan], [0] * len(plan), paths=[[] for _ in plan])
    assert out.paths is not None
    for entries, with_tree in ((treed, True), (plain, False)):
        if not entries:
            continue
        part = [plan[n] for n in entries]
        sub = logits  # (all the step's rows: every request drafted, the usual case)
        if len(entries) < len(plan):
            rows = np.concatenate([np.arange(starts[n], starts[n] + sizes[n]) for n in entries])
            sub = logits.index_select(0, torch.from_numpy(rows).to(logits.device))
        if with_tree and all_plain_greedy(runner, order, part):  # one argmax: no metadata
            got: VerifiedTokens = verify_tree_greedy(sub, tree, [d for _, _, d in part],
                                                     runner.sampler.kernels)
        elif with_tree:
            got = verify_tree(sub, step_metadata(runner, order, part, logits.device, tree),
                              tree, [d for _, _, d in part], runner.sampler.kernels)
        else:
            got = runner.sampler.sample_requests(
                sub, step_metadata(runner, order, part, logits.device), [[] for _ in part])
        if got.logprobs is not None:
            out.logprobs = out.logprobs or [[] for _ in plan]
        for j, n in enumerate(entries):
            out.token_ids[n], out.num_accepted[n] = got.token_ids[j], got.num_accepted[j]
            if isinstance(got, TreeVerified) and got.paths is not None:
                out.paths[n] = got.paths[j]
            if got.logprobs is not None and out.logprobs is not None:
                out.logprobs[n] = got.logprobs[j]
            if j in got.no_allowed_token:
                out.no_allowed_token[n] = got.no_allowed_token[j]
    return out


def step_metadata(runner: ModelRunner, order: Sequence[str], plan: SamplingPlan,
                  device: torch.device, tree: DraftTree | None = None) -> SamplingMetadata:
    """The sampling metadata of the plan's rows: one row per sampled position, outputs
    extended by the drafts before it (views, not copies; with ``tree``, by the drafts on
    the path to the node), plugin processors' slots when any is in use."""
    r = sampling_rows([(runner.requests[order[i]], row, d) for i, row, d in plan], tree)
    keys = [order[i] for i, _, d in plan for _ in range(len(d) + 1)]
    md = SamplingMetadata.build(r.params, r.prompts, r.outputs, r.generators,
                                r.eos_token_ids, runner.vocab_size, device,
                                runner.sampler.request_cache(runner.vocab_size, device), keys)
    if runner.logits_processors.in_use:  # plugin processors: the slot of every row
        md.logits_processors, md.processor_slots = runner.logits_processors.for_step(
            keys, device)
    return md

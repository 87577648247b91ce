"""Checking a scheduler plugin's plan before the model runner acts on it.

The model runner trusts :class:`~lmkit.api.SchedulerOutput`: a request it holds no state
for, a token count past the step's buffers or a token count that disagrees with the
total would fail deep inside it (an ``IndexError`` in the input batch, a ``KeyError`` in
its request table) or, worse, run. :class:`PlanCheck` checks the plan's bookkeeping in
O(scheduled requests), mostly C-level set and sum operations, and names the scheduler
and the rule it broke. A scheduler that breaks one has state the engine cannot trust:
the engine core then stops (see :meth:`EngineCore.step <lmkit.engine.core.EngineCore.
step>`).
"""

from __future__ import annotations

import operator
from typing import Any

from lmkit.api.scheduler_output import SchedulerOutput


class PlanCheck:
    """The rules every step's plan must keep, and the runner's view of which requests
    it holds (new ones join; finished and preempted ones leave).

    Args:
        label: the scheduler plugin, as messages name it.
        max_num_batched_tokens: the step's token budget.
        max_num_seqs: the most requests a step may run.
        max_model_len: no request has a position past this.
    """

    def __init__(self, label: str, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int) -> None:
        self.label = label
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.held: set[str] = set()  # requests the model runner holds state for

    def check(self, so: Any) -> str | None:
        """What is wrong with the plan ``so`` (then the engine must stop), or ``None``;
        a sound plan updates :attr:`held`."""
        if not isinstance(so, SchedulerOutput):
            return f"schedule() returned {type(so).__name__}, not lmkit.api.SchedulerOutput"
        problem = self._counts(so) or self._requests(so)
        if problem is None:
            self.held.difference_update(so.finished_req_ids, so.preempted_req_ids)
            self.held.update(new.req_id for new in so.scheduled_new_reqs)
        return problem

    def _counts(self, so: SchedulerOutput) -> str | None:
        counts = so.num_scheduled_tokens
        if not counts:
            return (None if so.total_num_scheduled_tokens == 0 else
                    f"planned total_num_scheduled_tokens = {so.total_num_scheduled_tokens} "
                    "with no request in num_scheduled_tokens")
        values = list(counts.values())
        if set(map(type, values)) != {int} or min(values) < 1:
            bad = next(v for v in values if type(v) is not int or v < 1)
            rid = next(r for r, v in counts.items() if v is bad)
            return (f"scheduled {bad!r} tokens for request {rid!r}; each count in "
                    "num_scheduled_tokens must be an int >= 1")
        total = sum(values)
        if total != so.total_num_scheduled_tokens:
            return (f"planned total_num_scheduled_tokens = {so.total_num_scheduled_tokens}, "
                    f"but num_scheduled_tokens adds up to {total}")
        if total > self.max_num_batched_tokens:
            return (f"scheduled {total} tokens in one step, more than "
                    f"scheduler.max_num_batched_tokens = {self.max_num_batched_tokens}")
        if len(counts) > self.max_num_seqs:
            return (f"scheduled {len(counts)} requests in one step, more than "
                    f"scheduler.max_num_seqs = {self.max_num_seqs}")
        return None

    def _requests(self, so: SchedulerOutput) -> str | None:
        counts = so.num_scheduled_tokens
        new_ids = [new.req_id for new in so.scheduled_new_reqs]
        cached = so.scheduled_cached_reqs
        listed = {*new_ids, *cached.req_ids}
        if len(listed) != len(new_ids) + len(cached.req_ids) or listed != counts.keys():
            return _listing_problem(new_ids, cached.req_ids, counts)
        if not len(cached.req_ids) == len(cached.new_block_ids) == len(
                cached.num_computed_tokens):
            return (f"planned scheduled_cached_reqs with {len(cached.req_ids)} req_ids, "
                    f"{len(cached.new_block_ids)} new_block_ids and "
                    f"{len(cached.num_computed_tokens)} num_computed_tokens; one each per "
                    "request")
        gone = so.finished_req_ids | so.preempted_req_ids  # the runner drops these first
        if not (self.held.issuperset(cached.req_ids) and gone.isdisjoint(cached.req_ids)):
            rid = next(r for r in cached.req_ids if r not in self.held or r in gone)
            return (f"scheduled request {rid!r} in scheduled_cached_reqs, but the model "
                    "runner holds no state for it (never scheduled, finished or preempted): "
                    "a request first scheduled, or resumed after a preemption, goes in "
                    "scheduled_new_reqs with all its tokens")
        ends = _ends(so)
        if ends and max(ends) > self.max_model_len:
            i = next(i for i, end in enumerate(ends) if end > self.max_model_len)
            return (f"scheduled request {(*new_ids, *cached.req_ids)[i]!r} up to position "
                    f"{ends[i]}, past model.max_model_len = {self.max_model_len} "
                    "(num_computed_tokens + its scheduled tokens)")
        spec = so.scheduled_spec_decode_tokens
        if spec and (not spec.keys() <= counts.keys() or any(map(
                operator.le, map(counts.__getitem__, spec), map(len, spec.values())))):
            rid = next(r for r, d in spec.items() if r not in counts or counts[r] <= len(d))
            return (f"scheduled {len(spec[rid])} draft tokens for request {rid!r} with "
                    f"{counts.get(rid, 0)} scheduled tokens; a request's drafts come with "
                    "its last token, so it needs 1 + its drafts scheduled tokens")
        return None


def _ends(so: SchedulerOutput) -> list[int]:
    """Per scheduled request (new ones first, as listed), where its scheduled tokens
    end: ``num_computed_tokens + num_scheduled_tokens``."""
    counts = so.num_scheduled_tokens
    cached = so.scheduled_cached_reqs
    return [*(new.num_computed_tokens + counts[new.req_id] for new in so.scheduled_new_reqs),
            *map(operator.add, cached.num_computed_tokens,
                 map(counts.__getitem__, cached.req_ids))]


def _listing_problem(new_ids: list[str], cached_ids: list[str],
                     counts: dict[str, int]) -> str:
    """The first disagreement between the scheduled request lists and the counts."""
    seen: set[str] = set()
    for rid in (*new_ids, *cached_ids):
        if rid in seen:
            return (f"listed request {rid!r} twice in scheduled_new_reqs / "
                    "scheduled_cached_reqs; each scheduled request is listed once")
        seen.add(rid)
    missing = next((r for r in counts if r not in seen), None)
    if missing is not None:
        return (f"scheduled {counts[missing]} tokens for request {missing!r} but listed it "
                "in neither scheduled_new_reqs nor scheduled_cached_reqs")
    extra = next(r for r in seen if r not in counts)
    return (f"listed request {extra!r} in scheduled_new_reqs / scheduled_cached_reqs "
            "without a count in num_scheduled_tokens")

"""The plan of one scheduling step while it is being built, and its conversion to the
:class:`SchedulerOutput` the model runner receives."""

from __future__ import annotations

from dataclasses import dataclass, field

from lmkit.api.request import Request
from lmkit.api.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput


@dataclass
class StepPlan:
    """Requests chosen so far this step, reversible until :meth:`to_output`.

    ``num_computed_tokens`` of the chosen requests is only advanced in
    :meth:`to_output`, so a request preempted later in the same step (a victim chosen
    after it was scheduled) is simply taken back out with :meth:`unschedule`.
    """

    token_budget: int
    # request id -> (request, tokens this step); dicts keep insertion order
    scheduled: dict[str, tuple[Request, int]] = field(default_factory=dict)
    # ids first sent to the runner this step (new or resumed) -> their block ids later
    new_req_ids: set[str] = field(default_factory=set)
    # running request id -> ids of blocks allocated this step
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    preempted: dict[str, Request] = field(default_factory=dict)

    def schedule(self, request: Request, num_tokens: int, new_block_ids: list[int] | None,
                 spec_tokens: list[int] | None = None) -> None:
        """Run ``num_tokens`` of ``request`` this step. ``new_block_ids`` is None for a
        request the runner does not hold yet (it gets its whole block table)."""
        rid = request.request_id
        self.scheduled[rid] = (request, num_tokens)
        self.token_budget -= num_tokens
        if new_block_ids is None:
            self.new_req_ids.add(rid)
        else:
            self.new_block_ids[rid] = new_block_ids
        if spec_tokens:
            self.spec_tokens[rid] = spec_tokens

    def unschedule(self, request: Request) -> None:
        """Take ``request`` back out of this step (it was preempted after all)."""
        rid = request.request_id
        entry = self.scheduled.pop(rid, None)
        if entry is None:
            return
        self.token_budget += entry[1]
        self.new_req_ids.discard(rid)
        self.new_block_ids.pop(rid, None)
        self.spec_tokens.pop(rid, None)

    def to_output(self, block_ids_of, finished_req_ids: set[str]) -> SchedulerOutput:
        """Build the runner's view and advance ``num_computed_tokens`` of every request
        in the step. ``block_ids_of(request)`` gives a request's whole block table.
        Draft tokens scheduled this step are consumed from ``request.spec_token_ids``."""
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        num_scheduled_tokens: dict[str, int] = {}
        total = 0
        for rid, (request, num_tokens) in self.scheduled.items():
            if rid in self.new_req_ids:
                new_reqs.append(NewRequestData(
                    req_id=rid,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=block_ids_of(request),
                    num_computed_tokens=request.num_computed_tokens,
                    eos_token_id=request.eos_token_id,
                    pooling_params=request.pooling_params,
                ))
            else:
                cached.req_ids.append(rid)
                cached.new_block_ids.append(self.new_block_ids[rid])
                cached.num_computed_tokens.append(request.num_computed_tokens)
            num_scheduled_tokens[rid] = num_tokens
            total += num_tokens
            request.num_computed_tokens += num_tokens
            if rid in self.spec_tokens:
                request.spec_token_ids = []
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total,
            scheduled_spec_decode_tokens=self.spec_tokens,
            finished_req_ids=finished_req_ids,
            preempted_req_ids=set(self.preempted),
        )

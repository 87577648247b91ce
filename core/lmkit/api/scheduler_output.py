"""What the scheduler hands the executor each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmkit.api.pooling import PoolingParams
from lmkit.api.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the model runner has no state for: first scheduled, or resumed after a
    preemption (then ``output_token_ids`` holds what it had generated)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None = None  # banned by the sampler while below min_tokens
    pooling_params: PoolingParams | None = None  # a pooling request: pool, never sample


@dataclass(slots=True)
class CachedRequestData:
    """Requests the runner already holds; per request, the blocks appended this step and
    the number of tokens computed before this step."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan.

    ``num_scheduled_tokens[req_id]`` tokens of each request run this step, starting at
    its ``num_computed_tokens``; for decodes that is 1 (+ its draft tokens in
    ``scheduled_spec_decode_tokens``). ``finished_req_ids`` and ``preempted_req_ids``
    tell the runner which request states to drop.
    """

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # draft distributions of proposers that give them: request id -> [num_drafts, vocab]
    spec_draft_probs: dict[str, Any] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # structured output: request id -> row of ``grammar_bitmask`` ([rows, vocab/32] int32)
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: Any = None
    # blocks to load from / store to an offload tier before / after the forward
    kv_transfers: Any = None
    # false: the runner's draft head drafts nothing after this step (adaptive speculation)
    spec_drafting: bool = True

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

"""The request state machine."""

from __future__ import annotations

import enum
import time
from typing import Any

from lmkit.api.pooling import PoolingParams
from lmkit.api.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """waiting -> running <-> preempted -> finished_*; any state -> finished_aborted.

    A constrained request starts in ``WAITING_FOR_GRAMMAR``: it is queued in the scheduler
    but skipped until its grammar is compiled (then ``WAITING``), as vLLM v1's
    ``WAITING_FOR_FSM``.
    """

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6
    WAITING_FOR_GRAMMAR = 7

    @property
    def is_finished(self) -> bool:
        return RequestStatus.FINISHED_STOPPED <= self <= RequestStatus.FINISHED_ERROR

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence being generated, as the engine core tracks it.

    A pooling request (``pooling_params`` set) runs its prompt only and returns a
    pooled vector instead of tokens (:mod:`lmkit.api.pooling`).

    ``num_computed_tokens`` counts tokens whose KV is in the cache (prefix-cache hits
    included). ``all_token_ids`` is prompt + output, kept as one list so that the
    scheduler and the prefix cache never concatenate per step.
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "eos_token_id", "arrival_time",
        "priority", "cache_salt", "status", "output_token_ids", "all_token_ids",
        "num_computed_tokens", "num_cached_tokens", "num_preemptions", "stop_reason",
        "spec_token_ids", "block_hashes", "max_tokens", "structured_output", "extra",
        "pooling_params",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        max_tokens: int | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority  # lower value = more important (as in vLLM)
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 = not yet
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.spec_token_ids: list[int] = []
        self.block_hashes: list[Any] = []
        # the effective output limit (max_tokens, or what fits in the context)
        self.max_tokens = max_tokens if max_tokens is not None else sampling_params.max_tokens
        self.structured_output: Any = None  # grammar state, owned by the structured-output manager
        self.extra: dict[str, Any] = {}
        # set for a pooling request: prefill only, finished when its prompt is done
        self.pooling_params = pooling_params

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens})")

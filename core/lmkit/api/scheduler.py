"""The Scheduler contract."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmkit.api.outputs import EngineCoreOutput
    from lmkit.api.request import Request, RequestStatus
    from lmkit.api.runner_output import ModelRunnerOutput
    from lmkit.api.scheduler_output import SchedulerOutput


class Scheduler(ABC):
    """Decides, each step, which requests run and how many tokens each.

    Constructor (the one signature the engine uses)::

        cls(config, *, num_blocks, options)

    ``config`` is the engine's runtime :class:`~lmkit.api.LMKitConfig`
    (``model.max_model_len`` filled in), ``num_blocks`` the size of the KV pool,
    ``options`` the validated instance of the spec's options model. The engine calls
    :meth:`schedule`, runs the model on the result, then :meth:`update_from_output`.
    Most implementations subclass :class:`lmkit.api.PagedScheduler`, which implements
    the mechanism (token budget, chunked prefill, paged KV with prefix caching,
    preemption) and leaves the policy (queue order, preemption victim) to override.
    """

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a new request (status WAITING)."""

    @abstractmethod
    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside the step loop (abort, stop string found by the
        frontend): free their blocks and tell the runner in the next step. Unknown or
        already finished ids are ignored."""

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Plan one step within ``max_num_batched_tokens`` and ``max_num_seqs``."""

    @abstractmethod
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop checks (EOS, stop token ids, max_tokens),
        free finished requests' blocks; return one output per request that advanced or
        finished."""

    @abstractmethod
    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting, running or preempted."""

    def get_stats(self) -> dict[str, Any]:
        """Counters for metrics: running, waiting, KV usage, prefix hits, preemptions."""
        return {}

"""The Scheduler contract."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from lmkit.api.outputs import EngineCoreOutput
    from lmkit.api.request import Request, RequestStatus
    from lmkit.api.runner_output import ModelRunnerOutput
    from lmkit.api.scheduler_output import SchedulerOutput


class PrefixTier(ABC):
    """A source of cached prefix blocks beyond the device prefix cache (the KV offload
    tier, as the engine core sees it), addressed by the chained block hashes of
    :mod:`lmkit.kv_cache.hashing`. A scheduler that declares
    :attr:`Scheduler.supports_prefix_tier` consults it when it admits a request.
    """

    #: also store each full block right after the step that computes it
    #: (``offload.store_policy: write_through``); False stores on eviction only
    write_through: bool = False

    @abstractmethod
    def lookup(self, block_hashes: Sequence[bytes]) -> tuple[int, int]:
        """``(held, resident)``: how many leading blocks of ``block_hashes`` the tier
        holds, and how many of those it can load in the very step that reads them."""

    def stats(self) -> dict[str, int]:
        """The tier's own counters (bytes moved, usage), added to the engine's stats."""
        return {}


@dataclass(frozen=True)
class SchedulerContext:
    """What the engine core hands a scheduler beside its configuration.

    Attributes:
        num_lookahead_slots: KV slots per running request to reserve past its scheduled
            tokens, because the runner launches decode steps ahead of scheduling
            (:attr:`lmkit.api.ModelInfo.num_lookahead_slots`; 0 when it does not).
        prefix_tier: the KV offload tier to consult at admission, or None (offload off).
        kv_window: when every attention layer reads only this many of the latest keys
            (:attr:`lmkit.api.ModelInfo.kv_window`), blocks wholly behind it may be
            released while a request runs; None: keep them.
    """

    num_lookahead_slots: int = 0
    prefix_tier: PrefixTier | None = None
    kv_window: int | None = None


class Scheduler(ABC):
    """Decides, each step, which requests run and how many tokens each.

    Constructor (the one signature the engine uses)::

        cls(config, *, num_blocks, options, context)


    * ``config``: the engine's runtime :class:`~lmkit.config.LMKitConfig`
      (``model.max_model_len`` filled in);
    * ``num_blocks``: the KV pool size in blocks, including the null block 0;
    * ``options``: the validated options of the scheduler plugin (or None);
    * ``context``: a :class:`SchedulerContext` (lookahead slots, the prefix tier);
      None means ``SchedulerContext()``.

    The engine calls :meth:`schedule`, runs the model on the result, then
    :meth:`update_from_output`. Most implementations subclass
    :class:`lmkit.api.PagedScheduler`, which implements the mechanism (token budget,
    chunked prefill, paged KV with prefix caching, preemption, the prefix tier) and
    leaves the policy (queue order, preemption victim) to override.

    A request in status ``WAITING_FOR_GRAMMAR`` is queued but must not be admitted
    until the engine sets it ``WAITING`` (its grammar is compiled).
    """

    #: whether the scheduler consults ``context.prefix_tier`` (KV offload); the engine
    #: refuses an offload tier with a scheduler that does not
    supports_prefix_tier: ClassVar[bool] = False

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a new request (status WAITING; the engine may set it
        ``WAITING_FOR_GRAMMAR`` right after)."""

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

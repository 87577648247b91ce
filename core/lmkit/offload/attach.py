"""Wiring KV offload into an engine: the tier in the workers, reached through the
executor's typed offload methods, handed to the scheduler as its prefix tier."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lmkit.api.scheduler import PrefixTier
from lmkit.engine.phases import StepPhase
from lmkit.errors import ConfigError

if TYPE_CHECKING:
    from lmkit.api.executor import Executor
    from lmkit.api.scheduler import Scheduler
    from lmkit.plugin_host.resolve import ResolvedStack

logger = logging.getLogger(__name__)


class ExecutorPrefixTier(PrefixTier):
    """The offload tier of a running engine, as its scheduler consults it:
    :meth:`lookup` and :meth:`stats` go to the workers through the executor's
    :meth:`~lmkit.api.Executor.offload_lookup` and :meth:`~lmkit.api.Executor.offload_stats`.

    Args:
        executor: the engine's executor (its workers hold the tier).
        write_through: ``offload.store_policy`` is ``write_through``.
    """

    def __init__(self, executor: Executor, write_through: bool = True) -> None:
        self.executor = executor
        self.write_through = write_through

    def lookup(self, block_hashes: Sequence[bytes]) -> tuple[int, int]:
        """``(held, resident)`` leading blocks of ``block_hashes`` in the tier."""
        return self.executor.offload_lookup(block_hashes)

    def stats(self) -> dict[str, int]:
        """The workers' tier counters (bytes moved, usage, tier evictions)."""
        return self.executor.offload_stats()


class OffloadPhase(StepPhase):
    """KV offload's part in the engine's life outside the scheduler and the runner
    (which run its per-step work): closing the tier when the engine shuts down."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor

    def shutdown(self) -> None:
        """Close the tier on every worker (pending disk writes are finished). Logs
        instead of raising, so that engine shutdown always goes on."""
        try:
            self.executor.close_offload()
        except Exception:
            logger.exception("closing the KV offload tier failed")


def prefix_tier(stack: ResolvedStack, scheduler_cls: type[Scheduler], executor: Executor,
                write_through: bool = True) -> ExecutorPrefixTier | None:
    """The offload tier to hand the scheduler; None when offload is off.
    ``write_through``: ``offload.store_policy`` is ``write_through``.

    Raises:
        ConfigError: the scheduler does not declare ``supports_prefix_tier`` (e.g. a
            third-party scheduler not built on :class:`~lmkit.api.PagedScheduler`).
    """
    reg = stack.get("offload")
    if reg is None:
        return None
    if not scheduler_cls.supports_prefix_tier:
        raise ConfigError(
            f"offload tier {reg.name!r} needs a scheduler that consults a prefix tier "
            f"(supports_prefix_tier, e.g. one built on lmkit's PagedScheduler), but "
            f"{scheduler_cls.__name__} does not; choose another scheduler or set "
            "offload.backend: none")
    return ExecutorPrefixTier(executor, write_through)

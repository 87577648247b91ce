"""Wiring KV offload into an engine: the coordinator on the scheduler's KV-cache manager,
talking to the tier in the runner through the executor."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from lmkit.errors import ConfigError
from lmkit.offload.coordinator import OffloadCoordinator

if TYPE_CHECKING:
    from lmkit.api.executor import Executor
    from lmkit.plugin_host.resolve import ResolvedStack

logger = logging.getLogger(__name__)


class EngineOffload(OffloadCoordinator):
    """The coordinator of a running engine: the tier is reached through ``executor``
    (``executor.call("offload_call", ...)`` on every worker; a lookup takes the smallest
    answers, so that a block counts only when every worker holds its share, and is
    resident only when every worker's share is)."""

    def __init__(self, scheduler: Any, executor: Executor, write_through: bool = True) -> None:
        self.executor = executor
        super().__init__(scheduler.kv_cache_manager, self._lookup, self._worker_stats,
                         write_through)

    def _lookup(self, block_hashes: list[bytes]) -> tuple[int, int]:
        answers = self.executor.call("offload_call", "lookup", block_hashes)
        return min(held for held, _ in answers), min(resident for _, resident in answers)

    def _worker_stats(self) -> dict[str, int]:
        merged: dict[str, int] = {}
        for stats in self.executor.call("offload_call", "stats"):
            for key, value in (stats or {}).items():
                merged[key] = merged.get(key, 0) + value
        return merged

    def close(self) -> None:
        """Close the tier on every worker (pending disk writes are finished). Logs
        instead of raising, so that engine shutdown always goes on."""
        try:
            self.executor.call("offload_call", "close")
        except Exception:
            logger.exception("closing the KV offload tier failed")


def attach_offload(stack: ResolvedStack, scheduler: Any, executor: Executor,
                   write_through: bool = True) -> EngineOffload | None:
    """Connect the scheduler to the offload tier the runner built; None when offload
    is off. ``write_through``: ``offload.store_policy`` is ``write_through``.

    Raises:
        ConfigError: the scheduler is not a paged scheduler with a ``kv_cache_manager``
            and an ``offload`` slot (e.g. a third-party scheduler of its own design).
    """
    reg = stack.get("offload")
    if reg is None:
        return None
    if not hasattr(scheduler, "kv_cache_manager") or not hasattr(scheduler, "offload"):
        raise ConfigError(
            f"offload tier {reg.name!r} needs a scheduler built on lmkit's PagedScheduler "
            f"(with a kv_cache_manager), but {type(scheduler).__name__} is not; choose "
            "another scheduler or set offload.backend: none")
    coordinator = EngineOffload(scheduler, executor, write_through)
    scheduler.offload = coordinator
    return coordinator

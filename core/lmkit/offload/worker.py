"""The runner side of KV offload: the tier lives next to the device KV cache.

The model runner builds an :class:`OffloadWorker` with its KV caches
(:func:`build_offload_worker`), runs each step's :class:`~lmkit.offload.transfers.KVTransfers`
before the forward (:meth:`OffloadWorker.start`; write-through stores after it,
:meth:`OffloadWorker.after_forward`) and reports finished loads in
``ModelRunnerOutput.finished_kv_loads`` (:meth:`OffloadWorker.finished_loads`). The
scheduler reaches :meth:`OffloadWorker.lookup` and :meth:`OffloadWorker.stats` through
the executor's typed ``offload_lookup`` and ``offload_stats`` (its prefix tier,
:mod:`lmkit.offload.attach`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lmkit.api.contract import build
from lmkit.api.offload import kv_block_axis
from lmkit.errors import ConfigError
from lmkit.offload.transfers import KVTransfers

if TYPE_CHECKING:
    import torch

    from lmkit.api.kv_cache_spec import KVCacheGroup
    from lmkit.api.offload import OffloadManager, TransferJob
    from lmkit.config.schema import LMKitConfig
    from lmkit.plugin_host.resolve import ResolvedStack

logger = logging.getLogger(__name__)

WAIT_WARN_S = 30.0  # warn when a load has not finished after this long


class OffloadWorker:
    """Drives one :class:`~lmkit.api.OffloadManager` for the model runner.

    Args:
        manager: the tier, built over the runner's KV caches.
        name: the tier's registered name (for messages).
        block_bytes: bytes of one KV block across all layers.
    """

    def __init__(self, manager: OffloadManager, name: str, block_bytes: int) -> None:
        self.manager = manager
        self.name = name
        self.block_bytes = block_bytes
        self._stores: dict[int, int] = {}  # tier job id -> number of blocks
        self._loads: dict[int, tuple[int, int]] = {}  # tier job id -> (transfer id, blocks)
        self._finished: dict[int, bool] = {}  # transfer id -> success, not reported yet
        self._same_step: set[int] = set()  # tier job ids of same-step loads in flight
        self._step_load_failed = False  # a same-step load of this step was refused
        self.bytes_stored = 0
        self.bytes_loaded = 0
        self.num_failed_stores = 0
        self._healthy = True
        self._closed = False

    def lookup(self, block_hashes: Sequence[bytes]) -> tuple[int, int]:
        """``(held, resident)``: how many leading blocks of ``block_hashes`` the tier
        holds, and how many of those it could load in the step that reads them
        (:meth:`~lmkit.api.OffloadManager.resident`)."""
        held = self.manager.lookup(block_hashes)
        return held, (min(self.manager.resident(block_hashes[:held]), held) if held else 0)

    def start(self, transfers: KVTransfers | None) -> None:
        """Issue a step's stores, then its loads (before the step's forward).

        ``same_step`` loads go first, through ``load_now``, told of the store just
        issued (nothing else is issued in between), so that a copy need not wait for all
        of that store: the forward issued after this call reads their blocks. One the
        tier refuses (or that raises) is reported failed in this step's
        :meth:`finished_loads`."""
        self._step_load_failed = False
        if not transfers:
            return
        if transfers.fence:
            self.manager.fence()
        store = None
        if transfers.store_hashes:
            store = self.manager.store(transfers.store_hashes, transfers.store_block_ids)
            self._stores[store.job_id] = len(transfers.store_hashes)
        for load in sorted(transfers.loads, key=lambda load: not load.same_step):
            job: TransferJob | None
            if load.same_step:
                try:
                    job = self.manager.load_now(load.block_hashes, load.block_ids, store)
                except Exception:
                    logger.exception("offload tier %r: a load for this step failed", self.name)
                    job = None
                if job is None:
                    self._finished[load.transfer_id] = False
                    self._step_load_failed = True
                    continue
                self._same_step.add(job.job_id)
            else:
                job = self.manager.load(load.block_hashes, load.block_ids)
            self._loads[job.job_id] = (load.transfer_id, len(load.block_ids))

    def after_forward(self, transfers: KVTransfers | None) -> None:
        """Issue the step's write-through stores (``store_computed``), after its forward.

        Skipped when a same-step load of the step failed: the forward then computed a
        request on blocks without valid data, and the scheduler withdraws what it
        registered for it (the other blocks reach the tier when evicted)."""
        if not transfers or not transfers.write_hashes or self._step_load_failed:
            return
        job = self.manager.store_computed(transfers.write_hashes, transfers.write_block_ids)
        if job is not None:
            self._stores[job.job_id] = len(transfers.write_hashes)

    def finished_loads(self, wait: bool = False) -> dict[int, bool]:
        """Loads finished since the last call: transfer id -> success.

        With ``wait`` (a step with nothing to compute), block until every load in
        flight has finished instead of returning to an idle engine loop. Same-step
        loads are always reported by the step that started them (their copies came
        before its forward, so this waits at most for the event to be seen). A load
        is never reported before the tier says it finished: its blocks are released
        for reuse as soon as it is.
        """
        self._poll()
        started = time.monotonic()
        warned = False
        while (wait and self._loads) or self._same_step:
            time.sleep(0.0002)
            self._poll()
            if not warned and time.monotonic() - started > WAIT_WARN_S:
                warned = True
                logger.warning("offload tier %r: %d load(s) unfinished after %.0f s", self.name,
                               len(self._loads), WAIT_WARN_S)
        done, self._finished = self._finished, {}
        return done

    def _poll(self) -> None:
        for job, ok in self.manager.poll():
            if job.job_id in self._loads:
                transfer_id, num_blocks = self._loads.pop(job.job_id)
                self._same_step.discard(job.job_id)
                self._finished[transfer_id] = bool(ok)
                if ok:
                    self.bytes_loaded += num_blocks * self.block_bytes
            elif job.job_id in self._stores:
                num_blocks = self._stores.pop(job.job_id)
                if ok:
                    self.bytes_stored += num_blocks * self.block_bytes
                else:
                    self.num_failed_stores += 1
            else:
                logger.warning("offload tier %r reported job %d, which is not in flight",
                               self.name, job.job_id)

    def stats(self) -> dict[str, int]:
        """Runner-side ``offload_*`` counters and the tier's own; ``offload_unhealthy``
        is 1 while the tier is stuck (:meth:`~lmkit.api.OffloadManager.health`; the
        reason is logged when that changes)."""
        used, capacity = self.manager.usage()
        stats = {
            "offload_bytes_stored": self.bytes_stored,
            "offload_bytes_loaded": self.bytes_loaded,
            "offload_failed_stores": self.num_failed_stores,
            "offload_used_bytes": used,
            "offload_capacity_bytes": capacity,
            "offload_unhealthy": 0 if self._check_health() else 1,
        }
        for key, value in self.manager.stats().items():
            stats[f"offload_{key}"] = value
        return stats

    def _check_health(self) -> bool:
        health = self.manager.health()
        if health.healthy != self._healthy:
            self._healthy = health.healthy
            if health.healthy:
                logger.warning("offload tier %r is healthy again", self.name)
            else:
                logger.error("offload tier %r is unhealthy: %s", self.name, health.reason)
        return health.healthy

    def close(self) -> None:
        """Wait for loads in flight, then close the tier (finishes its pending writes)."""
        if self._closed:
            return
        self._closed = True
        self.finished_loads(wait=True)
        self.manager.close()


def build_offload_worker(config: LMKitConfig, stack: ResolvedStack,
                         kv_caches: list[torch.Tensor], kv_groups: Sequence[KVCacheGroup]
                         ) -> OffloadWorker | None:
    """The offload tier the stack names, built over ``kv_caches`` (per layer, of the
    model's ``kv_groups``); None when offload is off.

    Logs the memory the tier takes (part of the startup memory report).

    Raises:
        ConfigError: prefix caching is off (offload extends the prefix cache), or the
            attention backend's KV layout is not ``[2, num_blocks, ...]``.
    """
    reg = stack.get("offload")
    if reg is None:
        return None
    if not config.cache.enable_prefix_caching:
        raise ConfigError(
            f"offload tier {reg.name!r} extends the prefix cache, which is off "
            "(cache.enable_prefix_caching: false); turn prefix caching on or set "
            "offload.backend: none")
    for group in kv_groups:  # every group's layout (one group for most models)
        one, two = tuple(group.attn.kv_cache_shape(1)), tuple(group.attn.kv_cache_shape(2))
        try:
            axis = kv_block_axis(two)
        except ValueError:
            axis = -1
        if axis < 0 or one[axis] != 1 or two[axis] != 2 or \
                one[:axis] + one[axis + 1:] != two[:axis] + two[axis + 1:]:
            raise ConfigError(
                f"offload tier {reg.name!r} needs KV caches laid out as [2, num_blocks, ...] "
                "(K/V) or [num_blocks, block_size, width] (MLA latent), but the attention "
                f"backend's are {two} for 2 blocks ({group.spec.describe()} layers); choose "
                "a built-in attention backend or set offload.backend: none")
    tier_config = config.model_copy(deep=True)
    attention = stack.get("attention")
    if attention is not None:
        tier_config.attention.backend = attention.name
    manager = build("offload", reg.spec.load(), tier_config, kv_caches,
                    options=stack.options["offload"], plugin=reg.origin)
    block_bytes = sum(c.select(kv_block_axis(tuple(c.shape)), 0).numel() * c.element_size()
                      for c in kv_caches)
    _, capacity = manager.usage()
    logger.info("KV offload: tier %r, %.2f GiB (%d blocks of %.2f MiB)", reg.name,
                capacity / 2**30, capacity // max(block_bytes, 1), block_bytes / 2**20)
    return OffloadWorker(manager, reg.name, block_bytes)

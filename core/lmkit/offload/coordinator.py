"""The scheduler side of KV offload: what goes to the tier, and what comes back.

* **Stores.** The block pool calls :meth:`OffloadCoordinator.on_evict` when it hands
  out a cached block as a fresh one. The block's contents are still intact (nothing
  runs between planning a step and the runner's transfers), so the coordinator queues
  a store, and the runner copies the block out before this step's forward reuses it.
* **Write-through** (``offload.store_policy: write_through``, the default). Every
  block registered in the prefix cache (full, computed by this step's forward) is also
  sent as a write-through store, which the runner issues right after the forward; by
  the time the block is evicted the tier holds it, and that store copies nothing.
* **Loads.** At admission (:meth:`OffloadCoordinator.defer_admission`), when the tier
  holds blocks past the device prefix-cache hit, the coordinator takes fresh device
  blocks for them and queues a load. The request's device hits and the load's blocks
  stay referenced by the coordinator until the load is reported, so nothing evicts or
  reuses them meanwhile. Then either

  - **same step**: the tier holds every block in memory (``resident``), so the load
    cannot fail once started; the request is admitted in this very step with the
    loaded blocks after its hits (:meth:`OffloadCoordinator.loaded_blocks`), and the
    step computes its suffix after the copy; or
  - **later**: the request is held back until the load is reported (a disk read).

* **Completion.** The runner reports finished loads
  (:meth:`OffloadCoordinator.on_loads_finished`). A successful load registers its
  blocks in the device prefix cache and releases them; a held-back request is then
  admitted through the ordinary path and finds them as prefix-cache hits. A failed
  load registers nothing: the request recomputes those tokens and never loads again.
  A same-step load fails only when a store since the lookup pushed the blocks out of
  the tier; the scheduler then takes the request's admission back (what the step
  computed for it is discarded) and it is admitted again without same-step loads.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmkit.kv_cache.hashing import BlockHash, update_block_hashes
from lmkit.offload.transfers import KVTransfers, LoadRequest

if TYPE_CHECKING:
    from lmkit.api.request import Request
    from lmkit.kv_cache.block_pool import KVCacheBlock
    from lmkit.kv_cache.manager import KVCacheManager

logger = logging.getLogger(__name__)

LOAD_FAILED = "offload_load_failed"  # key in Request.extra: never load for it again
NO_SAME_STEP = "offload_no_same_step"  # key in Request.extra: a same-step load failed


@dataclass(slots=True)
class PendingLoad:
    """A load in flight and the blocks held for it."""

    request: Request
    hits: list[KVCacheBlock]  # device prefix-cache hits before the loaded blocks
    blocks: list[KVCacheBlock]  # destinations, in token order
    block_hashes: list[BlockHash]
    same_step: bool = False  # the request is admitted in the step of its load


class OffloadCoordinator:
    """Connects a :class:`~lmkit.kv_cache.manager.KVCacheManager` to an offload tier.

    Args:
        kv_cache_manager: the scheduler's manager; the coordinator installs itself as
            its block pool's eviction listener.
        lookup: ``lookup(block_hashes)``, how many leading blocks the tier holds (the
            tier lives with the device caches, in the runner): an int, or ``(held,
            resident)`` where ``resident`` of them can be loaded in the step that
            computes the request (``OffloadManager.resident``).
        worker_stats: returns the runner-side counters (bytes moved, tier usage, ...).
        write_through: also store each full block right after the step that computes
            it (``offload.store_policy: write_through``), so that its eviction later
            finds it in the tier and costs no copy; False stores on eviction only.
    """

    def __init__(self, kv_cache_manager: KVCacheManager,
                 lookup: Callable[[list[BlockHash]], int | tuple[int, int]],
                 worker_stats: Callable[[], dict[str, int]] | None = None,
                 write_through: bool = False) -> None:
        self.manager = kv_cache_manager
        self.pool = kv_cache_manager.block_pool
        self.block_size = kv_cache_manager.block_size
        self.lookup = lookup
        self.worker_stats = worker_stats
        self.pool.on_evict = self.on_evict
        self.write_through = write_through
        if write_through:
            self.pool.on_cache = self.on_cache
        self._computed: list[tuple[KVCacheBlock, BlockHash]] = []  # registered this step
        self._fence = False
        self._loading_back = False  # registering loaded blocks (the tier has them)
        self._store_hashes: list[BlockHash] = []
        self._store_block_ids: list[int] = []
        self._loads: list[LoadRequest] = []
        self._pending: dict[int, PendingLoad] = {}  # transfer id -> load in flight
        self._loading: dict[str, int] = {}  # request id -> transfer id
        self._in_flight: dict[BlockHash, int] = {}  # hash being loaded -> transfer id
        self._ids = itertools.count()
        self.num_stored_blocks = 0
        self.num_written_blocks = 0
        self.num_hit_tokens = 0
        self.num_load_jobs = 0
        self.num_loaded_blocks = 0
        self.num_failed_loads = 0

    # -- stores -------------------------------------------------------------------

    def on_evict(self, block_id: int, block_hash: BlockHash) -> None:
        """The pool is reusing cached block ``block_id``: store it before it is."""
        self._store_hashes.append(block_hash)
        self._store_block_ids.append(block_id)

    def on_cache(self, block: KVCacheBlock) -> None:
        """The pool registered ``block`` (full, computed by this step): write it through
        after the step's forward, unless it came from the tier."""
        if not self._loading_back and block.block_hash is not None:
            self._computed.append((block, block.block_hash))

    def fence_writes(self) -> None:
        """The prefix cache is being reset: blocks written through lose their hash
        without an eviction, so the next step orders itself after their reads."""
        self._fence = True

    # -- loads --------------------------------------------------------------------

    def is_loading(self, request: Request) -> bool:
        """Whether a load for ``request`` is in flight."""
        return request.request_id in self._loading

    def defer_admission(self, request: Request) -> bool:
        """Called before ``request`` is admitted. True means "not this step": its load
        is in flight, one was just started for the tier's part of its prefix (and must
        finish first), another request's load brings part of it, or the tier holds
        more of it than the pool has free blocks for yet.

        False with a same-step load started: admit it now, taking the loaded blocks
        from :meth:`loaded_blocks` (or call :meth:`keep_waiting` if it cannot be)."""
        if self.is_loading(request):
            return True
        if request.extra.get(LOAD_FAILED) or request.sampling_params.prompt_logprobs is not None:
            return False
        hashes = update_block_hashes(request, self.block_size, self.manager.hash_seed)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        start = len(hits)
        if start >= max_hit_blocks:
            return False
        if any(h in self._in_flight for h in hashes[start:max_hit_blocks]):
            return True  # registered once that load is reported: wait rather than copy twice
        found = self.lookup(hashes[start:max_hit_blocks])
        num_blocks, num_resident = (found, 0) if isinstance(found, int) else found
        if num_blocks == 0:
            return False
        # the hits sitting in the free queue stop being free once held
        num_free = self.pool.num_free_blocks - sum(1 for b in hits if b.ref_cnt == 0)
        if num_blocks > num_free:
            return True  # wait for room (running requests free it): loading beats recomputing
        self.pool.touch(hits)
        blocks = self.pool.get_new_blocks(num_blocks)  # evictions queue stores first
        load_hashes = list(hashes[start:start + num_blocks])
        same_step = num_resident >= num_blocks and not request.extra.get(NO_SAME_STEP)
        transfer_id = next(self._ids)
        self._loads.append(LoadRequest(transfer_id, load_hashes, [b.block_id for b in blocks],
                                       same_step))
        self._pending[transfer_id] = PendingLoad(request, hits, blocks, load_hashes, same_step)
        self._loading[request.request_id] = transfer_id
        for block_hash in load_hashes:
            self._in_flight[block_hash] = transfer_id
        self.num_hit_tokens += num_blocks * self.block_size
        self.num_load_jobs += 1
        return not same_step

    def _is_same_step(self, request: Request) -> bool:
        transfer_id = self._loading.get(request.request_id)
        return transfer_id is not None and self._pending[transfer_id].same_step \
            and any(load.transfer_id == transfer_id for load in self._loads)

    def loaded_blocks(self, request: Request) -> list[KVCacheBlock]:
        """The blocks of ``request``'s same-step load started this step (to follow its
        device prefix-cache hits), counted as prefix-cache hits; [] if it has none.

        The request's prefix-cache hits must be the ones found when the load started
        (the coordinator holds them, so they are)."""
        if not self._is_same_step(request):
            return []
        pending = self._pending[self._loading[request.request_id]]
        self.manager.prefix_cache_hits += len(pending.blocks) * self.block_size
        return list(pending.blocks)

    def keep_waiting(self, request: Request) -> None:
        """``request`` was given a same-step load but is not admitted this step after
        all (no budget or room for its other tokens): its load finishes on its own, and
        it waits for it as for any other."""
        transfer_id = self._loading[request.request_id]
        self._pending[transfer_id].same_step = False
        for load in self._loads:
            if load.transfer_id == transfer_id:
                load.same_step = False

    def take_transfers(self) -> KVTransfers | None:
        """This step's stores, loads and write-through stores
        (``SchedulerOutput.kv_transfers``), or None."""
        # registered this step and still registered (not withdrawn by a preemption)
        written = [(b, h) for b, h in self._computed if b.block_hash == h]
        self._computed = []
        if not self._store_hashes and not self._loads and not written and not self._fence:
            return None
        transfers = KVTransfers(self._store_hashes, self._store_block_ids, self._loads,
                                [h for _, h in written], [b.block_id for b, _ in written],
                                self._fence)
        self.num_stored_blocks += len(self._store_hashes)
        self.num_written_blocks += len(written)
        self._store_hashes, self._store_block_ids, self._loads = [], [], []
        self._fence = False
        return transfers

    def on_loads_finished(self, results: dict[int, bool]) -> list[tuple[Request, int]]:
        """Register successful loads in the device prefix cache; release the held blocks.

        A request aborted while its load ran still gets its (valid) blocks cached.

        Returns ``(request, num_valid_tokens)`` for each failed same-step load: the
        request was admitted with blocks that hold no valid data, so the scheduler must
        take that admission back; only its first ``num_valid_tokens`` (its device
        prefix-cache hits) are sound."""
        taken_back: list[tuple[Request, int]] = []
        for transfer_id, ok in results.items():
            pending = self._pending.pop(transfer_id, None)
            if pending is None:
                logger.warning("offload: the runner reported unknown load %d", transfer_id)
                continue
            request = pending.request
            if self._loading.get(request.request_id) == transfer_id:
                del self._loading[request.request_id]
            for block_hash in pending.block_hashes:
                if self._in_flight.get(block_hash) == transfer_id:
                    del self._in_flight[block_hash]
            if ok:
                self._loading_back = True
                try:
                    for block, block_hash in zip(pending.blocks, pending.block_hashes,
                                                 strict=True):
                        self.pool.cache_block(block, block_hash)
                finally:
                    self._loading_back = False
                self.num_loaded_blocks += len(pending.blocks)
            elif pending.same_step:
                request.extra[NO_SAME_STEP] = True  # next time: the asynchronous path
                self.num_failed_loads += 1
                taken_back.append((request, len(pending.hits) * self.block_size))
                logger.info("offload: the tier no longer held the %d blocks of request %s "
                            "loaded for this step; it is admitted again", len(pending.blocks),
                            request.request_id)
            else:
                request.extra[LOAD_FAILED] = True
                self.num_failed_loads += 1
                logger.info("offload: loading %d blocks for request %s failed; recomputing",
                            len(pending.blocks), request.request_id)
            # last-first, so that the prefix is the last to be evicted
            self.pool.free_blocks(reversed(pending.hits + pending.blocks))
        return taken_back

    @property
    def has_pending_loads(self) -> bool:
        """Whether loads are queued or in flight."""
        return bool(self._pending)

    # -- metrics ------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """``offload_*`` counters: ``stored_blocks`` (evictions sent to the tier),
        ``written_blocks`` (computed blocks written through),
        ``hit_tokens`` (tokens found in the tier at admission), ``load_jobs``,
        ``loaded_blocks`` and ``failed_loads``, plus the runner's (bytes moved, failed
        stores, tier usage and capacity, tier evictions)."""
        stats: dict[str, Any] = {
            "offload_stored_blocks": self.num_stored_blocks,
            "offload_written_blocks": self.num_written_blocks,
            "offload_hit_tokens": self.num_hit_tokens,
            "offload_load_jobs": self.num_load_jobs,
            "offload_loaded_blocks": self.num_loaded_blocks,
            "offload_failed_loads": self.num_failed_loads,
        }
        if self.worker_stats is not None:
            stats.update(self.worker_stats())
        return stats

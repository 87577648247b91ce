"""The ``cpu`` tier: KV blocks in a host memory pool of fixed size.

The pool is one tensor of ``size_gb`` worth of host blocks (page-locked with CUDA, so
copies run asynchronously on the copier's stream), a map from block hash to pool slot,
and an eviction policy (LRU, or ARC) over the held hashes. Memory is trusted: loads do
not verify checksums, which keeps a load at the speed of the copy. Every held block is
resident: a load either fails at once (the block is gone) or cannot fail, so the
engine may compute a request in the step its prefix is loaded (``load_now``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lmkit.api import ConfigError, LMKitConfig, OffloadManager, TransferJob

from lmkit_plugins.offload.copier import BlockCopier, StoreReads
from lmkit_plugins.offload.jobs import JobBook
from lmkit_plugins.offload.options import CPUTierOptions
from lmkit_plugins.offload.policy import make_policy

logger = logging.getLogger(__name__)

# spill(block_hash, host_block): a held block is being evicted; host_block ([layers, 2,
# E]) is valid only during the call
Spill = Callable[[bytes, torch.Tensor], None]


class CPUTier(OffloadManager):
    """Host-memory offload tier.

    Args:
        config: the engine configuration (unused beyond construction checks).
        kv_caches: the device caches, ``[2, num_blocks, ...]`` per layer.
        options: :class:`~lmkit_plugins.offload.options.CPUTierOptions`.
    """

    def __init__(self, config: LMKitConfig, kv_caches: Sequence[torch.Tensor],
                 options: CPUTierOptions | None = None) -> None:
        options = options or CPUTierOptions()
        self.copier = BlockCopier(kv_caches)
        self.num_slots = int(options.size_gb * 2**30) // self.copier.block_bytes
        if self.num_slots < 1:
            raise ConfigError(
                f"offload tier 'cpu': size_gb={options.size_gb} holds no KV block of "
                f"{self.copier.block_bytes / 2**20:.2f} MiB; raise offload.options.size_gb")
        pin = options.pin_memory if options.pin_memory is not None else self.copier.is_cuda
        self.pinned = bool(pin) and torch.cuda.is_available()
        self.pool = self.copier.host_rows(self.num_slots, pin=self.pinned)
        self.slot_of: dict[bytes, int] = {}
        self.free_slots = list(range(self.num_slots - 1, -1, -1))  # pop() gives 0, 1, ...
        self.policy = make_policy(options.eviction, self.num_slots)
        self.jobs = JobBook()
        self.spill: Spill | None = None  # set by a tier below this one (cpu+disk)
        # CUDA: slot -> (direction, event) of the last copy touching it; a copy in the
        # other direction (its own stream) waits for it
        self._slot_copy: dict[int, tuple[str, Any]] = {}
        # CUDA: the latest store's job id and when it read its device blocks
        self._store_reads: tuple[int, StoreReads] | None = None
        self.num_evictions = 0
        self.num_copied_out = 0  # blocks copied into the pool (held ones are skipped)
        staging = (f", plus 2 x {self.copier.staging_rows * self.copier.block_bytes / 2**20:.0f}"
                   " MiB of device staging" if self.copier.is_cuda else "")
        logger.info("offload tier 'cpu': %.2f GiB of %s host memory, %d blocks, %s eviction%s",
                    self.num_slots * self.copier.block_bytes / 2**30,
                    "page-locked" if self.pinned else "pageable", self.num_slots, options.eviction,
                    staging)

    # -- contract -----------------------------------------------------------------

    def lookup(self, block_hashes: Sequence[bytes]) -> int:
        n = 0
        for block_hash in block_hashes:
            if block_hash not in self.slot_of:
                break
            self.policy.touch(block_hash)
            n += 1
        return n

    def holds(self, block_hash: bytes) -> bool:
        """Whether ``block_hash`` is held (no access recorded)."""
        return block_hash in self.slot_of

    def store(self, block_hashes: Sequence[bytes], block_ids: Sequence[int]) -> TransferJob:
        """Store evicted blocks (those written through are held already: no copy, only
        ordered after the write-through's reads, see :meth:`store_computed`)."""
        job = self.jobs.new("store", block_hashes, block_ids)
        before = self._cuda_event()  # the current stream's work before this store
        written = self.copier.take_reads(block_ids)  # write-through reads still running
        event, reads = self._copy_out(block_hashes, block_ids, deferred=False)
        if written:
            reads = reads or StoreReads(before)
            reads.chunks += written
            for _, read in written:  # the step's forward may overwrite them once read
                self.copier.current_waits_for(read)
        self._store_reads = (job.job_id, reads) if reads is not None else None
        return self.jobs.finish(job, True, event)

    def store_computed(self, block_hashes: Sequence[bytes], block_ids: Sequence[int]
                       ) -> TransferJob:
        """Write-through of blocks just computed (they stay in the device cache): on CUDA
        the current stream does not wait for the read; the eviction :meth:`store` of a
        block, or :meth:`fence`, does."""
        job = self.jobs.new("store", block_hashes, block_ids)
        event, _ = self._copy_out(block_hashes, block_ids, deferred=True)
        return self.jobs.finish(job, True, event)

    def fence(self) -> None:
        if self.copier.is_cuda:
            self.copier.fence()

    def _cuda_event(self) -> Any:
        """An event recorded now on the current stream (CUDA), else None."""
        if not self.copier.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.copier.device))
        return event

    def _copy_out(self, block_hashes: Sequence[bytes], block_ids: Sequence[int],
                  deferred: bool) -> tuple[Any, StoreReads | None]:
        """Copy the blocks not held yet into slots; returns the last copy's CUDA event
        (None when complete) and when the device blocks were read (CUDA)."""
        wanted: dict[bytes, int] = {}  # hash -> device block, new ones only
        for block_hash, block_id in zip(block_hashes, block_ids, strict=True):
            if block_hash in self.slot_of:
                self.policy.touch(block_hash)  # same hash, same contents: nothing to copy
            else:
                wanted[block_hash] = block_id
        new = list(wanted.items())
        if self.spill is None:
            new = new[-self.num_slots:]  # more than fits: the last ones win
        event = None
        reads: StoreReads | None = None
        # (with a tier below, a batch larger than the pool goes through it in pool-sized
        # chunks: each chunk's arrival spills the previous one)
        for start in range(0, len(new), self.num_slots):
            chunk = new[start:start + self.num_slots]
            fresh = {h for h, _ in chunk}  # not copied yet: nothing to spill if evicted
            for block_hash, _ in chunk:
                self._take_slot(block_hash, fresh)
            copies = [(self.slot_of[h], b) for h, b in chunk if h in self.slot_of]
            slots = [s for s, _ in copies]
            event = self.copier.gather([b for _, b in copies], self.pool, slots,
                                       self._pending_copies(slots, "load"), deferred)
            self._mark(slots, "store", event)
            last = self.copier.last_reads
            if reads is None:
                reads = last
            elif last is not None:
                reads.chunks += last.chunks
            self.num_copied_out += len(copies)
        return event, reads

    def load(self, block_hashes: Sequence[bytes], block_ids: Sequence[int]) -> TransferJob:
        job = self.jobs.new("load", block_hashes, block_ids)
        slots = self._slots(block_hashes, block_ids)
        if slots is None:
            return self.jobs.finish(job, False)
        return self.jobs.finish(job, True, self._scatter(block_hashes, slots, block_ids))

    def resident(self, block_hashes: Sequence[bytes]) -> int:
        n = 0
        for block_hash in block_hashes:
            if block_hash not in self.slot_of:
                break
            n += 1
        return n

    def load_now(self, block_hashes: Sequence[bytes], block_ids: Sequence[int],
                 after_store: TransferJob | None = None) -> TransferJob | None:
        slots = self._slots(block_hashes, block_ids)
        if slots is None:
            return None
        after = None  # the store's reads, when it was the one just before
        if after_store is not None and self._store_reads is not None \
                and self._store_reads[0] == after_store.job_id:
            after = self._store_reads[1]
        event = self._scatter(block_hashes, slots, block_ids, after)
        self.copier.current_waits_for(event)  # the step's forward reads the blocks
        return self.jobs.finish(self.jobs.new("load", block_hashes, block_ids), True, event)

    def poll(self) -> list[tuple[TransferJob, bool]]:
        return self.jobs.poll()

    def usage(self) -> tuple[int, int]:
        block = self.copier.block_bytes
        return len(self.slot_of) * block, self.num_slots * block

    def stats(self) -> dict[str, int]:
        return {"evictions": self.num_evictions, "copied_out_blocks": self.num_copied_out}

    def close(self) -> None:
        self.copier.synchronize()

    # -- slots --------------------------------------------------------------------

    def _slots(self, block_hashes: Sequence[bytes], block_ids: Sequence[int]) -> list[int] | None:
        """The pool slots of ``block_hashes``, or None if one is not held."""
        found = [self.slot_of.get(h) for h in block_hashes]
        slots = [s for s in found if s is not None]
        if len(slots) != len(found) or len(slots) != len(block_ids):
            return None
        return slots

    def _scatter(self, block_hashes: Sequence[bytes], slots: list[int],
                 block_ids: Sequence[int], after: StoreReads | None = None) -> Any:
        """Copy held ``slots`` into device blocks ``block_ids`` (an access of each hash),
        ``after`` a store's reads (see :meth:`BlockCopier.scatter`); returns the copy's
        CUDA event, or None when complete."""
        for block_hash in block_hashes:
            self.policy.touch(block_hash)
        event = self.copier.scatter(self.pool, slots, block_ids,
                                    self._pending_copies(slots, "store"), after)
        self._mark(slots, "load", event)
        return event

    def _take_slot(self, block_hash: bytes, fresh: set[bytes]) -> int:
        """Give ``block_hash`` a slot, evicting (and spilling) what the policy says;
        ``fresh`` hashes have no contents yet."""
        for victim in self.policy.insert(block_hash):
            slot = self.slot_of.pop(victim)  # type: ignore[call-overload]
            self.num_evictions += 1
            if self.spill is not None and victim not in fresh:
                self.copier.synchronize()  # the slot's own copy may still be running
                self.spill(victim, self.pool[slot])  # type: ignore[arg-type]
            self.free_slots.append(slot)
        slot = self.free_slots.pop()
        self.slot_of[block_hash] = slot
        return slot

    def _pending_copies(self, slots: Sequence[int], direction: str) -> list[Any]:
        """Unfinished CUDA copies in ``direction`` touching ``slots`` (deduplicated)."""
        events: dict[int, Any] = {}
        for slot in slots:
            last = self._slot_copy.get(slot)
            if last is not None and last[0] == direction and id(last[1]) not in events:
                if last[1].query():
                    del self._slot_copy[slot]
                else:
                    events[id(last[1])] = last[1]
        return list(events.values())

    def _mark(self, slots: Sequence[int], direction: str, event: Any) -> None:
        if event is not None:
            for slot in slots:
                self._slot_copy[slot] = (direction, event)

    def host_block(self, block_hash: bytes) -> Any:
        """The held host block of ``block_hash`` (a view into the pool), or None."""
        slot = self.slot_of.get(block_hash)
        return None if slot is None else self.pool[slot]

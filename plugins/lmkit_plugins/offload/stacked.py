"""The ``cpu+disk`` tier: a host memory pool whose evictions go to a disk tier.

Stores go to host memory; a block the host pool evicts is handed to the disk tier
(copied out of the pool first, written in the background). A lookup counts leading
blocks held by either level, and a load takes each block from where it is: host
memory for the recent ones, disk for the rest. A block loaded from disk comes back
into host memory the next time the device cache evicts it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from lmkit.api import LMKitConfig, OffloadManager, TransferJob
from lmkit.api.offload import OffloadHealth

from lmkit_plugins.offload.cpu_tier import CPUTier
from lmkit_plugins.offload.disk_tier import DiskTier
from lmkit_plugins.offload.jobs import JobBook
from lmkit_plugins.offload.options import CPUDiskTierOptions


class CPUDiskTier(OffloadManager):
    """Host memory over disk.

    Args:
        config: the engine configuration.
        kv_caches: the device caches, ``[2, num_blocks, ...]`` per layer.
        options: :class:`~lmkit_plugins.offload.options.CPUDiskTierOptions`.
    """

    def __init__(self, config: LMKitConfig, kv_caches: Sequence[torch.Tensor],
                 options: CPUDiskTierOptions | None = None) -> None:
        options = options or CPUDiskTierOptions()
        self.cpu = CPUTier(config, kv_caches, options.cpu())
        try:
            self.disk = DiskTier(config, kv_caches, options.disk(), copier=self.cpu.copier)
        except BaseException:
            self.cpu.close()
            raise
        self.cpu.spill = self._spill
        self.jobs = JobBook()
        self._parent: dict[tuple[str, int], int] = {}  # (level, its job id) -> our job id
        self._open: dict[int, tuple[TransferJob, int, bool]] = {}  # id -> (job, parts left, ok)
        self._last_store: tuple[int, TransferJob] | None = None  # (our job id, the cpu part)

    def _spill(self, block_hash: bytes, block: torch.Tensor) -> None:
        self.disk.put(block_hash, block.clone())

    # -- contract -----------------------------------------------------------------

    def lookup(self, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks held by either level (not counting the disk while it is stuck)."""
        n = 0
        disk_ok = not self.disk.is_stuck
        for block_hash in block_hashes:
            if self.cpu.holds(block_hash):
                self.cpu.policy.touch(block_hash)
            elif disk_ok and self.disk.holds(block_hash):
                self.disk.policy.touch(block_hash)
            else:
                break
            n += 1
        return n

    def store(self, block_hashes: Sequence[bytes], block_ids: Sequence[int]) -> TransferJob:
        job = self.jobs.new("store", block_hashes, block_ids)
        part = self.cpu.store(block_hashes, block_ids)
        self._track(job, [("cpu", part)])
        self._last_store = (job.job_id, part)
        return job

    def store_computed(self, block_hashes: Sequence[bytes], block_ids: Sequence[int]
                       ) -> TransferJob:
        """Write-through into host memory (see :meth:`CPUTier.store_computed`); skips
        blocks the disk holds, which need no second copy."""
        job = self.jobs.new("store", block_hashes, block_ids)
        keep = [i for i, h in enumerate(block_hashes) if not self.disk.holds(h)]
        part = self.cpu.store_computed([block_hashes[i] for i in keep],
                                       [block_ids[i] for i in keep])
        self._track(job, [("cpu", part)])
        return job

    def fence(self) -> None:
        self.cpu.fence()

    def load(self, block_hashes: Sequence[bytes], block_ids: Sequence[int]) -> TransferJob:
        job = self.jobs.new("load", block_hashes, block_ids)
        in_cpu = [self.cpu.holds(h) for h in block_hashes]
        if len(block_hashes) != len(block_ids) or not all(
                c or self.disk.holds(h) for c, h in zip(in_cpu, block_hashes, strict=True)):
            return self.jobs.finish(job, False)
        parts = []
        for level, tier, want in (("cpu", self.cpu, True), ("disk", self.disk, False)):
            hashes = [h for h, c in zip(block_hashes, in_cpu, strict=True) if c is want]
            ids = [b for b, c in zip(block_ids, in_cpu, strict=True) if c is want]
            if hashes:
                parts.append((level, tier.load(hashes, ids)))
        self._track(job, parts)
        return job

    def resident(self, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks held in host memory (blocks only on disk need a read)."""
        return self.cpu.resident(block_hashes)

    def load_now(self, block_hashes: Sequence[bytes], block_ids: Sequence[int],
                 after_store: TransferJob | None = None) -> TransferJob | None:
        store = None  # the host pool's part of that store
        if after_store is not None and self._last_store is not None \
                and self._last_store[0] == after_store.job_id:
            store = self._last_store[1]
        part = self.cpu.load_now(block_hashes, block_ids, store)
        if part is None:
            return None  # (some block went to disk since the lookup)
        job = self.jobs.new("load", block_hashes, block_ids)
        self._track(job, [("cpu", part)])
        return job

    def poll(self) -> list[tuple[TransferJob, bool]]:
        for level, tier in (("cpu", self.cpu), ("disk", self.disk)):
            for part, ok in tier.poll():
                parent = self._parent.pop((level, part.job_id), None)
                if parent is None:
                    continue
                job, left, all_ok = self._open.pop(parent)
                if left > 1:
                    self._open[parent] = (job, left - 1, all_ok and ok)
                else:
                    self.jobs.finish(job, all_ok and ok)
        return self.jobs.poll()

    def usage(self) -> tuple[int, int]:
        cpu_used, cpu_cap = self.cpu.usage()
        disk_used, disk_cap = self.disk.usage()
        return cpu_used + disk_used, cpu_cap + disk_cap

    def stats(self) -> dict[str, int]:
        """``evictions`` counts blocks leaving both levels; ``cpu_*`` and ``disk_*`` each."""
        stats = {"evictions": self.disk.num_evictions}
        for level, tier in (("cpu", self.cpu), ("disk", self.disk)):
            stats.update({f"{level}_{k}": v for k, v in tier.stats().items()})
        return stats

    def health(self) -> OffloadHealth:
        """The disk level's (host memory cannot get stuck)."""
        return self.disk.health()

    def close(self) -> None:
        self.cpu.close()
        self.disk.close()

    def _track(self, job: TransferJob, parts: list[tuple[str, TransferJob]]) -> None:
        if not parts:
            self.jobs.finish(job, True)
            return
        self._open[job.job_id] = (job, len(parts), True)
        for level, part in parts:
            self._parent[(level, part.job_id)] = job.job_id

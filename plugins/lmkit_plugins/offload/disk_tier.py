"""The ``disk`` tier: KV blocks as files in a directory of limited size.

Blocks persist across restarts: a new engine running the same model files with the
same KV layout (same fingerprint) finds the files the last one left and loads them.
File reads and writes run on a small thread pool; everything else (the index, the
eviction order, deleting evicted files) happens on the caller's thread. A block
waiting to be written stays in host memory and is served from there. Any read that
fails, comes up short or does not verify (a forged file fails its MAC) is a failed
load: the file is deleted and the engine recomputes. A load whose reads are not all
done within ``read_timeout_s`` is failed too (a miss); while one of its reads is still
running past that deadline, the tier is unhealthy and answers every lookup with 0, so
the engine runs on without it instead of waiting.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lmkit.api import ConfigError, LMKitConfig, OffloadManager, TransferJob
from lmkit.api.offload import OffloadHealth, kv_cache_fingerprint

from lmkit_plugins.offload.copier import BlockCopier
from lmkit_plugins.offload.disk_files import HEADER_SIZE, BadBlockFile, BlockDirectory
from lmkit_plugins.offload.disk_key import resolve_key
from lmkit_plugins.offload.jobs import JobBook
from lmkit_plugins.offload.options import DiskTierOptions
from lmkit_plugins.offload.policy import make_policy

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PendingWrite:
    """A block on its way to disk; ``evicted`` ones are deleted once written."""

    data: torch.Tensor  # [layers, parts, E] on the host
    future: Future
    evicted: bool = False


@dataclass(slots=True)
class PendingJob:
    """A store waiting for its writes, or a load waiting for its reads."""

    job: TransferJob
    futures: list[Future]
    parts: list[Any] = field(default_factory=list)  # loads: host block or future per block
    deadline: float = float("inf")  # loads: time.monotonic() past which the load is a miss


class DiskTier(OffloadManager):
    """Directory offload tier.

    Args:
        config: the engine configuration (names the model for the fingerprint).
        kv_caches: the device caches, ``[2, num_blocks, ...]`` per layer.
        options: :class:`~lmkit_plugins.offload.options.DiskTierOptions`.
        copier: share another tier's copier (its streams and staging buffers).
    """

    def __init__(self, config: LMKitConfig, kv_caches: Sequence[torch.Tensor],
                 options: DiskTierOptions | None = None, copier: BlockCopier | None = None
                 ) -> None:
        options = options or DiskTierOptions()
        self.copier = copier or BlockCopier(kv_caches)
        self.block_bytes = self.copier.block_bytes
        self.file_bytes = HEADER_SIZE + self.block_bytes
        capacity = int(options.size_gb * 2**30) // self.file_bytes
        if capacity < 1:
            raise ConfigError(
                f"offload tier 'disk': size_gb={options.size_gb} holds no KV block file of "
                f"{self.file_bytes / 2**20:.2f} MiB; raise offload.options.size_gb")
        root = Path(options.path).expanduser()
        key = resolve_key(options.key_file, root)
        self.files = BlockDirectory(root, kv_cache_fingerprint(config, kv_caches), key.key)
        self.read_timeout_s = options.read_timeout_s
        self._reads_lock = threading.Lock()
        self._reads: dict[int, float] = {}  # io thread id -> its current read's deadline
        self.policy = make_policy(options.eviction, capacity)
        self.io = ThreadPoolExecutor(options.io_threads, thread_name_prefix="lmkit-kv-disk")
        self.writes: dict[bytes, PendingWrite] = {}
        self.max_pending_bytes = int(options.max_pending_write_gb * 2**30)
        self.jobs = JobBook()
        self.stores: list[PendingJob] = []
        self.loads: list[PendingJob] = []
        self.num_evictions = self.num_bad_files = self.num_write_errors = 0
        self.num_dropped_writes = self.num_read_timeouts = 0
        self._closed = False
        found = sorted(self.files.scan(self.file_bytes), key=lambda e: e[1])
        for block_hash, _ in found:  # oldest first, so the newest survive a smaller limit
            for victim in self.policy.insert(block_hash):
                self.files.unlink(victim)  # type: ignore[arg-type]
        logger.info("offload tier 'disk': %s, %.2f GiB (%d blocks), %d blocks from earlier runs",
                    self.files.root / self.files.name, capacity * self.file_bytes / 2**30,
                    capacity, len(self.policy))
        logger.info("offload tier 'disk': block files authenticated with %s%s", key.source,
                    "" if key.persistent else " (files of earlier processes are misses; set "
                    "LMKIT_OFFLOAD_KEY or offload.options.key_file to keep them)")

    # -- contract -----------------------------------------------------------------

    def lookup(self, block_hashes: Sequence[bytes]) -> int:
        if self.is_stuck:
            return 0
        n = 0
        for block_hash in block_hashes:
            if block_hash not in self.policy:
                break
            self.policy.touch(block_hash)
            n += 1
        return n

    def holds(self, block_hash: bytes) -> bool:
        """Whether ``block_hash`` is held (on disk or on its way)."""
        return block_hash in self.policy

    def store(self, block_hashes: Sequence[bytes], block_ids: Sequence[int]) -> TransferJob:
        job = self.jobs.new("store", block_hashes, block_ids)
        wanted: dict[bytes, int] = {}
        for block_hash, block_id in zip(block_hashes, block_ids, strict=True):
            if block_hash in self.policy:
                self.policy.touch(block_hash)
            else:
                wanted[block_hash] = block_id
        new = list(wanted.items())[-self.policy.capacity:]
        host = self.copier.host_rows(len(new))
        event = self.copier.gather([b for _, b in new], host, list(range(len(new))))
        if event is not None:
            event.synchronize()
        futures = [f for i, (h, _) in enumerate(new) if (f := self.put(h, host[i])) is not None]
        self.stores.append(PendingJob(job, futures))
        return job

    def load(self, block_hashes: Sequence[bytes], block_ids: Sequence[int]) -> TransferJob:
        job = self.jobs.new("load", block_hashes, block_ids)
        if len(block_hashes) != len(block_ids) or any(h not in self.policy for h in block_hashes):
            return self.jobs.finish(job, False)
        deadline = time.monotonic() + self.read_timeout_s
        parts: list[Any] = []
        for block_hash in block_hashes:
            self.policy.touch(block_hash)
            pending = self.writes.get(block_hash)
            parts.append(pending.data if pending is not None else
                         self.io.submit(self._read, block_hash, deadline))
        self.loads.append(PendingJob(job, [p for p in parts if isinstance(p, Future)], parts,
                                     deadline))
        return job

    def poll(self) -> list[tuple[TransferJob, bool]]:
        self._reap_writes()
        still: list[PendingJob] = []
        for pending in self.stores:
            if all(f.done() for f in pending.futures):
                self.jobs.finish(pending.job, all(f.exception() is None for f in pending.futures))
            else:
                still.append(pending)
        self.stores = still
        still = []
        now = time.monotonic()
        for pending in self.loads:
            if all(f.done() for f in pending.futures):
                self._finish_load(pending)
            elif now >= pending.deadline:
                self._expire_load(pending)
            else:
                still.append(pending)
        self.loads = still
        return self.jobs.poll()

    def usage(self) -> tuple[int, int]:
        return len(self.policy) * self.file_bytes, self.policy.capacity * self.file_bytes

    def stats(self) -> dict[str, int]:
        return {"evictions": self.num_evictions, "bad_files": self.num_bad_files,
                "write_errors": self.num_write_errors, "dropped_writes": self.num_dropped_writes,
                "read_timeouts": self.num_read_timeouts}

    def num_stuck_reads(self) -> int:
        """Reads still running past their load's deadline (a read still queued then
        never starts: only a disk that does not answer counts)."""
        now = time.monotonic()
        with self._reads_lock:
            return sum(deadline <= now for deadline in self._reads.values())

    @property
    def is_stuck(self) -> bool:
        """Whether a read is still running past its load's deadline."""
        return self.num_stuck_reads() > 0

    def health(self) -> OffloadHealth:
        """Unhealthy while a read is still running past its load's deadline."""
        stuck = self.num_stuck_reads()
        if not stuck:
            return OffloadHealth()
        return OffloadHealth(False, (
            f"{stuck} read(s) under {self.files.root} still running past their "
            f"{self.read_timeout_s:g} s deadline (offload.options.read_timeout_s): the disk "
            "is stuck or far too slow; the engine runs without the tier until they return"))

    def close(self) -> None:
        """Finish every read and write, delete evicted files, close the directory.
        When a read is stuck, waits for nothing (pending writes are dropped)."""
        if self._closed:
            return
        self._closed = True
        if self.is_stuck:
            logger.warning("offload tier 'disk': closing without waiting: %s",
                           self.health().reason)
            self.io.shutdown(wait=False, cancel_futures=True)
            return  # (the stuck thread may still use the directory descriptor)
        self.io.shutdown(wait=True)
        self.poll()
        self.files.close()

    # -- writes -------------------------------------------------------------------

    def put(self, block_hash: bytes, data: torch.Tensor) -> Future | None:
        """Hold host block ``data`` (``[layers, parts, E]``, owned by the tier from now on)
        under ``block_hash`` and write it in the background; None when nothing is
        written (already held, or too much is waiting to be written)."""
        pending = self.writes.get(block_hash)
        if block_hash in self.policy:
            self.policy.touch(block_hash)
            return None
        if pending is None and (len(self.writes) + 1) * self.block_bytes > self.max_pending_bytes:
            self.num_dropped_writes += 1
            return None
        for victim in self.policy.insert(block_hash):
            self._evict(victim)  # type: ignore[arg-type]
        if pending is not None:  # evicted while being written, and wanted again
            pending.evicted = False
            return pending.future
        future = self.io.submit(self.files.write, block_hash, _payload(data))
        self.writes[block_hash] = PendingWrite(data, future)
        return future

    def _evict(self, block_hash: bytes) -> None:
        self.num_evictions += 1
        pending = self.writes.get(block_hash)
        if pending is not None:
            pending.evicted = True
        else:
            self.files.unlink(block_hash)

    def _reap_writes(self) -> None:
        for block_hash, pending in list(self.writes.items()):
            if not pending.future.done():
                continue
            del self.writes[block_hash]
            error = pending.future.exception()
            if pending.evicted:
                self.files.unlink(block_hash)
            elif error is not None:
                self.num_write_errors += 1
                self.policy.remove(block_hash)
                self.files.unlink(block_hash)
                logger.warning("offload tier 'disk': writing %s failed: %s",
                               self.files.path_of(block_hash), error)

    # -- reads --------------------------------------------------------------------

    def _read(self, block_hash: bytes, deadline: float) -> torch.Tensor:
        """(On an io thread.) ``block_hash``'s verified block, watched by :meth:`health`
        from when it starts until it returns."""
        me = threading.get_ident()
        with self._reads_lock:
            if time.monotonic() >= deadline:  # its load is (about to be) a miss
                raise TimeoutError("the load's deadline passed before this read started")
            self._reads[me] = deadline
        try:
            data = self.files.read(block_hash, self.block_bytes)
        finally:
            with self._reads_lock:
                del self._reads[me]
        block = torch.frombuffer(data, dtype=self.copier.dtype, offset=HEADER_SIZE)
        return block.view(self.copier.block_shape)

    def _expire_load(self, pending: PendingJob) -> None:
        """Fail a load past its deadline: reads not started are cancelled; the results
        of running ones are ignored, so nothing late reaches the device blocks, which
        the engine reuses."""
        self.num_read_timeouts += 1
        for future in pending.futures:
            future.cancel()
        logger.warning("offload tier 'disk': a load of %d block(s) did not finish within "
                       "%g s (offload.options.read_timeout_s); it is a miss, the engine "
                       "recomputes", len(pending.job.block_hashes), self.read_timeout_s)
        self.jobs.finish(pending.job, False)

    def _finish_load(self, pending: PendingJob) -> None:
        if any(isinstance(f.exception(), TimeoutError) for f in pending.futures):
            self._expire_load(pending)  # reads skipped after the deadline: files are fine
            return
        blocks: list[torch.Tensor] = []
        ok = True
        for block_hash, part in zip(pending.job.block_hashes, pending.parts, strict=True):
            if not isinstance(part, Future):
                blocks.append(part)
                continue
            error = part.exception()
            if error is None:
                blocks.append(part.result())
                continue
            ok = False
            self.num_bad_files += 1
            if block_hash not in self.writes:  # (not written again meanwhile)
                self.policy.remove(block_hash)
                self.files.unlink(block_hash)
            kind = "damaged" if isinstance(error, BadBlockFile) else "unreadable"
            logger.warning("offload tier 'disk': %s is %s (%s); dropped, the engine recomputes",
                           self.files.path_of(block_hash), kind, error)
        if not ok:
            self.jobs.finish(pending.job, False)
            return
        host = torch.stack(blocks)
        event = self.copier.scatter(host, list(range(len(blocks))), pending.job.block_ids)
        if event is not None:
            event.synchronize()
        self.jobs.finish(pending.job, True)


def _payload(data: torch.Tensor) -> memoryview:
    """The bytes of host block ``data`` (no copy)."""
    return memoryview(data.contiguous().view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]

"""The OffloadManager contract: a slower KV tier addressed by block content hash.

The engine drives a tier from two places (see ``docs/offload.md``):

* the **scheduler** asks :meth:`OffloadManager.lookup` at admission how much of a
  request's prefix the tier holds beyond the device prefix cache;
* the **model runner**, which owns the device KV cache, runs the step's transfers
  before the forward: first :meth:`~OffloadManager.store` of the blocks the device
  prefix cache evicted this step (their device blocks are reused by this very step),
  then :meth:`~OffloadManager.load` into freshly allocated device blocks (or, for
  blocks the tier holds in memory, :meth:`~OffloadManager.load_now`, so that the step's
  forward already reads them), and reports what :meth:`~OffloadManager.poll` says has
  finished.

Blocks are named by the chained content hashes of :mod:`lmkit.kv_cache.hashing`
(32 bytes, stable across processes and restarts), so equal hashes mean equal contents
and a tier may skip storing a hash it already holds.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from lmkit.config.schema import LMKitConfig

FINGERPRINT_VERSION = b"lmkit-kv-fingerprint-v1"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


@dataclass(frozen=True)
class TransferJob:
    """An asynchronous store or load: block hashes and the device block ids they map to."""

    job_id: int
    kind: str  # "store" | "load"
    block_hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class OffloadHealth:
    """Whether a tier works. ``healthy`` is False, with a ``reason`` for the log, while
    it is stuck (e.g. a disk read ran past its deadline and has not returned): the
    engine then reports itself unhealthy (``offload_unhealthy`` stat, ``/health``)."""

    healthy: bool = True
    reason: str = ""


class OffloadManager(ABC):
    """Stores KV blocks leaving the device cache and loads them back on a prefix hit.

    Constructor (the one signature the engine uses): ``cls(config, kv_caches, *,
    options)``. ``config`` is the engine's runtime configuration (``model.model`` is
    the resolved model directory and ``attention.backend`` the resolved backend name,
    so both can name a persistent store), ``kv_caches`` the per-layer device cache
    tensors in the layout of the built-in attention backends, ``[2, num_blocks,
    block_size, num_kv_heads, head_size]`` (block ``b`` of a layer is ``cache[:, b]``),
    or of the MLA backends, ``[num_blocks, block_size, width]`` (block ``b`` is
    ``cache[b]``; :func:`kv_block_axis` tells them apart), ``options`` the validated instance of the spec's options model.

    Ordering rules the engine relies on:

    * :meth:`store` must have *read* the device blocks before any work issued later on
      the device can overwrite them: copy synchronously, or (CUDA) copy on a side
      stream and make the current stream wait for that read before returning.
    * :meth:`store_computed` (write-through, optional) reads blocks that stay cached:
      the current stream need not wait; the engine calls :meth:`store` with a block
      (its eviction) or :meth:`fence` before anything can overwrite it.
    * :meth:`load` writes device blocks that the engine neither reads nor writes until
      :meth:`poll` reports the job; work issued earlier on the current stream (a
      store reading the same blocks) must happen before the load writes them.
    * A failed or corrupt load reports the job as failed (the engine then recomputes
      those tokens); it never reports success with wrong data.
    """

    @abstractmethod
    def lookup(self, block_hashes: Sequence[bytes]) -> int:
        """How many *leading* blocks of ``block_hashes`` this tier holds (stopping at the
        first it does not). The engine calls it when it is about to load, so a tier may
        count it as an access in its eviction order."""

    @abstractmethod
    def store(self, block_hashes: Sequence[bytes], block_ids: Sequence[int]) -> TransferJob:
        """Start copying device blocks ``block_ids`` out under ``block_hashes``.

        Storing more than fits evicts older entries instead of failing; hashes already
        held may be skipped (same hash, same contents)."""

    @abstractmethod
    def load(self, block_hashes: Sequence[bytes], block_ids: Sequence[int]) -> TransferJob:
        """Start copying held blocks into device blocks ``block_ids``; the job fails if
        any of them is missing or damaged."""

    @abstractmethod
    def poll(self) -> list[tuple[TransferJob, bool]]:
        """Finished jobs since the last poll, each with success (True) or failure;
        every job is reported exactly once."""

    @abstractmethod
    def usage(self) -> tuple[int, int]:
        """``(bytes_used, bytes_capacity)``."""

    def resident(self, block_hashes: Sequence[bytes]) -> int:
        """How many *leading* blocks of ``block_hashes`` :meth:`load_now` could load at
        once (held in memory the tier owns, no read that could fail). Records no access.
        Optional: the default, 0, means every load takes the asynchronous path."""
        return 0

    def load_now(self, block_hashes: Sequence[bytes], block_ids: Sequence[int],
                 after_store: TransferJob | None = None) -> TransferJob | None:
        """Load blocks that the engine's forward of this very step reads (a prefix hit
        computed in the step of its load). Optional; only called for blocks
        :meth:`resident` counted.

        ``after_store`` is the step's :meth:`store`, started just before this call with
        no work issued on the current stream in between (but the waits of earlier
        ``load_now`` calls), or None. A tier may then write each device block once that
        store has read it, instead of after all the store queued on the current stream.

        Returns None, having started nothing, when some block is no longer resident (a
        store since the lookup evicted it); the engine then recomputes. A returned job
        cannot fail, and work issued later on the current stream runs after the copy
        (CPU: it is complete; CUDA: the current stream waits for its event). :meth:`poll`
        reports the job as usual.
        """
        return None

    def store_computed(self, block_hashes: Sequence[bytes], block_ids: Sequence[int]
                       ) -> TransferJob | None:
        """Write-through: start copying device blocks ``block_ids`` out under
        ``block_hashes`` right after the forward that computed them, while they stay in
        the device prefix cache (the engine calls it after issuing the step's forward).

        Unlike :meth:`store`, the current stream need not wait for the read: the engine
        passes a block to :meth:`store` (its eviction, before the step that reuses it)
        or calls :meth:`fence` before any later work can overwrite it, and the tier
        orders that work after the read then (and a :meth:`load_now` into it after the
        read of those blocks). Hashes already held should be skipped.

        Optional: None (the default) means the tier does not store on computation, and
        blocks reach it when they are evicted."""
        return None

    def fence(self) -> None:  # noqa: B027 - optional
        """Make work issued later on the current stream wait until every
        :meth:`store_computed` so far has read its device blocks (the engine is about
        to reuse blocks without passing them to :meth:`store`, e.g. after a prefix-cache
        reset). Optional; nothing to do for a tier without :meth:`store_computed`."""

    def stats(self) -> dict[str, int]:
        """Tier-internal counters, e.g. ``{"evictions": n}`` (blocks the tier dropped to
        make room); the engine adds them to its ``offload_*`` stats. Optional."""
        return {}

    def health(self) -> OffloadHealth:
        """Whether the tier works (see :class:`OffloadHealth`); called with the stats.
        A tier whose loads can stall (a disk, a network) must bound them in time: a
        load past its deadline is reported failed by :meth:`poll` (a miss), and the
        tier unhealthy while the stalled I/O has not returned. Optional: the default
        is always healthy."""
        return OffloadHealth()

    def close(self) -> None:  # noqa: B027 - optional
        """Finish pending writes, release memory and file handles. Safe to call twice."""


def kv_cache_fingerprint(config: LMKitConfig, kv_caches: Sequence[torch.Tensor]) -> bytes:
    """32 bytes naming the model and the KV layout, for tiers that persist blocks.

    Two engines get the same fingerprint when they run the same model files (the
    directory, its ``config.json``, and the name, size and modification time of each
    weight file) with the same attention backend, block size, dtype and per-layer
    block shape; the device pool size does not count. Blocks stored under one
    fingerprint must never be loaded under another. With a draft head
    (``speculative.model``), whose KV blocks the tier carries beside the target's, the
    head's files count too.
    """
    h = hashlib.blake2b(FINGERPRINT_VERSION, digest_size=32)

    def add(*parts: object) -> None:
        for part in parts:
            raw = part if isinstance(part, bytes) else str(part).encode()
            h.update(len(raw).to_bytes(8, "little") + raw)

    def add_files(model: Path) -> None:
        if model.is_dir():
            config_json = model / "config.json"
            add(config_json.read_bytes() if config_json.is_file() else b"")
            for f in sorted(model.iterdir()):
                if f.suffix in WEIGHT_SUFFIXES and f.is_file():
                    st = f.stat()
                    add(f.name, st.st_size, st.st_mtime_ns)
        elif model.is_file():
            st = model.stat()
            add(st.st_size, st.st_mtime_ns)

    model = Path(str(config.model.model))
    add("model", model)
    add_files(model)
    if config.speculative.model is not None:  # a draft head's KV rides with the target's
        head = Path(config.speculative.model)
        add("draft head", config.speculative.backend, head)
        add_files(head)
    add("attention", config.attention.backend, "block_size", config.cache.block_size)
    add("layers", len(kv_caches))
    for cache in kv_caches:
        # every dimension but the pool size
        axis = kv_block_axis(cache.shape)
        add(str(cache.dtype), tuple(cache.shape[:axis]) + tuple(cache.shape[axis + 1:]))
    return h.digest()


def kv_block_axis(shape: Sequence[int]) -> int:
    """The axis of a per-layer KV cache shape that indexes blocks: 1 for the K/V layout
    ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (4 or more dimensions,
    the first 2), 0 for the MLA latent layout ``[num_blocks, block_size, width]``
    (3 dimensions; :class:`~lmkit.api.MLAAttentionBackend`).

    :raises ValueError: a shape in neither layout.
    """
    if len(shape) == 3:
        return 0
    if len(shape) >= 4 and shape[0] == 2:
        return 1
    raise ValueError(f"KV cache shape {tuple(shape)} is in neither offloadable layout: "
                     "[2, num_blocks, block_size, num_kv_heads, head_size] (K/V) or "
                     "[num_blocks, block_size, width] (MLA latent)")

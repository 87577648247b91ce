"""Moving whole KV blocks between the device caches and host memory.

A *host block* is one block of every layer, contiguous: ``[num_layers, parts,
block_elems]``, so that one block is one copy and one file. For the K/V layout
``[2, num_blocks, block_size, num_kv_heads, head_size]`` a layer's block has two parts
(K then V, ``block_elems = block_size * num_kv_heads * head_size``); for the MLA latent
layout ``[num_blocks, block_size, width]`` one (``block_size * width``); see
:func:`lmkit.api.offload.kv_block_axis`. Tiers keep host blocks as rows of a tensor
``[rows, num_layers, parts, block_elems]``.

On CUDA the copies run on the copier's own streams, one for stores and one for loads
(so that both directions of the bus are busy at once), each through its own device
staging buffer: a store gathers the blocks into staging with one indexed copy per
layer, then copies staging to the (page-locked) host rows; a load does the reverse.
After a store, the current stream waits only for the gather of its last chunk (the
device blocks may be overwritten once read), not for the host copies.

A job larger than the staging buffer is copied in chunks, so a store's last gather
comes after the host copies of its earlier chunks. A load issued right after a store
(``after=`` the store's :class:`StoreReads`) therefore does not wait for the whole
store: it copies host rows into staging at once, and before writing each chunk of
device blocks waits only for the gathers of the store chunks that read those blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lmkit.api.offload import kv_block_axis

DEFAULT_STAGING_BYTES = 256 * 2**20  # per direction


def runs(rows: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive ``rows``: ``(first index, first row, length)``."""
    out: list[tuple[int, int, int]] = []
    for i, row in enumerate(rows):
        if out and out[-1][1] + out[-1][2] == row:
            first, start, length = out[-1]
            out[-1] = (first, start, length + 1)
        else:
            out.append((i, row, 1))
    return out


@dataclass
class StoreReads:
    """When a CUDA store read its device blocks: ``before``, an event of the current
    stream just before the store was issued; ``chunks``, per staging chunk the device
    block ids it gathered and the event recorded once they were read."""

    before: Any
    chunks: list[tuple[frozenset[int], Any]] = field(default_factory=list)


class BlockCopier:
    """Copies blocks of ``kv_caches`` (each ``[2, num_blocks, ...]``, or the latent
    ``[num_blocks, block_size, width]``) to and from host rows.

    Args:
        kv_caches: the per-layer device caches.
        staging_bytes: CUDA only, the device staging buffer of each direction (a job
            larger than it is copied in chunks).
    """

    def __init__(self, kv_caches: Sequence[torch.Tensor],
                 staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        if not kv_caches:
            raise ValueError("an offload tier needs at least one KV cache tensor")
        first = kv_caches[0]
        for cache in kv_caches:
            if (cache.shape != first.shape or cache.dtype != first.dtype
                    or cache.device != first.device or cache.dim() < 3
                    or not cache.is_contiguous()):
                raise ValueError(
                    "offload tiers need contiguous per-layer KV caches of one shape and dtype, "
                    f"laid out [2, num_blocks, ...] or [num_blocks, block_size, width]; got "
                    f"{tuple(cache.shape)} {cache.dtype}")
        axis = kv_block_axis(first.shape)
        self.num_blocks = int(first.shape[axis])
        self.parts = 2 if axis == 1 else 1  # K and V, or one latent entry
        if first.element_size() == 1:  # an FP8 cache: copied as its bytes (torch has no
            kv_caches = [c.view(torch.uint8) for c in kv_caches]  # CPU index_copy_ for float8)
            first = kv_caches[0]
        # [parts, blocks, E]
        self.caches = [c.view(self.parts, self.num_blocks, -1) for c in kv_caches]
        self.block_elems = int(self.caches[0].shape[2])
        self.block_shape = (len(self.caches), self.parts, self.block_elems)
        self.dtype = first.dtype
        self.device = first.device
        self.block_bytes = len(self.caches) * self.parts * self.block_elems * first.element_size()
        self.is_cuda = self.device.type == "cuda"
        cuda = self.is_cuda
        self.store_stream: Any = torch.cuda.Stream(self.device) if cuda else None
        self.load_stream: Any = torch.cuda.Stream(self.device) if cuda else None
        self.staging_rows = max(1, staging_bytes // self.block_bytes)
        self._staging: dict[str, torch.Tensor] = {}
        self.last_reads: StoreReads | None = None  # of the latest gather (CUDA)
        self._pending_reads: dict[int, Any] = {}  # device block -> deferred read's event

    def host_rows(self, num_rows: int, pin: bool = False) -> torch.Tensor:
        """A new host tensor of ``num_rows`` blocks: ``[num_rows, layers, 2, E]``."""
        return torch.empty((num_rows, *self.block_shape), dtype=self.dtype, pin_memory=pin)

    # -- device -> host -----------------------------------------------------------

    def gather(self, block_ids: Sequence[int], host: torch.Tensor, rows: Sequence[int],
               wait_for: Sequence[Any] = (), deferred: bool = False) -> Any:
        """Copy device blocks ``block_ids`` into ``host[rows]``, after the CUDA events
        ``wait_for`` (loads still reading those host rows).

        Returns None when the copy is complete (CPU), else a CUDA event recorded after
        it; either way later work on the current stream cannot overwrite the blocks
        before they were read. On CUDA, :attr:`last_reads` tells when each was read.
        ``deferred`` (CUDA, write-through of blocks that stay cached): the current
        stream does not wait; the reads are kept per block until :meth:`take_reads`
        or :meth:`fence` orders the current stream after them.
        """
        self.last_reads = None
        if not block_ids:
            return None
        if not self.is_cuda:
            ids = torch.tensor(block_ids, dtype=torch.long)
            index = torch.tensor(rows, dtype=torch.long)
            for layer, cache in enumerate(self.caches):
                for kv in range(self.parts):  # host[:, layer, kv]: [rows, E], strided
                    host[:, layer, kv].index_copy_(0, index, cache[kv].index_select(0, ids))
            return None
        current = torch.cuda.current_stream(self.device)
        stream = self.store_stream
        reads = StoreReads(torch.cuda.Event())
        reads.before.record(current)
        with torch.cuda.stream(stream):
            stream.wait_event(reads.before)  # the blocks' last writes come first
            for event in wait_for:
                stream.wait_event(event)
            ids = torch.tensor(block_ids, dtype=torch.long).to(self.device, non_blocking=True)
            staging = self._staging_buffer("store")
            for start in range(0, len(block_ids), self.staging_rows):
                chunk = ids[start:start + self.staging_rows]
                n = chunk.numel()
                for layer, cache in enumerate(self.caches):
                    staging[:n, layer].copy_(cache.index_select(1, chunk).transpose(0, 1))
                read = torch.cuda.Event()
                read.record(stream)
                reads.chunks.append((frozenset(block_ids[start:start + n]), read))
                for i, row, length in runs(rows[start:start + n]):
                    host[row:row + length].copy_(staging[i:i + length], non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        if deferred:
            for blocks, read in reads.chunks:
                for block_id in blocks:
                    self._pending_reads[block_id] = read
        else:  # the forward may overwrite the blocks once read
            current.wait_event(reads.chunks[-1][1])
        self.last_reads = reads
        return done

    def take_reads(self, block_ids: Sequence[int]) -> list[tuple[frozenset[int], Any]]:
        """The unfinished deferred reads (see :meth:`gather`) of ``block_ids``, which
        the caller now orders later work after: ``(block ids, event)`` per event."""
        if not self._pending_reads:
            return []
        by_event: dict[int, tuple[set[int], Any]] = {}
        for block_id in block_ids:
            read = self._pending_reads.pop(block_id, None)
            if read is not None and not read.query():
                by_event.setdefault(id(read), (set(), read))[0].add(block_id)
        return [(frozenset(ids), read) for ids, read in by_event.values()]

    def fence(self) -> None:
        """Make later work on the current stream wait for every deferred read."""
        if self._pending_reads:
            current = torch.cuda.current_stream(self.device)
            for read in {id(r): r for r in self._pending_reads.values()}.values():
                current.wait_event(read)
            self._pending_reads.clear()

    # -- host -> device -----------------------------------------------------------

    def scatter(self, host: torch.Tensor, rows: Sequence[int], block_ids: Sequence[int],
                wait_for: Sequence[Any] = (), after: StoreReads | None = None) -> Any:
        """Copy ``host[rows]`` into device blocks ``block_ids``, after the CUDA events
        ``wait_for`` (stores still writing those host rows).

        Returns None when complete (CPU), else a CUDA event to wait for. Work already
        issued on the current stream (stores reading these blocks) happens first; or,
        with ``after`` (the reads of a store issued right before, with nothing issued
        on the current stream since), work issued before that store, and each device
        block is written once that store read it.
        """
        if not block_ids:
            return None
        if not self.is_cuda:
            ids = torch.tensor(block_ids, dtype=torch.long)
            index = torch.tensor(rows, dtype=torch.long)
            for layer, cache in enumerate(self.caches):
                for kv in range(self.parts):
                    cache[kv].index_copy_(0, ids, host[:, layer, kv].index_select(0, index))
            return None
        current = torch.cuda.current_stream(self.device)
        stream = self.load_stream
        with torch.cuda.stream(stream):
            if after is None:
                # after the compute stream's work so far, which includes waiting for the
                # reads of the stores issued before (a load may target a just-evicted block)
                stream.wait_stream(current)
            else:
                stream.wait_event(after.before)
            for event in wait_for:
                stream.wait_event(event)
            ids = torch.tensor(block_ids, dtype=torch.long).to(self.device, non_blocking=True)
            staging = self._staging_buffer("load")
            pending = list(after.chunks) if after is not None else []
            for start in range(0, len(block_ids), self.staging_rows):
                chunk = ids[start:start + self.staging_rows]
                n = chunk.numel()
                for i, row, length in runs(rows[start:start + n]):
                    staging[i:i + length].copy_(host[row:row + length], non_blocking=True)
                targets = set(block_ids[start:start + n])
                for read in [r for r in pending if r[0] & targets]:  # store reads first
                    stream.wait_event(read[1])
                    pending.remove(read)
                for layer, cache in enumerate(self.caches):
                    cache.index_copy_(1, chunk, staging[:n, layer].transpose(0, 1))
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def current_waits_for(self, event: Any) -> None:
        """Make work issued later on the current stream wait for ``event`` (a copy's, from
        :meth:`gather` or :meth:`scatter`); nothing for None (a complete copy)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def _staging_buffer(self, direction: str) -> torch.Tensor:
        """The staging buffer of ``direction`` (allocated on its stream, first use)."""
        if direction not in self._staging:
            self._staging[direction] = torch.empty(
                (self.staging_rows, *self.block_shape), dtype=self.dtype, device=self.device)
        return self._staging[direction]

    def synchronize(self) -> None:
        """Wait for every copy issued so far."""
        for stream in (self.store_stream, self.load_stream):
            if stream is not None:
                stream.synchronize()

"""The OffloadManager contract: a slower KV tier addressed by block content hash."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TransferJob:
    """An asynchronous store or load: block hashes and the device block ids they map to."""

    job_id: int
    kind: str  # "store" | "load"
    block_hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]


class OffloadManager(ABC):
    """Stores KV blocks leaving the device cache and loads them back on a prefix hit.

    Constructed as ``cls(config, kv_caches, options=opts)`` where ``kv_caches`` are the
    per-layer device cache tensors. A failed or corrupt load must report the job as
    failed (the engine then recomputes), never hand back wrong data.
    """

    @abstractmethod
    def lookup(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``block_hashes`` this tier holds."""

    @abstractmethod
    def store(self, block_hashes: Sequence[bytes], block_ids: Sequence[int]) -> TransferJob:
        """Start copying device blocks ``block_ids`` out under ``block_hashes``."""

    @abstractmethod
    def load(self, block_hashes: Sequence[bytes], block_ids: Sequence[int]) -> TransferJob:
        """Start copying held blocks into device blocks ``block_ids``."""

    @abstractmethod
    def poll(self) -> list[tuple[TransferJob, bool]]:
        """Finished jobs since the last poll, each with success (True) or failure."""

    @abstractmethod
    def usage(self) -> tuple[int, int]:
        """``(bytes_used, bytes_capacity)``."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release memory and file handles."""


def kv_layer_tensors(kv_caches: Sequence[torch.Tensor]) -> int:
    """Number of layers (helper for implementations sizing their buffers)."""
    return len(kv_caches)

"""Options of the built-in offload tiers (``offload.options``), validated at startup."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


def default_disk_path() -> str:
    """``$LMKIT_CACHE/kv-offload``, else ``$XDG_CACHE_HOME/lmkit/kv-offload``, else
    ``~/.cache/lmkit/kv-offload``."""
    if os.environ.get("LMKIT_CACHE"):
        return str(Path(os.environ["LMKIT_CACHE"]) / "kv-offload")
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "lmkit" / "kv-offload")


Eviction = Literal["lru", "arc"]
READ_TIMEOUT_S = 10.0


class CPUTierOptions(BaseModel):
    """``cpu``: a host memory pool."""

    model_config = ConfigDict(extra="forbid")

    size_gb: float = Field(4.0, gt=0, description="Host memory for KV blocks, in GiB.")
    eviction: Eviction = Field("lru", description="'lru', or 'arc' (adaptive, scan-resistant).")
    pin_memory: bool | None = Field(
        None, description="Page-lock the pool (fast asynchronous copies); default: on with CUDA.")


class DiskTierOptions(BaseModel):
    """``disk``: a directory of block files."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(default_factory=default_disk_path, description="Cache root; blocks "
                      "live in a subdirectory per model and KV layout.")
    size_gb: float = Field(32.0, gt=0, description="Disk space for KV blocks, in GiB.")
    eviction: Eviction = Field("lru", description="'lru' or 'arc'.")
    io_threads: int = Field(4, ge=1, le=64, description="Threads reading and writing files.")
    max_pending_write_gb: float = Field(
        1.0, gt=0, description="Host memory for blocks waiting to be written; past it, "
        "new blocks are not written (never blocks the engine).")
    read_timeout_s: float = Field(
        READ_TIMEOUT_S, gt=0, description="Time a load's reads may take; past it the load is "
        "a miss (recomputed) and, while a read is still running, the tier is unhealthy.")
    key_file: str | None = Field(
        None, description="File (mode 0600, outside `path`) holding the key that "
        "authenticates block files; default: $LMKIT_OFFLOAD_KEY, else a random key per "
        "process.")


class CPUDiskTierOptions(BaseModel):
    """``cpu+disk``: the host pool, spilling its evictions to the directory."""

    model_config = ConfigDict(extra="forbid")

    cpu_size_gb: float = Field(4.0, gt=0, description="Host memory for KV blocks, in GiB.")
    disk_size_gb: float = Field(32.0, gt=0, description="Disk space for KV blocks, in GiB.")
    path: str = Field(default_factory=default_disk_path, description="The disk tier's root.")
    eviction: Eviction = Field("lru", description="Eviction policy of both levels.")
    pin_memory: bool | None = Field(None, description="Page-lock the host pool.")
    io_threads: int = Field(4, ge=1, le=64, description="Threads reading and writing files.")
    max_pending_write_gb: float = Field(1.0, gt=0, description="See the disk tier.")
    read_timeout_s: float = Field(READ_TIMEOUT_S, gt=0, description="See the disk tier.")
    key_file: str | None = Field(None, description="See the disk tier.")

    def cpu(self) -> CPUTierOptions:
        """The options of the host level."""
        return CPUTierOptions(size_gb=self.cpu_size_gb, eviction=self.eviction,
                              pin_memory=self.pin_memory)

    def disk(self) -> DiskTierOptions:
        """The options of the disk level."""
        return DiskTierOptions(path=self.path, size_gb=self.disk_size_gb, eviction=self.eviction,
                               io_threads=self.io_threads,
                               max_pending_write_gb=self.max_pending_write_gb,
                               read_timeout_s=self.read_timeout_s, key_file=self.key_file)

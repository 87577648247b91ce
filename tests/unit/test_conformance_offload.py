"""The offload conformance suite against a small in-memory tier with checksums: it
passes (including corrupt entries, through the pytest base class); tiers with wrong
lookup semantics, no capacity limit, fake successful loads or no integrity check fail."""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict

import pytest
import torch
from lmkit.api import OffloadManager, Spec, TransferJob
from lmkit.testing import ConformanceFailure
from lmkit.testing.offload import OffloadConformance, check_offload_manager
from pydantic import BaseModel, ConfigDict


class TierOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    capacity_blocks: int = 16


class MemoryTier(OffloadManager):
    """Synchronous LRU tier: entries are (per-layer bytes, sha256)."""

    verify = True

    def __init__(self, config, kv_caches, options=None):
        self.kv_caches = kv_caches
        self.capacity_blocks = options.capacity_blocks if options else 16
        self.block_bytes = sum(c[:, 0].numel() * c.element_size() for c in kv_caches)
        self.entries: OrderedDict[bytes, tuple[list[torch.Tensor], bytes]] = OrderedDict()
        self.done: list[tuple[TransferJob, bool]] = []
        self.ids = itertools.count()

    def lookup(self, block_hashes):
        n = 0
        for h in block_hashes:
            if h not in self.entries:
                break
            n += 1
        return n

    def store(self, block_hashes, block_ids):
        job = TransferJob(next(self.ids), "store", tuple(block_hashes), tuple(block_ids))
        for h, b in zip(block_hashes, block_ids, strict=True):
            data = [c[:, b].clone() for c in self.kv_caches]
            self.entries[h] = (data, self._digest(data))
            self.entries.move_to_end(h)
            while len(self.entries) > self.capacity_blocks:
                self.entries.popitem(last=False)
        self.done.append((job, True))
        return job

    def load(self, block_hashes, block_ids):
        job = TransferJob(next(self.ids), "load", tuple(block_hashes), tuple(block_ids))
        ok = all(h in self.entries for h in block_hashes)
        if ok and self.verify:
            ok = all(self._digest(self.entries[h][0]) == self.entries[h][1] for h in block_hashes)
        if ok:
            for h, b in zip(block_hashes, block_ids, strict=True):
                for cache, data in zip(self.kv_caches, self.entries[h][0], strict=True):
                    cache[:, b] = data
        self.done.append((job, ok))
        return job

    def poll(self):
        done, self.done = self.done, []
        return done

    def usage(self):
        return len(self.entries) * self.block_bytes, self.capacity_blocks * self.block_bytes

    @staticmethod
    def _digest(data):
        return hashlib.sha256(b"".join(d.view(torch.uint8).numpy().tobytes() for d in data)).digest()


def corrupt(manager, block_hash):
    manager.entries[block_hash][0][0].view(torch.uint8)[0, 0, 0, 0] ^= 0xFF


class TestMemoryTier(OffloadConformance):
    @pytest.fixture
    def offload_manager(self):
        return Spec(name="memory", target=lambda: MemoryTier, options=TierOptions), {
            "capacity_blocks": 24}

    def corrupt(self, manager, block_hash):
        corrupt(manager, block_hash)


class AnyPrefixLookup(MemoryTier):
    def lookup(self, block_hashes):
        return sum(h in self.entries for h in block_hashes)


class Unbounded(MemoryTier):
    def usage(self):
        return len(self.entries) * self.block_bytes, 16 * self.block_bytes

    def store(self, block_hashes, block_ids):
        self.capacity_blocks = 10**6
        return super().store(block_hashes, block_ids)


class FakeSuccess(MemoryTier):
    def load(self, block_hashes, block_ids):
        job = super().load([h for h in block_hashes if h in self.entries],
                           [b for h, b in zip(block_hashes, block_ids, strict=True)
                            if h in self.entries])
        self.done[-1] = (TransferJob(job.job_id, "load", tuple(block_hashes), tuple(block_ids)),
                         True)
        return self.done[-1][0]


class NoChecksum(MemoryTier):
    verify = False


def fails(cls, prop: str) -> str:
    spec = Spec(name=cls.__name__, target=lambda: cls, options=TierOptions)
    with pytest.raises(ConformanceFailure) as exc:
        check_offload_manager(spec, corrupt=corrupt, only=[prop])
    return str(exc.value)


def test_failures_name_the_property_and_input():
    msg = fails(AnyPrefixLookup, "lookup")
    assert "h0-h3 stored; lookup([h0, h1, unknown, h2])" in msg
    assert "returned 3; the number of leading hashes held is 2" in msg
    assert "usage() is 49152 bytes of 32768" in fails(Unbounded, "capacity")
    assert "load of a hash never stored" in fails(FakeSuccess, "failed loads")
    assert "reported success with different bits" in fails(NoChecksum, "corrupt entries")


def test_corrupt_entries_need_a_hook():
    spec = Spec(name="memory", target=lambda: MemoryTier, options=TierOptions)
    results = check_offload_manager(spec)
    assert results["corrupt entries"].startswith("not applicable: no corrupt hook")
    assert results["round trip bit-exact"] == "passed"

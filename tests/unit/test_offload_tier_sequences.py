"""The ``cpu`` tier's copy sequences of tests/gpu/test_offload_gpu.py, on CPU tensors:
stores and loads back to back reusing device blocks, and host slots reused across
directions (on CPU every copy is synchronous, so these check the bookkeeping: which
slot holds which hash, what a store evicts, what a load finds)."""

from __future__ import annotations

import hashlib

import torch
from lmkit.config.schema import LMKitConfig
from lmkit_plugins.offload.cpu_tier import CPUTier
from lmkit_plugins.offload.options import CPUTierOptions

LAYERS, BLOCKS = 2, 160
SHAPE = (2, BLOCKS, 4, 2, 8)  # [2, blocks, tokens, KV heads, head size]
BLOCK_BYTES = LAYERS * 2 * 4 * 2 * 8 * 4  # float32


def h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def caches(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=gen) for _ in range(LAYERS)]


def tier_of(kv, num_slots: int) -> CPUTier:
    tier = CPUTier(LMKitConfig(), kv, CPUTierOptions(size_gb=num_slots * BLOCK_BYTES / 2**30))
    assert tier.num_slots == num_slots
    return tier


def finished(tier: CPUTier) -> dict[int, bool]:
    return {job.job_id: ok for job, ok in tier.poll()}


def test_many_interleaved_jobs_stay_ordered():
    kv = caches(1)
    tier = tier_of(kv, 1024)
    expected = {}

    def ids_of(round_: int) -> list[int]:  # rounds 0, 4, 8 reuse blocks 1-32, ...
        return list(range(1 + (round_ % 4) * 32, 1 + (round_ % 4) * 32 + 32))

    for round_ in range(12):
        ids = ids_of(round_)
        for cache in kv:
            cache[:, ids] = float(round_)
        expected[round_] = [c[:, ids].clone() for c in kv]
        tier.store([h(1000 * round_ + i) for i in ids], ids)
    for round_ in range(12):
        job = tier.load([h(1000 * round_ + i) for i in ids_of(round_)], list(range(128, 160)))
        assert finished(tier)[job.job_id]
        for cache, want in zip(kv, expected[round_], strict=True):
            assert torch.equal(cache[:, 128:160], want)


def test_host_slots_reused_across_directions():
    kv = caches(2)
    tier = tier_of(kv, 64)  # storing 64 new blocks evicts everything held
    ids = list(range(1, 65))
    want = [c[:, ids].clone() for c in kv]
    tier.store([h(i) for i in ids], ids)
    load = tier.load([h(i) for i in ids], list(range(80, 144)))
    for cache in kv:
        cache[:, ids] += 1.0
    tier.store([h(1000 + i) for i in ids], ids)
    assert finished(tier)[load.job_id]
    for cache, w in zip(kv, want, strict=True):
        assert torch.equal(cache[:, 80:144], w)
    assert tier.lookup([h(1000 + i) for i in ids]) == 64 and tier.lookup([h(1)]) == 0
    assert tier.stats()["evictions"] == 64
    job = tier.load([h(1000 + i) for i in ids], list(range(80, 144)))  # the new contents
    assert finished(tier)[job.job_id]
    for cache, w in zip(kv, want, strict=True):
        assert torch.equal(cache[:, 80:144], w + 1.0)


def test_store_larger_than_the_pool_keeps_the_last_blocks():
    kv = caches(3)
    tier = tier_of(kv, 8)
    ids = list(range(1, 21))
    tier.store([h(i) for i in ids], ids)
    assert tier.lookup([h(i) for i in ids[-8:]]) == 8 and tier.lookup([h(12)]) == 0
    assert tier.resident([h(i) for i in ids[-8:]] + [h(1)]) == 8

"""The scheduler side of KV offload, against the fake paged runner of lmkit.testing.

A fake tier keeps copies of fake KV blocks by hash. The runner executes each step's
transfers as the contract says a real one may: a store reads the blocks at once; a
load scribbles over its destination blocks at once and writes the real contents only
when it completes, a few steps later (or never, when it fails). A same-step load (a
resident tier) completes before the step's forward, or fails leaving the scribbles.
A block handed out while its load is in flight, or a failed load whose blocks were
trusted, therefore shows up as a wrong token against the reference outputs.
"""

from __future__ import annotations

import random
from collections import OrderedDict

from lmkit.api.request import Request, RequestStatus
from lmkit.api.sampling_params import SamplingParams
from lmkit.api.scheduler import PrefixTier, SchedulerContext
from lmkit.kv_cache.hashing import update_block_hashes
from lmkit.kv_cache.manager import KVCacheManager
from lmkit.offload.coordinator import LOAD_FAILED, OffloadCoordinator
from lmkit.scheduler.paged import PagedScheduler
from lmkit.testing.fake_runner import FakeRunner, reference_output
from test_scheduler_fakes import make_config

GARBAGE = -7


class FakeTier(PrefixTier):
    """Copies of fake KV blocks by hash, LRU, at most ``capacity``; a ``resident`` tier
    offers same-step loads. The scheduler's prefix tier (``SchedulerContext``)."""

    def __init__(self, capacity: int = 10**9, resident: bool = False) -> None:
        self.blocks: OrderedDict[bytes, list] = OrderedDict()
        self.capacity = capacity
        self.resident = resident

    def lookup(self, hashes) -> tuple[int, int]:
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            self.blocks.move_to_end(h)
            n += 1
        return n, (n if self.resident else 0)


class OffloadingRunner(FakeRunner):
    """The fake runner plus a tier: stores at once, loads complete ``delay`` steps later
    and fail with probability ``fail_rate``."""

    def __init__(self, num_blocks, block_size, tier, rng, fail_rate=0.0, max_delay=0):
        super().__init__(num_blocks, block_size)
        self.tier, self.rng = tier, rng
        self.fail_rate, self.max_delay = fail_rate, max_delay
        self.in_flight: list[list] = []  # [steps left, transfer id, data, ids, ok]
        self.num_loads = self.num_failed = self.num_same_step = 0

    def execute(self, so):
        t = so.kv_transfers
        if t:
            for h, b in zip(t.store_hashes, t.store_block_ids, strict=True):
                assert None not in self.kv[b] and GARBAGE not in self.kv[b], "stored a bad block"
                self.tier.blocks[h] = list(self.kv[b])
                while len(self.tier.blocks) > self.tier.capacity:
                    self.tier.blocks.popitem(last=False)
            for load in t.loads:
                ok = (self.rng.random() >= self.fail_rate
                      and all(h in self.tier.blocks for h in load.block_hashes))
                for b in load.block_ids:
                    self.kv[b] = [GARBAGE] * self.block_size  # a copy in progress
                data = [list(self.tier.blocks[h]) for h in load.block_hashes] if ok else None
                delay = 0 if load.same_step else self.rng.randint(0, self.max_delay)
                self.num_same_step += load.same_step
                if load.same_step and ok:  # done before the forward
                    for block, b in zip(data, load.block_ids, strict=True):
                        self.kv[b] = block
                self.in_flight.append([delay, load.transfer_id, data, load.block_ids, ok])
        out = super().execute(so)
        still = []
        for entry in self.in_flight:
            left, transfer_id, data, ids, ok = entry
            if left > 0:
                entry[0] -= 1
                still.append(entry)
                continue
            if ok:
                for block, b in zip(data, ids, strict=True):
                    self.kv[b] = block
            self.num_loads += 1
            self.num_failed += not ok
            out.finished_kv_loads[transfer_id] = ok
        self.in_flight = still
        return out


def make_request(rid: str, prompt: list[int], max_tokens: int = 4, **params) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, **params))


def offloading_scheduler(config, num_blocks: int, tier: FakeTier
                         ) -> tuple[PagedScheduler, OffloadCoordinator]:
    """A scheduler given ``tier`` as its prefix tier, and the coordinator it built."""
    sched = PagedScheduler(config, num_blocks=num_blocks,
                           context=SchedulerContext(prefix_tier=tier))
    assert sched.offload is not None
    return sched, sched.offload


def fill_cache(manager: KVCacheManager, prompt: list[int]) -> Request:
    """Compute ``prompt`` into the pool, then free it: its full blocks stay cached."""
    req = make_request("fill", prompt)
    manager.allocate_slots(req, len(prompt))
    req.num_computed_tokens = len(prompt)
    manager.free(req)
    return req


def test_evicted_cached_blocks_become_stores():
    manager = KVCacheManager(num_blocks=6, block_size=4)
    coordinator = OffloadCoordinator(manager, lambda hashes: 0)
    filled = fill_cache(manager, list(range(10)))  # 2 full blocks cached, 1 partial
    cached = {manager.block_pool.get_cached_block(h).block_id: h for h in filled.block_hashes}
    manager.block_pool.get_new_blocks(5)  # takes every free block
    t = coordinator.take_transfers()
    assert dict(zip(t.store_block_ids, t.store_hashes, strict=True)) == cached
    assert coordinator.take_transfers() is None  # handed over once


def test_admission_loads_past_the_device_hit_then_registers():
    manager = KVCacheManager(num_blocks=12, block_size=4)
    tier = FakeTier()
    coordinator = OffloadCoordinator(manager, tier.lookup)
    prompt = list(range(17))
    filled = fill_cache(manager, prompt[:8])  # device holds blocks 0-1
    hashes = [*filled.block_hashes]
    req = make_request("r", prompt)
    all_hashes = update_block_hashes(req, 4)
    tier.blocks.update({h: [0] * 4 for h in all_hashes[2:4]})  # tier holds blocks 2-3
    free_before = manager.num_free_blocks
    assert coordinator.defer_admission(req)
    (load,) = coordinator.take_transfers().loads
    assert load.block_hashes == all_hashes[2:4]
    hits = [manager.block_pool.get_cached_block(h) for h in hashes]
    assert all(b.ref_cnt == 1 for b in hits), "device hits are held while loading"
    assert manager.num_free_blocks == free_before - 4
    assert coordinator.defer_admission(req) and coordinator.take_transfers() is None
    coordinator.on_loads_finished({load.transfer_id: True})
    assert manager.num_free_blocks == free_before
    blocks, num_tokens = manager.get_computed_blocks(req)
    assert num_tokens == 16 and [b.block_id for b in blocks[2:]] == load.block_ids
    assert not coordinator.defer_admission(req)  # nothing left to load


def test_failed_load_registers_nothing_and_is_not_retried():
    manager = KVCacheManager(num_blocks=12, block_size=4)
    tier = FakeTier()
    coordinator = OffloadCoordinator(manager, tier.lookup)
    req = make_request("r", list(range(13)))
    tier.blocks.update({h: [0] * 4 for h in update_block_hashes(req, 4)})
    free_before = manager.num_free_blocks
    assert coordinator.defer_admission(req)
    (load,) = coordinator.take_transfers().loads
    coordinator.on_loads_finished({load.transfer_id: False})
    assert manager.num_free_blocks == free_before
    assert manager.get_computed_blocks(req) == ([], 0)
    assert req.extra[LOAD_FAILED] and not coordinator.defer_admission(req)
    assert coordinator.stats()["offload_failed_loads"] == 1


def test_load_waits_for_room_in_the_pool():
    manager = KVCacheManager(num_blocks=6, block_size=4)  # 5 usable blocks
    coordinator = OffloadCoordinator(manager, lambda hashes: len(hashes))
    other = make_request("other", list(range(100, 112)))
    manager.allocate_slots(other, 12)  # holds 3 blocks
    req = make_request("r", list(range(17)))  # the tier holds its 4 full blocks
    assert coordinator.defer_admission(req) and coordinator.take_transfers() is None
    manager.free(other)
    assert coordinator.defer_admission(req)
    (load,) = coordinator.take_transfers().loads
    assert len(load.block_ids) == 4


def test_prompt_logprobs_requests_skip_the_tier():
    manager = KVCacheManager(num_blocks=12, block_size=4)
    asked = []
    coordinator = OffloadCoordinator(manager, lambda hashes: asked.append(hashes) or len(hashes))
    assert not coordinator.defer_admission(make_request("r", list(range(13)), prompt_logprobs=1))
    assert asked == []


def test_aborted_while_loading_releases_blocks_when_the_load_finishes():
    tier = FakeTier()
    sched, coordinator = offloading_scheduler(make_config(block_size=4), 16, tier)
    req = make_request("r", list(range(13)))
    tier.blocks.update({h: [0] * 4 for h in update_block_hashes(req, 4)})
    sched.add_request(req)
    so = sched.schedule()
    assert so.is_empty and len(so.kv_transfers.loads) == 1
    sched.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert coordinator.has_pending_loads
    (load,) = so.kv_transfers.loads
    coordinator.on_loads_finished({load.transfer_id: True})
    assert not coordinator.has_pending_loads
    assert sched.kv_cache_manager.num_free_blocks == 15  # all back; loaded ones cached


def run_workload(seed: int, fail_rate: float, max_delay: int, tier_capacity: int,
                 resident: bool = False) -> OffloadingRunner:
    rng = random.Random(seed)
    block_size, num_blocks = 4, 24
    tier = FakeTier(tier_capacity, resident)
    sched, _ = offloading_scheduler(make_config(block_size=block_size, max_num_batched_tokens=32,
                                                max_num_seqs=4), num_blocks, tier)
    runner = OffloadingRunner(num_blocks, block_size, tier, rng, fail_rate, max_delay)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(8, 40))] for _ in range(5)]
    expected: dict[str, list[int]] = {}
    got: dict[str, list[int]] = {}
    for i in range(60):
        prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
        rid = f"r{i}"
        sched.add_request(make_request(rid, prompt, max_tokens=rng.randrange(1, 8)))
        expected[rid] = reference_output(prompt, sched.requests[rid].max_tokens)
        for _ in range(rng.randrange(0, 4)):  # a few steps between arrivals
            so = sched.schedule()
            for out in sched.update_from_output(so, runner.execute(so)):
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
    for _ in range(10_000):
        if not sched.has_unfinished_requests() and not sched.offload.has_pending_loads:
            break
        so = sched.schedule()
        for out in sched.update_from_output(so, runner.execute(so)):
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert got == expected
    assert sched.kv_cache_manager.num_free_blocks == num_blocks - 1, "blocks leaked"
    return runner


def test_workload_outputs_match_reference_with_tier_hits():
    runner = run_workload(seed=1, fail_rate=0.0, max_delay=0, tier_capacity=10**9)
    assert runner.num_loads > 5 and runner.num_failed == 0


def test_workload_with_slow_and_failing_loads_and_a_small_tier():
    for seed in range(3):
        runner = run_workload(seed=seed, fail_rate=0.3, max_delay=3, tier_capacity=12)
        assert runner.num_loads > 3 and runner.num_failed > 0


def test_workload_with_same_step_loads():
    runner = run_workload(seed=1, fail_rate=0.0, max_delay=0, tier_capacity=10**9,
                          resident=True)
    assert runner.num_same_step > 5 and runner.num_failed == 0


def test_workload_with_failing_same_step_loads_and_a_small_tier():
    """A failed same-step load leaves garbage in blocks the step's forward read: the
    request's output of that step must be thrown away and the request admitted again."""
    for seed in range(4):
        runner = run_workload(seed=seed, fail_rate=0.3, max_delay=3, tier_capacity=12,
                              resident=True)
        assert runner.num_same_step > 3 and runner.num_failed > 0

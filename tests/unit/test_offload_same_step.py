"""Same-step tier hits: a request whose prefix the tier holds in memory is admitted in
the step of its load, and its suffix computed in that step; a failed same-step load
takes the admission back. Scheduler side against the fake runner of
test_offload_coordinator; runner side against the real ``cpu`` tier on CPU tensors."""

from __future__ import annotations

import random

import torch
from lmkit.api.request import RequestStatus
from lmkit.config.schema import LMKitConfig
from lmkit.kv_cache.hashing import update_block_hashes
from lmkit.offload.coordinator import LOAD_FAILED, NO_SAME_STEP
from lmkit.offload.transfers import KVTransfers, LoadRequest
from lmkit.offload.worker import OffloadWorker
from lmkit.testing.fake_runner import reference_output
from lmkit_plugins.offload.cpu_tier import CPUTier
from lmkit_plugins.offload.options import CPUTierOptions
from test_offload_coordinator import (
    FakeTier,
    OffloadingRunner,
    fill_cache,
    make_request,
    offloading_scheduler,
)
from test_scheduler_fakes import make_config

BS = 4


def setup(num_blocks: int = 32, fail_rate: float = 0.0, **config):
    tier = FakeTier(resident=True)
    sched, coordinator = offloading_scheduler(make_config(block_size=BS, **config), num_blocks,
                                              tier)
    runner = OffloadingRunner(num_blocks, BS, tier, random.Random(0), fail_rate)
    return sched, tier, coordinator, runner


def fill_device(sched, runner, tokens: list[int]) -> None:
    """The device prefix cache holds ``tokens``' full blocks (fake KV written too)."""
    filled = fill_cache(sched.kv_cache_manager, tokens)
    pool = sched.kv_cache_manager.block_pool
    for i, block_hash in enumerate(filled.block_hashes):
        runner.kv[pool.get_cached_block(block_hash).block_id] = tokens[i * BS:(i + 1) * BS]


def put_in_tier(tier: FakeTier, prompt: list[int], blocks: range) -> list[bytes]:
    """The tier holds ``prompt``'s full ``blocks`` (their fake KV is the token ids)."""
    hashes = update_block_hashes(make_request("probe", prompt), BS)
    for i in blocks:
        tier.blocks[hashes[i]] = prompt[i * BS:(i + 1) * BS]
    return hashes


def step(sched, runner):
    so = sched.schedule()
    return so, {o.request_id: o.new_token_ids for o in sched.update_from_output(so, runner.execute(so))}


def test_resident_hit_computes_its_suffix_in_the_step_of_the_load():
    sched, tier, coordinator, runner = setup()
    prompt = list(range(100, 125))  # 6 full blocks + 1 token
    fill_device(sched, runner, prompt[:8])  # device holds blocks 0-1
    hashes = put_in_tier(tier, prompt, range(2, 6))
    sched.add_request(make_request("r", prompt, max_tokens=3))
    so, out = step(sched, runner)
    (load,) = so.kv_transfers.loads
    assert load.same_step and load.block_hashes == hashes[2:6]
    assert so.num_scheduled_tokens == {"r": 1}  # only the last token is computed
    assert so.scheduled_new_reqs[0].num_computed_tokens == 24
    assert out == {"r": reference_output(prompt, 3)[:1]}, "first token in the load's step"
    pool = sched.kv_cache_manager.block_pool
    assert [pool.get_cached_block(h).block_id for h in hashes[2:6]] == load.block_ids
    assert not coordinator.has_pending_loads
    req = sched.requests["r"]
    assert req.num_cached_tokens == 24 and sched.kv_cache_manager.prefix_cache_hits == 24
    for _ in range(2):
        out.update(step(sched, runner)[1])
    assert not sched.has_unfinished_requests()


def test_failed_same_step_load_takes_the_admission_back():
    sched, tier, coordinator, runner = setup(fail_rate=1.0)
    prompt = list(range(200, 225))  # 6 full blocks + 1 token
    fill_device(sched, runner, prompt[:8])
    hashes = put_in_tier(tier, prompt, range(2, 4))  # suffix: blocks 4-5 and 1 token
    sched.add_request(make_request("r", prompt, max_tokens=2))
    so, out = step(sched, runner)
    assert so.kv_transfers.loads[0].same_step and so.num_scheduled_tokens == {"r": 9}
    assert out == {}, "what the step computed on the failed load is thrown away"
    req = sched.requests["r"]
    assert req.status == RequestStatus.WAITING and sched.waiting.peek() is req
    assert req.num_computed_tokens == 0 and req.num_cached_tokens == -1
    assert req.extra[NO_SAME_STEP] and not req.extra.get(LOAD_FAILED)
    pool = sched.kv_cache_manager.block_pool
    assert pool.get_cached_block(hashes[1]) is not None, "device hits stay cached"
    assert all(pool.get_cached_block(h) is None for h in hashes[2:6]), \
        "loaded blocks and the step's suffix blocks hold no valid KV: none is cached"
    assert sched.kv_cache_manager.num_free_blocks == 31
    runner.fail_rate = 0.0
    so, out = step(sched, runner)  # again, by the asynchronous path
    assert "r" in so.preempted_req_ids, "the runner drops the state of the taken-back step"
    assert not so.kv_transfers.loads[0].same_step and so.is_empty
    got = []
    while sched.has_unfinished_requests():
        got += step(sched, runner)[1].get("r", [])
    assert got == reference_output(prompt, 2)
    assert req.num_cached_tokens == 16 and coordinator.stats()["offload_failed_loads"] == 1


def test_same_step_load_without_room_for_the_suffix_waits_for_the_load():
    sched, tier, _, runner = setup(num_blocks=9)  # 8 usable blocks
    prompt = list(range(300, 329))  # 7 full blocks + 1 token
    put_in_tier(tier, prompt, range(0, 4))
    other = make_request("other", list(range(900, 912)), max_tokens=20)
    sched.add_request(other)
    step(sched, runner)  # "other" holds 3 blocks; its decode next step takes a 4th
    sched.add_request(make_request("r", prompt, max_tokens=1))
    so, got = step(sched, runner)
    (load,) = so.kv_transfers.loads
    assert not load.same_step, "4 free blocks hold the load but not the suffix"
    assert "r" not in so.num_scheduled_tokens and sched.requests["r"].num_computed_tokens == 0
    while sched.has_unfinished_requests():
        for rid, tokens in step(sched, runner)[1].items():
            got[rid] = got.get(rid, []) + tokens
    assert got["r"] == reference_output(prompt, 1)
    assert sched.kv_cache_manager.num_free_blocks == 8


def test_second_request_waits_for_the_load_in_flight_instead_of_copying_twice():
    sched, tier, _, runner = setup()
    prompt = list(range(400, 421))
    put_in_tier(tier, prompt, range(0, 5))
    sched.add_request(make_request("a", prompt + [1], max_tokens=1))
    sched.add_request(make_request("b", prompt + [2], max_tokens=1))
    so, out = step(sched, runner)
    assert len(so.kv_transfers.loads) == 1 and list(so.num_scheduled_tokens) == ["a"]
    so, out2 = step(sched, runner)
    assert so.kv_transfers is None and so.num_scheduled_tokens == {"b": 2}  # device hits
    assert out["a"] == reference_output(prompt + [1], 1)
    assert out2["b"] == reference_output(prompt + [2], 1)


# -- the runner side, with the real cpu tier -------------------------------------------

def tier_and_caches(num_slots: int = 8):
    caches = [torch.randn(2, 16, 4, 2, 8) for _ in range(2)]  # [2, blocks, 4 tokens, 2, 8]
    block_bytes = 2 * 2 * 4 * 2 * 8 * 4
    tier = CPUTier(LMKitConfig(), caches, CPUTierOptions(size_gb=num_slots * block_bytes / 2**30))
    return tier, caches


def h(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_worker_reports_same_step_loads_in_their_step():
    tier, caches = tier_and_caches()
    worker = OffloadWorker(tier, "cpu", tier.copier.block_bytes)
    want = [c[:, 1:4].clone() for c in caches]
    worker.start(KVTransfers([h(1), h(2), h(3)], [1, 2, 3], []))
    worker.start(KVTransfers(loads=[LoadRequest(7, [h(1), h(2), h(3)], [10, 11, 12], True)]))
    for cache, w in zip(caches, want, strict=True):  # copied before the call returned
        assert torch.equal(cache[:, 10:13], w)
    assert tier.resident([h(1), h(2), h(9), h(3)]) == 2
    before = [c.clone() for c in caches]
    worker.start(KVTransfers(loads=[LoadRequest(8, [h(1), h(9)], [13, 14], True)]))
    assert worker.finished_loads() == {7: True, 8: False}
    assert all(torch.equal(c, b) for c, b in zip(caches, before, strict=True)), \
        "a refused load copies nothing"


def test_a_store_in_the_same_step_can_push_a_resident_block_out():
    """What makes a same-step load fail: the step's stores run first and evict."""
    tier, caches = tier_and_caches(num_slots=2)
    worker = OffloadWorker(tier, "cpu", tier.copier.block_bytes)
    worker.start(KVTransfers([h(1), h(2)], [1, 2], []))
    assert tier.lookup([h(1), h(2)]) == 2
    worker.start(KVTransfers([h(5), h(6)], [5, 6],
                             [LoadRequest(3, [h(1), h(2)], [8, 9], same_step=True)]))
    assert worker.finished_loads() == {3: False}

"""Preemption by recompute, victim policies (fcfs, priority) and freedom from starvation."""

from __future__ import annotations

import random

import pytest
from lmkit.scheduler.paged import PagedScheduler
from lmkit_plugins.schedulers.fcfs import FCFSScheduler
from lmkit_plugins.schedulers.priority import PriorityScheduler
from test_scheduler_fakes import FakeRunner, drive, make_config, make_request, reference_output


def step(sched, runner):
    so = sched.schedule()
    return so, sched.update_from_output(so, runner.execute(so))


@pytest.mark.parametrize("cls", [FCFSScheduler, PriorityScheduler])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_tiny_pool_preempts_and_outputs_match_unconstrained_run(cls, prefix_caching):
    rng = random.Random(7)
    shared = [rng.randrange(1000) for _ in range(9)]
    specs = [(shared + [rng.randrange(1000) for _ in range(rng.randrange(2, 14))],
              rng.randrange(10, 25), rng.randrange(3)) for _ in range(10)]

    def run(num_blocks):
        cfg = make_config(block_size=4, max_num_batched_tokens=24, max_num_seqs=6,
                          prefix_caching=prefix_caching)
        sched = cls(cfg, num_blocks=num_blocks)
        for i, (prompt, max_tokens, prio) in enumerate(specs):
            sched.add_request(make_request(f"r{i}", prompt, max_tokens, arrival=float(i),
                                           priority=prio))
        return sched, drive(sched, FakeRunner(num_blocks, 4))

    big_sched, big = run(400)
    small_sched, small = run(14)
    assert big_sched.num_preemptions == 0 and small_sched.num_preemptions >= 3
    assert small.outputs == big.outputs
    for i, (prompt, max_tokens, _) in enumerate(specs):
        assert small.outputs[f"r{i}"] == reference_output(make_request("x", prompt, max_tokens))
    preempted = set().union(*(so.preempted_req_ids for so in small.steps))
    resumed = [nd for so in small.steps for nd in so.scheduled_new_reqs if nd.output_token_ids]
    assert preempted and resumed and {nd.req_id for nd in resumed} <= preempted
    for nd in resumed:  # resumed with everything generated so far
        assert nd.output_token_ids == small.outputs[nd.req_id][:len(nd.output_token_ids)]
    assert small_sched.get_stats()["num_preemptions"] == small_sched.num_preemptions
    assert small_sched.kv_cache_manager.usage == 0.0


def _three_running(cls, arrivals, priorities=(0, 0, 0)):
    """Three 4-token prompts filling a 3-block pool; their first decode needs a block each."""
    sched = cls(make_config(block_size=4), num_blocks=4)
    runner = FakeRunner(4, 4)
    for i, (arrival, prio) in enumerate(zip(arrivals, priorities, strict=True)):
        sched.add_request(make_request(f"r{i}", [i] * 4, max_tokens=3, arrival=arrival,
                                       priority=prio))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"r0": 4, "r1": 4, "r2": 4}
    return sched, runner


def test_fcfs_preempts_the_latest_arrival():
    sched, runner = _three_running(FCFSScheduler, arrivals=(0.0, 2.0, 1.0))
    so, _ = step(sched, runner)
    # r0 needs a block: r1 (latest arrival) goes; then r2 needs one and is itself the latest
    assert so.num_scheduled_tokens == {"r0": 1}
    assert so.preempted_req_ids == {"r1", "r2"}
    assert [r.request_id for r in sched.waiting] == ["r2", "r1"]
    assert all(sched.requests[r].num_computed_tokens == 0 for r in ("r1", "r2"))
    assert sched.requests["r1"].num_preemptions == 1 and sched.num_preemptions == 2
    res = drive(sched, runner)
    assert set(res.finish_reasons) == {"r0", "r1", "r2"}


def test_priority_preempts_the_least_important():
    sched, runner = _three_running(PriorityScheduler, arrivals=(0.0, 1.0, 2.0),
                                   priorities=(0, 5, 1))
    so, _ = step(sched, runner)
    # r0 needs a block: r1 (priority 5) goes; r2 (priority 1) then preempts itself
    assert so.preempted_req_ids == {"r1", "r2"} and so.num_scheduled_tokens == {"r0": 1}
    assert [sched.waiting.pop().request_id for _ in range(2)] == ["r2", "r1"]


def test_priority_victim_scheduled_earlier_in_the_step_is_taken_back():
    sched = PriorityScheduler(make_config(block_size=4), num_blocks=4)  # 3 usable blocks
    runner = FakeRunner(4, 4)
    sched.add_request(make_request("r1", [7, 7], max_tokens=5, arrival=0.0, priority=9))
    step(sched, runner)
    sched.add_request(make_request("r0", [0] * 4, max_tokens=5, arrival=1.0, priority=0))
    sched.add_request(make_request("r2", [2] * 4, max_tokens=5, arrival=2.0, priority=1))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"r1": 1, "r0": 4, "r2": 4}  # the pool is now full
    # r1 decodes within its block and is scheduled first; then r0 needs a block, and the
    # least important request is r1, already in this step: it is taken back out
    so = sched.schedule()
    assert so.preempted_req_ids == {"r1", "r2"} and so.num_scheduled_tokens == {"r0": 1}
    assert so.scheduled_cached_reqs.req_ids == ["r0"] and so.total_num_scheduled_tokens == 1
    assert sched.requests["r1"].num_computed_tokens == 0
    sched.update_from_output(so, runner.execute(so))
    res = drive(sched, runner)
    assert set(res.finish_reasons) == {"r0", "r1", "r2"}


def _low_running_then_high_arrives(cls):
    sched = cls(make_config(block_size=4), num_blocks=7)  # 6 usable blocks
    runner = FakeRunner(7, 4)
    low = make_request("low", list(range(16)), max_tokens=8, arrival=0.0, priority=5)
    sched.add_request(low)
    step(sched, runner)  # low holds 4 blocks
    sched.add_request(make_request("high", list(range(50, 60)), max_tokens=4, arrival=1.0))
    return sched, runner


def test_priority_arrival_preempts_a_less_important_running_request():
    sched, runner = _low_running_then_high_arrives(PriorityScheduler)
    so, outs = step(sched, runner)
    assert so.preempted_req_ids == {"low"} and so.num_scheduled_tokens == {"high": 10}
    res = drive(sched, runner)
    assert res.outputs["low"] == reference_output(make_request("x", list(range(16)), 8))[1:]
    assert outs[0].new_token_ids + res.outputs["high"] == reference_output(make_request("x", list(range(50, 60)), 4))


def test_fcfs_arrival_waits_for_blocks_instead():
    sched, runner = _low_running_then_high_arrives(FCFSScheduler)
    so, _ = step(sched, runner)
    assert so.preempted_req_ids == set() and so.num_scheduled_tokens == {"low": 1}
    assert sched.num_preemptions == 0


@pytest.mark.parametrize("cls", [PagedScheduler, PriorityScheduler])
def test_long_prompt_flood_starves_nobody(cls):
    cfg = make_config(block_size=4, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=160)
    sched = cls(cfg, num_blocks=48)
    runner = FakeRunner(48, 4)
    sched.add_request(make_request("first", [1, 2, 3], max_tokens=40, arrival=0.0))
    rng = random.Random(3)
    flood = [make_request(f"long{i}", [rng.randrange(1000) for _ in range(100)], max_tokens=5,
                          arrival=1.0 + i) for i in range(25)]
    pending = list(flood)

    def arrive(s, n):
        if pending:
            s.add_request(pending.pop(0))

    res = drive(sched, runner, on_step=arrive)
    assert set(res.finish_reasons) == {"first"} | {r.request_id for r in flood}
    # the first request decodes every step from its prefill to its end
    steps_with_first = [i for i, so in enumerate(res.steps) if "first" in so.num_scheduled_tokens]
    assert steps_with_first == list(range(steps_with_first[0], steps_with_first[0] + 40))
    # the flood is admitted in arrival order
    first_step = {}
    for i, so in enumerate(res.steps):
        for nd in so.scheduled_new_reqs:
            first_step.setdefault(nd.req_id, i)
    order = sorted(first_step, key=first_step.get)
    assert order == ["first"] + [r.request_id for r in flood]
    for r in flood:
        assert res.outputs[r.request_id] == reference_output(r, 160)


def test_victim_taken_back_leaves_no_uncomputed_blocks_in_the_prefix_cache():
    cfg = make_config(block_size=4, max_num_batched_tokens=16)
    sched = PriorityScheduler(cfg, num_blocks=9)  # 8 usable blocks
    runner = FakeRunner(9, 4)
    a = make_request("A", list(range(8)), max_tokens=4, arrival=0.0, priority=0)
    v = make_request("V", list(range(100, 119)), max_tokens=2, arrival=1.0, priority=9)
    sched.add_request(a)
    sched.add_request(v)
    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"A": 8, "V": 8}
    sched.add_request(make_request("R", [7, 7, 7], max_tokens=3, arrival=2.0, priority=0))
    # V's chunk (positions 8..18) registers two more full blocks and fills the pool; then
    # R preempts V: those two blocks were never computed and must leave the prefix cache
    so, more = step(sched, runner)
    assert so.preempted_req_ids == {"V"} and so.num_scheduled_tokens == {"A": 1, "R": 3}
    cached = sched.kv_cache_manager.block_pool.cached_blocks
    assert v.block_hashes[0] in cached and v.block_hashes[1] in cached
    assert v.block_hashes[2] not in cached and v.block_hashes[3] not in cached
    res = drive(sched, runner)
    a_tokens = [t for o in outs + more if o.request_id == "A" for t in o.new_token_ids]
    assert a_tokens + res.outputs["A"] == reference_output(a)
    assert res.outputs["V"] == reference_output(v)


def test_admission_does_not_preempt_a_request_whose_new_blocks_it_shares():
    cfg = make_config(block_size=4, max_num_batched_tokens=8)
    sched = PriorityScheduler(cfg, num_blocks=5)  # 4 usable blocks
    runner = FakeRunner(5, 4)
    v_prompt = list(range(100, 112))
    v = make_request("V", v_prompt, max_tokens=2, arrival=0.0, priority=9)
    sched.add_request(v)
    step(sched, runner)  # V: positions 0..7
    w1 = make_request("W1", v_prompt + [5], max_tokens=2, arrival=1.0, priority=0)
    w2 = make_request("W2", [1, 2, 3], max_tokens=2, arrival=2.0, priority=0)
    sched.add_request(w1)
    sched.add_request(w2)
    so, outs = step(sched, runner)
    # W1 hits V's third block, which V computes in this very step: V must not be preempted
    # for W2 now, or W1 would read KV nobody wrote
    assert so.preempted_req_ids == set()
    assert so.num_scheduled_tokens == {"V": 4, "W1": 1}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 12
    res = drive(sched, runner)
    got = {o.request_id: o.new_token_ids for o in outs}
    for r in (v, w1):
        assert got[r.request_id] + res.outputs[r.request_id] == reference_output(r)
    assert res.outputs["W2"] == reference_output(w2)


def test_admission_drops_hits_on_blocks_its_victim_had_not_computed():
    cfg = make_config(block_size=4, max_num_batched_tokens=12)
    sched = PriorityScheduler(cfg, num_blocks=8)  # 7 usable blocks
    runner = FakeRunner(8, 4)
    a = make_request("A", list(range(8)), max_tokens=20, arrival=0.0, priority=0)
    v_prompt = list(range(100, 116))
    v = make_request("V", v_prompt, max_tokens=2, arrival=1.0, priority=9)
    sched.add_request(a)
    outs = step(sched, runner)[1]
    sched.add_request(v)
    outs += step(sched, runner)[1]  # A decodes, V computes positions 0..10
    w = make_request("W", v_prompt[:12] + [5], max_tokens=2, arrival=2.0, priority=0)
    sched.add_request(w)
    # V's last chunk (11..15) registers V's 3rd block, which W hits; the pool is full, so
    # W preempts V, and V never computes that block: W must compute from position 8
    so, more = step(sched, runner)
    assert so.preempted_req_ids == {"V"}
    (new,) = so.scheduled_new_reqs
    assert new.req_id == "W" and new.num_computed_tokens == 8
    assert so.num_scheduled_tokens == {"A": 1, "W": 5}
    res = drive(sched, runner)
    got = {}
    for o in outs + more:
        got.setdefault(o.request_id, []).extend(o.new_token_ids)
    for r in (a, v, w):
        assert got.get(r.request_id, []) + res.outputs[r.request_id] == reference_output(r)

"""PagedScheduler mechanics: step data, chunked prefill, budgets, prefix caching, aborts."""

from __future__ import annotations

import random

import pytest
from lmkit.api.request import RequestStatus
from lmkit.errors import ConfigError, InvalidRequestError
from lmkit.scheduler.paged import PagedScheduler
from test_scheduler_fakes import (
    FakeRunner,
    drive,
    make_config,
    make_request,
    reference_output,
)


def step(sched, runner):
    so = sched.schedule()
    return so, sched.update_from_output(so, runner.execute(so))


def test_new_then_cached_request_data():
    sched = PagedScheduler(make_config(block_size=4), num_blocks=16)
    runner = FakeRunner(16, 4)
    sched.add_request(make_request("a", list(range(6)), max_tokens=4))
    so, outs = step(sched, runner)
    (new,) = so.scheduled_new_reqs
    assert new.req_id == "a" and new.num_computed_tokens == 0 and len(new.block_ids) == 2
    assert so.num_scheduled_tokens == {"a": 6} and so.total_num_scheduled_tokens == 6
    assert [o.new_token_ids for o in outs] == [[reference_output(sched.requests["a"])[0]]]
    for expected_computed in (6, 7):
        so, _ = step(sched, runner)
        assert so.scheduled_new_reqs == []
        assert so.scheduled_cached_reqs.req_ids == ["a"]
        assert so.scheduled_cached_reqs.num_computed_tokens == [expected_computed]
        assert so.num_scheduled_tokens == {"a": 1}
    # the 9th token needs a third block
    assert so.scheduled_cached_reqs.new_block_ids == [[]]
    so, outs = step(sched, runner)
    assert len(so.scheduled_cached_reqs.new_block_ids[0]) == 1
    assert outs[0].finish_reason == "length"
    so = sched.schedule()
    assert so.finished_req_ids == {"a"} and so.is_empty
    assert sched.schedule().finished_req_ids == set()  # told once


def test_chunked_prefill_splits_a_long_prompt():
    sched = PagedScheduler(make_config(max_num_batched_tokens=16), num_blocks=64)
    runner = FakeRunner(64, 4)
    sched.add_request(make_request("a", list(range(50)), max_tokens=3))
    chunks = []
    for _ in range(4):
        so, outs = step(sched, runner)
        chunks.append(so.num_scheduled_tokens["a"])
        assert (outs == []) == (len(chunks) < 4)  # partial chunks produce no output
    assert chunks == [16, 16, 16, 2]
    res = drive(sched, runner)
    assert len(res.outputs["a"]) == 2


def test_decodes_and_a_prefill_chunk_share_a_step():
    sched = PagedScheduler(make_config(max_num_batched_tokens=16), num_blocks=64)
    runner = FakeRunner(64, 4)
    sched.add_request(make_request("a", list(range(5)), max_tokens=10))
    step(sched, runner)
    sched.add_request(make_request("b", list(range(100, 140)), max_tokens=2))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 15}


def test_chunked_prefill_off_makes_a_prompt_wait_for_room():
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        PagedScheduler(make_config(chunked=False, max_num_batched_tokens=32), num_blocks=64)
    cfg = make_config(chunked=False, max_num_batched_tokens=32, max_model_len=32)
    sched = PagedScheduler(cfg, num_blocks=64)
    runner = FakeRunner(64, 4)
    sched.add_request(make_request("a", list(range(20)), max_tokens=3))
    sched.add_request(make_request("b", list(range(100, 120)), max_tokens=3))
    sched.add_request(make_request("c", [5], max_tokens=3))
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 20}  # b does not fit in 12; c waits behind b
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 20, "c": 1}
    res = drive(sched, runner)
    for so in res.steps:
        assert all(n in (1, 20) for n in so.num_scheduled_tokens.values())  # never split
    assert set(res.outputs) == {"a", "b", "c"}


def test_two_requests_with_the_same_prefix_in_one_step_share_blocks():
    sched = PagedScheduler(make_config(block_size=4), num_blocks=64)
    prefix = list(range(30, 47))  # 17 tokens: 4 full blocks
    sched.add_request(make_request("a", prefix + [1, 2]))
    sched.add_request(make_request("b", prefix + [3]))
    so = sched.schedule()
    a, b = so.scheduled_new_reqs
    assert a.block_ids[:4] == b.block_ids[:4] and a.block_ids[4] != b.block_ids[4]
    assert b.num_computed_tokens == 16 and so.num_scheduled_tokens == {"a": 19, "b": 2}
    assert sched.requests["b"].num_cached_tokens == 16


def test_prefix_hit_reported_and_outputs_unchanged():
    prefix = list(range(200, 237))  # 37 tokens -> 9 full blocks of 4
    for prefix_caching in (True, False):
        sched = PagedScheduler(make_config(prefix_caching=prefix_caching), num_blocks=64)
        runner = FakeRunner(64, 4)
        sched.add_request(make_request("a", prefix + [1, 2, 3], max_tokens=4))
        first = drive(sched, runner)
        sched.add_request(make_request("b", prefix + [9], max_tokens=6))
        so = sched.schedule()
        expected_hit = len(prefix) // 4 * 4 if prefix_caching else 0
        assert so.scheduled_new_reqs[0].num_computed_tokens == expected_hit
        assert so.num_scheduled_tokens["b"] == 38 - expected_hit
        outs = sched.update_from_output(so, runner.execute(so))
        assert outs[0].num_cached_tokens == expected_hit
        rest = drive(sched, runner)
        b_tokens = outs[0].new_token_ids + rest.outputs["b"]
        assert b_tokens == reference_output(make_request("b", prefix + [9], max_tokens=6))
        assert first.outputs["a"] == reference_output(make_request("a", prefix + [1, 2, 3], max_tokens=4))
        stats = sched.get_stats()
        assert stats["prefix_cache_hits"] == expected_hit


def test_budget_and_max_num_seqs_hold_on_random_workloads():
    rng = random.Random(1234)
    for trial in range(40):
        budget = rng.choice([8, 16, 33, 64])
        max_seqs = rng.choice([1, 2, 5, 16])
        num_blocks = rng.choice([21, 24, 48, 200])
        cfg = make_config(block_size=4, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                          max_model_len=80, prefix_caching=rng.random() < 0.7)
        sched = PagedScheduler(cfg, num_blocks=num_blocks)
        runner = FakeRunner(num_blocks, 4)
        shared = [rng.randrange(1000) for _ in range(rng.randrange(0, 24))]
        reqs = []
        for i in range(rng.randrange(5, 20)):
            prompt = shared + [rng.randrange(1000) for _ in range(rng.randrange(1, 40))]
            reqs.append(make_request(f"r{trial}-{i}", prompt, max_tokens=rng.randrange(1, 20),
                                     arrival=float(i)))
        pending = list(reqs)

        def arrive(s, n, pending=pending):
            for _ in range(rng.randrange(0, 3)):
                if pending:
                    s.add_request(pending.pop(0))

        arrive(sched, 0)
        if not sched.has_unfinished_requests():
            sched.add_request(pending.pop(0))
        res = drive(sched, runner, on_step=arrive)
        while pending:  # any left when the queue drained
            sched.add_request(pending.pop(0))
            res2 = drive(sched, runner, on_step=arrive)
            res.outputs.update(res2.outputs)
        for r in reqs:
            assert res.outputs[r.request_id] == reference_output(r, 80), (trial, r)
        assert sched.kv_cache_manager.usage == 0.0


def test_abort_frees_blocks_and_tells_the_runner():
    sched = PagedScheduler(make_config(max_num_batched_tokens=8), num_blocks=32)
    runner = FakeRunner(32, 4)
    sched.add_request(make_request("a", list(range(20)), max_tokens=50))
    sched.add_request(make_request("b", list(range(5)), max_tokens=50))
    sched.add_request(make_request("c", list(range(5)), max_tokens=50))
    for _ in range(4):
        step(sched, runner)
    assert sched.kv_cache_manager.usage > 0
    sched.finish_requests(["a", "c", "nope"], RequestStatus.FINISHED_ABORTED)
    sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache_manager.usage == 0.0 and not sched.has_unfinished_requests()
    assert sched.schedule().finished_req_ids == {"a", "b", "c"}
    with pytest.raises(ValueError, match="finished status"):
        sched.finish_requests("a", RequestStatus.RUNNING)


def test_abort_between_schedule_and_update_is_ignored_by_update():
    sched = PagedScheduler(make_config(), num_blocks=32)
    runner = FakeRunner(32, 4)
    sched.add_request(make_request("a", list(range(6)), max_tokens=5))
    so = sched.schedule()
    ro = runner.execute(so)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert sched.update_from_output(so, ro) == []
    assert sched.kv_cache_manager.usage == 0.0


def test_add_request_rejects_duplicates_and_requests_that_never_fit():
    sched = PagedScheduler(make_config(block_size=4, max_model_len=512), num_blocks=5)
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=10))  # 12 slots: 3 blocks
    with pytest.raises(InvalidRequestError, match="already in use"):
        sched.add_request(make_request("a", [1], max_tokens=1))
    with pytest.raises(InvalidRequestError, match="KV cache holds only 4") as e:
        sched.add_request(make_request("b", [1] * 10, max_tokens=10))
    assert e.value.code == "kv_cache_too_small"
    cfg = make_config()
    cfg.model.max_model_len = None
    with pytest.raises(ConfigError, match="max_model_len"):
        PagedScheduler(cfg, num_blocks=8)


def test_stats_report_the_counters():
    sched = PagedScheduler(make_config(max_num_seqs=1), num_blocks=32)
    sched.add_request(make_request("a", list(range(9)), max_tokens=5))
    sched.add_request(make_request("b", list(range(9)), max_tokens=5))
    step(sched, FakeRunner(32, 4))
    stats = sched.get_stats()
    assert stats["num_running"] == 1 and stats["num_waiting"] == 1
    assert stats["kv_cache_usage"] == pytest.approx(3 / 31)
    assert stats["prefix_cache_queries"] == 9 and stats["prefix_cache_hits"] == 0
    assert stats["num_preemptions"] == 0 and stats["num_evictions"] == 0


"""What the engine hands the scheduler through its constructor (``SchedulerContext``):
decode lookahead slots and the KV offload tier as a prefix tier; the engine-side tier
that reaches the workers through the executor's typed offload methods."""

from __future__ import annotations

import logging

import pytest
from lmkit.api import Executor, ModelRunnerOutput, PrefixTier, Scheduler, SchedulerContext
from lmkit.errors import ConfigError
from lmkit.kv_cache.hashing import update_block_hashes
from lmkit.offload.attach import ExecutorPrefixTier, OffloadPhase, prefix_tier
from lmkit.scheduler.paged import PagedScheduler
from test_scheduler_fakes import make_config, make_request


class CountingTier(PrefixTier):
    """Holds the blocks of ``held``; counts lookups."""

    write_through = True

    def __init__(self, held=()):
        self.held = set(held)
        self.lookups = 0

    def lookup(self, block_hashes):
        self.lookups += 1
        n = 0
        while n < len(block_hashes) and block_hashes[n] in self.held:
            n += 1
        return n, 0

    def stats(self):
        return {"offload_tier_counter": 7}


def test_lookahead_slots_come_from_the_context():
    assert PagedScheduler(make_config(), num_blocks=64).num_lookahead_tokens == 0
    sched = PagedScheduler(make_config(), num_blocks=64,
                           context=SchedulerContext(num_lookahead_slots=1))
    assert sched.num_lookahead_tokens == 1
    # draft tokens need more slots than one launched-ahead decode: the larger wins
    spec = make_config(spec_backend="ngram", num_spec=3)
    assert PagedScheduler(spec, num_blocks=64, context=SchedulerContext(
        num_lookahead_slots=1)).num_lookahead_tokens == 3


@pytest.mark.parametrize("slots", [0, 1])
def test_a_lookahead_slot_is_reserved_for_every_running_request(slots):
    sched = PagedScheduler(make_config(block_size=4), num_blocks=64,
                           context=SchedulerContext(num_lookahead_slots=slots))
    req = make_request("r", list(range(7)), max_tokens=4)
    sched.add_request(req)
    so = sched.schedule()
    assert len(sched.kv_cache_manager.get_block_ids(req)) == 2  # the prefill: 7 slots
    sched.update_from_output(so, ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[5]]))
    sched.schedule()
    # the decode: 8 slots, plus the lookahead slot -> a third block
    assert len(sched.kv_cache_manager.get_block_ids(req)) == 2 + slots


def test_the_prefix_tier_is_consulted_at_admission_and_reported_in_stats():
    tier = CountingTier()
    sched = PagedScheduler(make_config(block_size=4), num_blocks=64,
                           context=SchedulerContext(prefix_tier=tier))
    assert sched.offload is not None and sched.offload.write_through
    req = make_request("r", list(range(13)))
    tier.held = set(update_block_hashes(req, 4, sched.kv_cache_manager.hash_seed))
    sched.add_request(req)
    so = sched.schedule()
    assert tier.lookups == 1
    assert so.is_empty and len(so.kv_transfers.loads) == 1  # held back for its load
    stats = sched.get_stats()
    assert stats["offload_load_jobs"] == 1 and stats["offload_tier_counter"] == 7
    assert "offload_load_jobs" not in PagedScheduler(make_config(), 64).get_stats()


class FakeExecutor(Executor):
    def __init__(self, close_error=None):
        self.close_error = close_error
        self.asked = []

    def start(self):
        raise NotImplementedError

    def initialize_kv_cache(self, num_blocks):
        pass

    def execute(self, scheduler_output):
        raise NotImplementedError

    def shutdown(self):
        pass

    def offload_lookup(self, block_hashes):
        self.asked.append(list(block_hashes))
        return 2, 1

    def offload_stats(self):
        return {"offload_bytes_stored": 64}

    def close_offload(self):
        if self.close_error is not None:
            raise self.close_error


def test_the_engine_tier_reaches_the_workers_through_typed_executor_methods(caplog):
    executor = FakeExecutor(close_error=OSError("disk gone"))
    tier = ExecutorPrefixTier(executor, write_through=False)
    assert tier.lookup([b"a" * 32, b"b" * 32]) == (2, 1)
    assert executor.asked == [[b"a" * 32, b"b" * 32]]
    assert tier.stats() == {"offload_bytes_stored": 64} and not tier.write_through
    with caplog.at_level(logging.ERROR):
        OffloadPhase(executor).shutdown()  # logs, never raises: shutdown goes on
    assert "closing the KV offload tier failed" in caplog.text


def test_executor_offload_methods_default_to_no_tier():
    class Bare(FakeExecutor):
        offload_lookup = Executor.offload_lookup
        offload_stats = Executor.offload_stats
        close_offload = Executor.close_offload

    bare = Bare()
    assert bare.offload_lookup([b"x" * 32]) == (0, 0) and bare.offload_stats() == {}
    bare.close_offload()


class FakeStack:
    def __init__(self, offload):
        self.offload = offload

    def get(self, kind):
        return self.offload if kind == "offload" else None


class Registration:
    name = "cpu"


class OwnScheduler(Scheduler):  # a design of its own: consults no prefix tier
    def add_request(self, request): ...
    def finish_requests(self, request_ids, status): ...
    def schedule(self): ...
    def update_from_output(self, scheduler_output, runner_output): ...
    def has_unfinished_requests(self): ...


def test_an_offload_tier_needs_a_scheduler_that_declares_it_consults_one():
    executor = FakeExecutor()
    assert prefix_tier(FakeStack(None), OwnScheduler, executor) is None  # offload off
    assert isinstance(prefix_tier(FakeStack(Registration()), PagedScheduler, executor),
                      ExecutorPrefixTier)
    with pytest.raises(ConfigError, match="offload tier 'cpu' needs a scheduler that consults "
                       "a prefix tier .* OwnScheduler does not; choose another scheduler or "
                       "set offload.backend: none"):
        prefix_tier(FakeStack(Registration()), OwnScheduler, executor)

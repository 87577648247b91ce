"""The scheduler conformance suite: the built-in schedulers pass it; broken schedulers
(over budget, too many sequences, newest-first starvation, leaking aborted blocks,
never preempting, scheduling requests still waiting for their grammar) fail it with the property, workload and step named."""

from __future__ import annotations

import pytest
from lmkit.api import FCFSWaitingQueue, PagedScheduler, RequestStatus, Spec
from lmkit.plugin_host.manager import PluginHost
from lmkit.testing import ConformanceFailure
from lmkit.testing.scheduler import SchedulerConformance, check_scheduler


def builtin(name: str):
    return PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}).registry.get(
        "scheduler", name)


class TestFCFS(SchedulerConformance):
    @pytest.fixture
    def scheduler(self):
        return builtin("fcfs")


class TestPriority(SchedulerConformance):
    @pytest.fixture
    def scheduler(self):
        return builtin("priority")


class OverBudget(PagedScheduler):
    def __init__(self, config, num_blocks, options=None, context=None):
        super().__init__(config, num_blocks, options, context)
        self.max_num_batched_tokens += 8


class TooManySeqs(PagedScheduler):
    def __init__(self, config, num_blocks, options=None, context=None):
        super().__init__(config, num_blocks, options, context)
        self.max_num_seqs += 2


class NewestFirstQueue(FCFSWaitingQueue):
    def add(self, request):
        self._queue.appendleft(request)


class NewestFirst(PagedScheduler):
    def make_waiting_queue(self):
        return NewestFirstQueue()


class LeaksAbortedBlocks(PagedScheduler):
    def finish_requests(self, request_ids, status):
        free = self.kv_cache_manager.free
        self.kv_cache_manager.free = lambda request: None
        try:
            super().finish_requests(request_ids, status)
        finally:
            self.kv_cache_manager.free = free


class NeverPreempts(PagedScheduler):
    """Admits one request at a time, so it never needs to preempt."""

    def __init__(self, config, num_blocks, options=None, context=None):
        super().__init__(config, num_blocks, options, context)
        self.max_num_seqs = 1


class GrammarBlind(PagedScheduler):
    """Treats requests waiting for their grammar as ready."""

    def schedule(self):
        for request in self.requests.values():
            if request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                request.status = RequestStatus.WAITING
        return super().schedule()


class OldSignature(PagedScheduler):
    """A constructor without the context argument."""

    def __init__(self, config, num_blocks, options=None):
        super().__init__(config, num_blocks, options)


def fails(cls, prop: str) -> str:
    with pytest.raises(ConformanceFailure) as exc:
        check_scheduler(Spec(name=cls.__name__, target=lambda: cls), only=[prop])
    return str(exc.value)


def test_over_budget_is_caught_with_the_step():
    msg = fails(OverBudget, "budget and max_num_seqs")
    assert "'OverBudget' fails property 'budget and max_num_seqs'" in msg
    assert "max_num_batched_tokens 8" in msg and "over max_num_batched_tokens 8" in msg
    assert "at step 1" in msg


def test_too_many_sequences_are_caught():
    msg = fails(TooManySeqs, "every request finishes")
    assert "over max_num_seqs 4" in msg


def test_newest_first_starves_the_oldest_request():
    msg = fails(NewestFirst, "no starvation under a long-prompt flood")
    assert "the oldest request finished only at step" in msg
    assert "newer requests kept overtaking it" in msg


def test_leaked_blocks_after_abort_are_caught():
    msg = fails(LeaksAbortedBlocks, "aborts free blocks")
    assert "kv_cache_usage" in msg and "blocks were not freed" in msg


def test_a_scheduler_that_never_preempts_must_say_so():
    msg = fails(NeverPreempts, "preemption and resumption")
    assert "set requires_preemption = False" in msg
    spec = Spec(name="never", target=lambda: NeverPreempts)
    assert check_scheduler(spec, requires_preemption=False)["preemption and resumption"] == "passed"


def test_scheduling_a_request_waiting_for_its_grammar_is_caught():
    msg = fails(GrammarBlind, "waiting for grammar")
    assert "in status WAITING_FOR_GRAMMAR were scheduled" in msg
    assert "1 lookahead slots" in msg  # built with SchedulerContext(num_lookahead_slots=1)


def test_a_constructor_without_the_context_is_caught():
    msg = fails(OldSignature, "every request finishes")
    assert "fails property 'constructor signature'" in msg
    assert "num_blocks, options, context" in msg

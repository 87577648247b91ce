"""Stop checks (EOS, min_tokens, stop_token_ids, max_tokens, max_model_len) and the
outputs update_from_output returns."""

from __future__ import annotations

import pytest
from lmkit.api.outputs import TokenLogprob
from lmkit.api.request import RequestStatus
from lmkit.api.runner_output import ModelRunnerOutput
from lmkit.scheduler.paged import PagedScheduler
from lmkit.scheduler.stop import append_and_check_stop
from test_scheduler_fakes import FakeRunner, make_config, make_request

EOS = 5


def run_tokens(tokens, max_model_len=512, **kw):
    req = make_request("a", [1, 2, 3], eos=EOS, **kw)
    return req, append_and_check_stop(req, tokens, max_model_len)


def test_eos_stops_and_drops_later_tokens():
    req, appended = run_tokens([3, EOS, 7], max_tokens=10)
    assert appended == [3, EOS] and req.output_token_ids == [3, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason is None
    assert req.all_token_ids == [1, 2, 3, 3, EOS]


def test_min_tokens_defers_eos_and_stop_tokens():
    req, appended = run_tokens([EOS, 9, EOS, 7], max_tokens=10, min_tokens=3,
                               stop_token_ids=[9])
    assert appended == [EOS, 9, EOS] and req.status == RequestStatus.FINISHED_STOPPED
    req, appended = run_tokens([EOS, 4, 9, 7], max_tokens=10, min_tokens=3, stop_token_ids=[9])
    assert appended == [EOS, 4, 9] and req.stop_reason == 9


def test_ignore_eos_keeps_going_until_max_tokens():
    req, appended = run_tokens([EOS, EOS, EOS, EOS], max_tokens=3, ignore_eos=True)
    assert appended == [EOS, EOS, EOS] and req.status == RequestStatus.FINISHED_LENGTH


def test_stop_token_ids_report_the_token():
    req, appended = run_tokens([4, 9, 8], max_tokens=10, stop_token_ids=[8, 9])
    assert appended == [4, 9] and req.stop_reason == 9
    assert req.status.finish_reason == "stop"


def test_max_tokens_and_max_model_len_end_with_length():
    req, appended = run_tokens([4, 4, 4, 4], max_tokens=2)
    assert appended == [4, 4] and req.status == RequestStatus.FINISHED_LENGTH
    req, appended = run_tokens([4, 4, 4, 4], max_tokens=10, max_model_len=5)
    assert appended == [4, 4] and req.num_tokens == 5 and req.status.finish_reason == "length"
    req, appended = run_tokens([4, EOS], max_tokens=2)  # stop wins on the last position
    assert req.status == RequestStatus.FINISHED_STOPPED
    req, appended = run_tokens([4, 4], max_tokens=10)
    assert appended == [4, 4] and not req.is_finished


def test_no_eos_token_means_no_eos_stop():
    req = make_request("a", [1], eos=None, max_tokens=3)
    assert append_and_check_stop(req, [0, 0], 512) == [0, 0] and not req.is_finished


def _decoding(budget=64, **kw):
    sched = PagedScheduler(make_config(max_num_batched_tokens=budget), num_blocks=32)
    sched.add_request(make_request("a", list(range(10)), eos=EOS, **kw))
    return sched


def test_update_outputs_carry_finish_logprobs_and_cached_tokens():
    sched = _decoding(max_tokens=10, logprobs=1)
    so = sched.schedule()
    lps = [TokenLogprob(t, -0.5, 1) for t in (7, EOS, 8)]
    ro = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[7, EOS, 8]], logprobs=[lps])
    (out,) = sched.update_from_output(so, ro)
    assert out.new_token_ids == [7, EOS] and out.finish_reason == "stop"
    assert out.new_logprobs == lps[:2] and out.num_cached_tokens == 0 and out.stop_reason is None
    assert not sched.has_unfinished_requests() and sched.kv_cache_manager.usage == 0.0
    assert sched.schedule().finished_req_ids == {"a"}


def test_partial_prefill_chunk_gives_no_output_unless_prompt_logprobs():
    sched = _decoding(budget=4, max_tokens=3)
    runner = FakeRunner(32, 4)
    so = sched.schedule()
    assert sched.update_from_output(so, runner.execute(so)) == []
    so = sched.schedule()
    ro = runner.execute(so)
    ro.prompt_logprobs["a"] = [None, TokenLogprob(4, -1.0, 1)]
    (out,) = sched.update_from_output(so, ro)
    assert out.new_token_ids == [] and not out.finished and out.prompt_logprobs is not None


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED])
def test_finish_requests_from_the_frontend(status):
    sched = _decoding(max_tokens=10)
    runner = FakeRunner(32, 4)
    so = sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    req = sched.requests["a"]
    sched.finish_requests("a", status)
    assert req.status == status and sched.kv_cache_manager.usage == 0.0
    # its full blocks stay cached for the next request with this prefix
    sched.add_request(make_request("b", list(range(10)) + [1], max_tokens=2))
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8

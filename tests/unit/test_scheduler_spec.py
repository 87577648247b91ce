"""Draft-token scheduling, lookahead slots and rollback of rejected drafts."""

from __future__ import annotations

import random

import pytest
from lmkit.api.runner_output import ModelRunnerOutput
from lmkit.scheduler.paged import PagedScheduler
from test_scheduler_fakes import (
    FakeRunner,
    drive,
    make_config,
    make_request,
    next_token,
    reference_output,
)

K = 3


def decoding_scheduler(max_num_batched_tokens=64, max_tokens=20, num_blocks=32):
    cfg = make_config(block_size=4, spec_backend="ngram", num_spec=K,
                      max_num_batched_tokens=max_num_batched_tokens)
    sched = PagedScheduler(cfg, num_blocks=num_blocks)
    runner = FakeRunner(num_blocks, 4)
    sched.add_request(make_request("a", list(range(6)), max_tokens=max_tokens))
    req = sched.requests["a"]
    while not req.output_token_ids:  # prefill, in chunks if the budget is small
        so = sched.schedule()
        sched.update_from_output(so, runner.execute(so))
    return sched, runner, req


def true_continuation(tokens: list[int], n: int) -> list[int]:
    tokens = list(tokens)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[-n:]


def test_drafts_are_scheduled_with_their_slots_and_consumed():
    sched, runner, req = decoding_scheduler()
    assert sched.num_lookahead_tokens == K
    req.spec_token_ids = [11, 12, 13]
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 4}
    assert so.scheduled_spec_decode_tokens == {"a": [11, 12, 13]}
    assert req.spec_token_ids == [] and req.num_computed_tokens == 6 + 4
    # slots for the 7 tokens + 3 drafts + 3 lookahead
    assert len(sched.kv_cache_manager.get_block_ids(req)) == 4


def test_rollback_arithmetic_for_rejected_drafts():
    sched, runner, req = decoding_scheduler()
    for num_accepted in (0, 2, 3):
        before = req.num_tokens
        truth = true_continuation(req.all_token_ids, K + 1)
        req.spec_token_ids = truth[:num_accepted] + [-1] * (K - num_accepted)
        so = sched.schedule()
        assert req.num_computed_tokens == before + K
        sampled = truth[:num_accepted + 1]
        ro = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[sampled])
        (out,) = sched.update_from_output(so, ro)
        assert out.new_token_ids == sampled
        assert req.num_tokens == before + num_accepted + 1
        # rejected drafts (K - accepted) come back off: all but the newest token computed
        assert req.num_computed_tokens == req.num_tokens - 1


def test_drafts_are_cut_by_the_budget_and_by_max_tokens():
    sched, _, req = decoding_scheduler(max_num_batched_tokens=2)
    req.spec_token_ids = [1, 2, 3]
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 2} and so.scheduled_spec_decode_tokens == {"a": [1]}

    sched, _, req = decoding_scheduler(max_tokens=3)  # 1 output so far, 2 more allowed
    req.spec_token_ids = [1, 2, 3]
    so = sched.schedule()
    # the second allowed token is sampled after the first draft: one draft is enough
    assert so.num_scheduled_tokens == {"a": 2} and so.scheduled_spec_decode_tokens == {"a": [1]}


@pytest.mark.parametrize("num_blocks", [200, 24])
def test_speculative_outputs_match_plain_decoding(num_blocks):
    rng = random.Random(11)
    prompts = [[rng.randrange(1000) for _ in range(rng.randrange(3, 20))] for _ in range(8)]
    cfg = make_config(block_size=4, spec_backend="ngram", num_spec=K, max_num_batched_tokens=24)
    sched = PagedScheduler(cfg, num_blocks=num_blocks)
    for i, p in enumerate(prompts):
        sched.add_request(make_request(f"r{i}", p, max_tokens=25, arrival=float(i)))
    accepted = []

    def propose(s, step):
        for r in s.running:
            if r.num_computed_tokens == r.num_tokens - 1:  # decoding
                truth = true_continuation(r.all_token_ids, K)
                n_good = rng.randrange(K + 1)
                r.spec_token_ids = truth[:n_good] + [rng.randrange(1000)] * (K - n_good)
                accepted.append(n_good)

    res = drive(sched, FakeRunner(num_blocks, 4), on_step=propose)
    for i, p in enumerate(prompts):
        assert res.outputs[f"r{i}"] == reference_output(make_request("x", p, max_tokens=25))
    assert sum(accepted) > 0
    assert len(res.steps) < 8 * 25  # drafts made it faster than one token per step
    if num_blocks == 24:
        assert sched.num_preemptions > 0
    assert sched.kv_cache_manager.usage == 0.0


@pytest.mark.parametrize(("budget", "lookahead"), [(64, True), (4, False)],
                         ids=["whole-prompt", "chunked"])
def test_a_prompt_that_completes_gets_its_draft_slots(budget, lookahead):
    """A request whose whole prompt runs in its admission step drafts right after it, so
    its K lookahead slots come with the prompt's; a first chunk that leaves the prompt
    unfinished takes none (the step that finishes it does)."""
    cfg = make_config(block_size=4, spec_backend="ngram", num_spec=K,
                      max_num_batched_tokens=budget)
    sched = PagedScheduler(cfg, num_blocks=32)
    sched.add_request(make_request("a", list(range(6)), max_tokens=20))
    req = sched.requests["a"]
    so = sched.schedule()
    computed = so.num_scheduled_tokens["a"]
    slots = computed + (K if lookahead else 0)  # 6 + 3 = 9 slots: 3 blocks of 4
    assert len(sched.kv_cache_manager.get_block_ids(req)) == -(-slots // 4)
    assert computed == (6 if lookahead else 4)


def test_pooling_requests_take_no_draft_slots():
    from lmkit.api.pooling import PoolingParams

    cfg = make_config(block_size=4, spec_backend="ngram", num_spec=K)
    sched = PagedScheduler(cfg, num_blocks=32)
    request = make_request("e", list(range(8)), max_tokens=1)
    request.pooling_params = PoolingParams()
    sched.add_request(request)
    sched.schedule()
    assert len(sched.kv_cache_manager.get_block_ids(request)) == 2  # its 8 slots only


def test_decode_lookahead_slots_are_not_taken_at_admission():
    """Without speculation the runner's decode lookahead (steps launched ahead of
    scheduling, only after a decode step) reserves its slots once the request decodes,
    not with the prompt."""
    from lmkit.api.scheduler import SchedulerContext

    sched = PagedScheduler(make_config(block_size=4), num_blocks=32,
                           context=SchedulerContext(num_lookahead_slots=2))
    assert sched.num_lookahead_tokens == 2 and sched.num_draft_slots == 0
    sched.add_request(make_request("a", list(range(8)), max_tokens=20))
    sched.schedule()
    assert len(sched.kv_cache_manager.get_block_ids(sched.requests["a"])) == 2  # 8 slots

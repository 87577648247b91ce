"""A driver loop for scheduler tests around :class:`lmkit.testing.fake_runner.FakeRunner`
(plus tests of the fakes).

The fake runner knows requests only through ``SchedulerOutput`` (as a real runner
does), writes each computed token id into a fake paged KV memory through the block
table, and "samples" the next token from the history it reads back from that memory.
So a wrong block table, a bad prefix-cache hit or a lost preemption shows up as a
different token, and greedy outputs must match :func:`reference_output` exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmkit.api.request import Request
from lmkit.api.sampling_params import SamplingParams
from lmkit.api.scheduler_output import SchedulerOutput
from lmkit.config.schema import LMKitConfig
from lmkit.scheduler.paged import PagedScheduler
from lmkit.testing.fake_runner import FakeRunner, next_token


def make_config(block_size: int = 4, max_num_batched_tokens: int = 64, max_num_seqs: int = 8,
                chunked: bool = True, prefix_caching: bool = True, max_model_len: int = 512,
                spec_backend: str = "none", num_spec: int = 3) -> LMKitConfig:
    return LMKitConfig(
        model={"max_model_len": max_model_len},
        cache={"block_size": block_size, "enable_prefix_caching": prefix_caching},
        scheduler={"max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs,
                   "enable_chunked_prefill": chunked},
        speculative={"backend": spec_backend, "num_speculative_tokens": num_spec},
    )


def make_request(rid: str, prompt: list[int], max_tokens: int = 8, arrival: float | None = None,
                 priority: int = 0, eos: int | None = None, salt: str | None = None,
                 **params) -> Request:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
    return Request(rid, prompt, sp, eos_token_id=eos, arrival_time=arrival, priority=priority,
                   cache_salt=salt)


def reference_output(request: Request, max_model_len: int = 512) -> list[int]:
    """What the fake model generates for ``request`` alone (EOS-free requests)."""
    tokens = list(request.prompt_token_ids)
    out: list[int] = []
    while len(out) < request.max_tokens and len(tokens) < max_model_len:
        tok = next_token(tokens)
        tokens.append(tok)
        out.append(tok)
    return out


def check_invariants(sched: PagedScheduler, so: SchedulerOutput) -> None:
    """Budget, max_num_seqs and block-pool bookkeeping after a schedule()."""
    assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
    assert so.total_num_scheduled_tokens <= sched.max_num_batched_tokens
    assert len(so.num_scheduled_tokens) <= sched.max_num_seqs
    assert len(sched.running) <= sched.max_num_seqs
    assert all(n > 0 for n in so.num_scheduled_tokens.values())
    pool = sched.kv_cache_manager.block_pool
    holders: dict[int, int] = {}
    for blocks in sched.kv_cache_manager.req_to_blocks.values():
        for b in blocks:
            holders[b.block_id] = holders.get(b.block_id, 0) + 1
    free_ids = {b.block_id for b in pool.free_queue}
    assert len(free_ids) == pool.num_free_blocks
    for b in pool.blocks[1:]:
        assert b.ref_cnt == holders.get(b.block_id, 0), b
        assert (b.block_id in free_ids) == (b.ref_cnt == 0), b
    for h, b in pool.cached_blocks.items():
        assert b.block_hash == h


@dataclass
class DriveResult:
    outputs: dict[str, list[int]]
    finish_reasons: dict[str, str]
    steps: list[SchedulerOutput]


def drive(sched: PagedScheduler, runner: FakeRunner, max_steps: int = 5000,
          on_step=None) -> DriveResult:
    """Run schedule -> execute -> update until nothing is left; ``on_step(sched, step)``
    runs after each update (to add requests, abort, or propose drafts)."""
    result = DriveResult({}, {}, [])
    step = 0
    while sched.has_unfinished_requests():
        assert step < max_steps, "requests did not finish (starvation or livelock)"
        so = sched.schedule()
        check_invariants(sched, so)
        result.steps.append(so)
        outs = sched.update_from_output(so, runner.execute(so))
        for out in outs:
            result.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                result.finish_reasons[out.request_id] = out.finish_reason
        for rid, req in sched.requests.items():
            if rid in runner.states and req.num_computed_tokens:
                assert runner.states[rid].tokens == req.all_token_ids
        step += 1
        if on_step is not None:
            on_step(sched, step)
    return result


def test_fake_runner_matches_reference_for_one_request():
    sched = PagedScheduler(make_config(), num_blocks=32)
    req = make_request("a", list(range(10)), max_tokens=12)
    sched.add_request(req)
    res = drive(sched, FakeRunner(32, 4))
    assert res.outputs["a"] == reference_output(make_request("a", list(range(10)), max_tokens=12))
    assert res.finish_reasons == {"a": "length"}
    assert len(res.steps) == 12  # one prefill step, then one token per step


def test_fake_runner_detects_a_wrong_block_table():
    sched = PagedScheduler(make_config(), num_blocks=32)
    sched.add_request(make_request("a", list(range(10)), max_tokens=4))
    runner = FakeRunner(32, 4)
    so = sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    so = sched.schedule()
    runner.kv[runner.states["a"].block_ids[0]][0] = 999  # corrupt the cached prefix
    out = sched.update_from_output(so, runner.execute(so))
    expected = reference_output(make_request("a", list(range(10)), max_tokens=4))
    assert out[0].new_token_ids != expected[1:2]

"""Randomized end-to-end check of the paged schedulers against the fake model.

Each seed draws a configuration (block size, budget, chunked prefill on/off, prefix
caching on/off, pool from "one max-length request" to roomy, draft tokens on/off)
and a workload (shared prefixes, cache salts, priorities, staggered arrivals, random
aborts, drafts that are partly wrong). Every request that was not aborted must produce
exactly the tokens it produces alone; aborted ones a prefix of them; and the pool must
end empty. ``check_invariants`` (budget, max_num_seqs, block refcounts) runs every step.
"""

from __future__ import annotations

import random

import pytest
from lmkit.api.request import RequestStatus
from lmkit_plugins.schedulers.fcfs import FCFSScheduler
from lmkit_plugins.schedulers.priority import PriorityScheduler
from test_scheduler_fakes import (
    FakeRunner,
    drive,
    make_config,
    make_request,
    next_token,
    reference_output,
)


def run_trial(seed: int, cls) -> int:
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 8])
    max_model_len = rng.choice([40, 96])
    one_request = -(-max_model_len // bs) + 1  # blocks for one max-length request + null
    num_blocks = rng.choice([one_request, one_request + 2, one_request * 2, one_request * 6])
    chunked = rng.random() < 0.8
    budget = rng.choice([3, 6, 16, 40]) if chunked else max_model_len + rng.choice([0, 10])
    spec = rng.random() < 0.5
    cfg = make_config(block_size=bs, max_num_batched_tokens=budget,
                      max_num_seqs=rng.choice([1, 2, 4, 8]), max_model_len=max_model_len,
                      chunked=chunked, prefix_caching=rng.random() < 0.8,
                      spec_backend="ngram" if spec else "none", num_spec=rng.choice([1, 2, 4]))
    sched = cls(cfg, num_blocks=num_blocks)
    runner = FakeRunner(num_blocks, bs)
    shared = [rng.randrange(50) for _ in range(rng.randrange(0, 25))]
    reqs = []
    for i in range(rng.randrange(2, 14)):
        prompt = (shared if rng.random() < 0.7 else []) + [
            rng.randrange(50) for _ in range(rng.randrange(1, 20))]
        reqs.append(make_request(f"r{i}", prompt[:max_model_len - 1],
                                 max_tokens=rng.randrange(1, 30), arrival=float(i),
                                 priority=rng.randrange(3), salt=rng.choice([None, None, "s"])))
    pending, aborted = list(reqs), set()

    def on_step(s, n):
        while pending and rng.random() < 0.5:
            s.add_request(pending.pop(0))
        if s.requests and rng.random() < 0.03:
            victim = rng.choice(sorted(s.requests))
            aborted.add(victim)
            s.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
        if spec:
            k = s.num_lookahead_tokens
            for r in s.running:
                if r.num_computed_tokens == r.num_tokens - 1 and rng.random() < 0.7:
                    t = list(r.all_token_ids)
                    for _ in range(k):
                        t.append(next_token(t) if rng.random() < 0.7 else rng.randrange(1000))
                    r.spec_token_ids = t[-k:]

    outputs: dict[str, list[int]] = {}
    while pending or sched.has_unfinished_requests():
        if not sched.has_unfinished_requests():
            sched.add_request(pending.pop(0))
        for rid, toks in drive(sched, runner, on_step=on_step).outputs.items():
            outputs.setdefault(rid, []).extend(toks)
    for r in reqs:
        got, want = outputs.get(r.request_id, []), reference_output(r, max_model_len)
        if r.request_id in aborted:
            assert got == want[:len(got)], (seed, r.request_id)
        else:
            assert got == want, (seed, r.request_id)
    assert sched.kv_cache_manager.usage == 0.0
    return sched.num_preemptions


@pytest.mark.parametrize("cls", [FCFSScheduler, PriorityScheduler])
def test_random_configs_and_workloads_give_the_tokens_of_a_lone_run(cls):
    num_preemptions = sum(run_trial(seed, cls) for seed in range(60))
    assert num_preemptions > 20  # the small pools did force preemptions

"""The fair-share policy, driven with lmkit's deterministic fake model runner."""

from __future__ import annotations

import pytest
from lmkit.api import LMKitConfig, Request, SamplingParams
from lmkit.testing.fake_runner import FakeRunner
from lmkit_fair_scheduler.plugin import FairShareOptions
from lmkit_fair_scheduler.scheduler import FairShareScheduler

NUM_BLOCKS = 512


def make(max_num_seqs=2, budget=64, num_blocks=NUM_BLOCKS, **options):
    config = LMKitConfig.model_validate({
        "model": {"max_model_len": 256}, "cache": {"block_size": 4},
        "scheduler": {"max_num_batched_tokens": budget, "max_num_seqs": max_num_seqs}})
    return FairShareScheduler(config, num_blocks, FairShareOptions(**options))


class Sim:
    """Steps a scheduler with the fake runner; records admissions and tokens by tenant."""

    def __init__(self, sched, num_blocks=NUM_BLOCKS):
        self.sched, self.runner = sched, FakeRunner(num_blocks, 4)
        self.admitted: list[str] = []
        self.tokens: dict[str, int] = {}
        self.clock = 0

    def add(self, rid, tenant, prompt_len=8, max_tokens=4):
        self.clock += 1
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.sched.add_request(Request(rid, list(range(self.clock, self.clock + prompt_len)),
                                       params, arrival_time=float(self.clock), cache_salt=tenant))

    def step(self):
        so = self.sched.schedule()
        self.admitted += [n.req_id for n in so.scheduled_new_reqs]
        for rid, n in so.num_scheduled_tokens.items():
            tenant = rid.split("-")[0]
            self.tokens[tenant] = self.tokens.get(tenant, 0) + n
        self.sched.update_from_output(so, self.runner.execute(so))
        return so


def test_a_late_tenant_is_not_stuck_behind_an_early_burst():
    sim = Sim(make())
    for i in range(20):
        sim.add(f"a-{i}", "a")
    for _ in range(3):
        sim.step()
    sim.add("b-0", "b")
    sim.add("b-1", "b")
    while sim.sched.has_unfinished_requests():
        sim.step()
    order = sim.admitted
    # first come, first served would admit all twenty of a's requests first
    assert order.index("b-0") < order.index("a-6")
    assert order.index("b-1") < order.index("a-8")


def test_weights_split_tokens_while_both_tenants_are_busy():
    sim = Sim(make(max_num_seqs=1, weights={"a": 3.0}))
    for i in range(60):
        sim.add(f"a-{i}", "a")
        sim.add(f"b-{i}", "b")
    for _ in range(200):
        sim.step()
    ratio = sim.tokens["a"] / sim.tokens["b"]
    assert 2.5 <= ratio <= 3.5, sim.tokens


def test_equal_tenants_alternate():
    sim = Sim(make(max_num_seqs=1))
    for i in range(10):
        sim.add(f"a-{i}", "a")
    for i in range(10):
        sim.add(f"b-{i}", "b")
    while sim.sched.has_unfinished_requests():
        sim.step()
    tenants = [rid[0] for rid in sim.admitted]
    assert tenants[:8] == ["a", "b"] * 4


def test_an_idle_tenant_earns_no_credit():
    sim = Sim(make(max_num_seqs=1))
    for i in range(30):
        sim.add(f"a-{i}", "a")
    for _ in range(60):
        sim.step()
    served_before = len(sim.admitted)
    for i in range(10):
        sim.add(f"b-{i}", "b")
    for _ in range(60):
        sim.step()
    after = [rid[0] for rid in sim.admitted[served_before:]][:10]
    # without start-time fairness b would take all ten admissions to catch up on a's service
    assert after.count("a") >= 4, after


def test_preemption_takes_from_the_most_served_tenant():
    sched = make(max_num_seqs=8, budget=256, num_blocks=25)
    sim = Sim(sched, num_blocks=25)
    for i in range(3):
        sim.add(f"a-{i}", "a", prompt_len=20, max_tokens=12)
    sim.step()
    sim.add("b-0", "b", prompt_len=8, max_tokens=12)
    preempted = set()
    while sched.has_unfinished_requests():
        preempted |= sim.step().preempted_req_ids
    assert preempted and all(rid.startswith("a-") for rid in preempted)


def test_tenant_comes_from_priority_or_extra_and_weights_must_be_positive():
    sched = make(tenant_from="priority")
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=2), priority=3)
    assert sched.ledger.tenant_of(req) == "3"
    tagged = Request("t", [1, 2], SamplingParams(max_tokens=2))
    tagged.extra["tenant"] = "acme"
    assert sched.ledger.tenant_of(tagged) == "acme"
    assert make().ledger.tenant_of(Request("u", [1], SamplingParams())) == "default"
    with pytest.raises(ValueError, match="weights must be positive"):
        FairShareOptions(weights={"a": 0})
    sim = Sim(sched)
    sim.add("a-0", "a")
    sim.step()
    assert sched.get_stats()["tenant_service"] == {"0": 8.0}

"""The engine core's proposer manager (eligibility, validation, draft distributions,
forgetting requests), the speculative-decoding counters and their Prometheus series."""

from __future__ import annotations

import pytest
import torch
from lmkit.api import Caps, Proposal, Spec, SpecProposer
from lmkit.api.outputs import EngineCoreOutput
from lmkit.api.request import Request, RequestStatus
from lmkit.api.runner_output import ModelRunnerOutput
from lmkit.api.sampling_params import SamplingParams
from lmkit.api.scheduler_output import SchedulerOutput
from lmkit.config.schema import LMKitConfig
from lmkit.errors import ConfigError, PluginError
from lmkit.plugin_host.registry import Registration
from lmkit.plugin_host.resolve import ResolvedStack
from lmkit.spec_decode.manager import ProposerManager, check_runner_hosted
from lmkit.spec_decode.stats import SpecDecodeStats

K = 3


class Recorder(SpecProposer):
    """Drafts ``[7] * k`` (or what ``reply`` says) and records every call."""

    def __init__(self, config=None, options=None):
        self.calls, self.removed, self.reply = [], [], None

    def propose(self, batch):
        self.calls.append(batch)
        if self.reply is not None:
            return self.reply
        return Proposal([[7] * batch.num_spec_tokens for _ in batch.req_ids])

    def remove_requests(self, req_ids):
        self.removed.append(set(req_ids))


def decoding(rid: str, **params) -> Request:
    """A running request that has just got its first output token."""
    req = Request(rid, [1, 2, 3], SamplingParams(**{"max_tokens": 10, **params}))
    req.status = RequestStatus.RUNNING
    req.append_output_token_ids([4])
    req.num_computed_tokens = 3
    return req


def out(rid: str, tokens=(4,), finish=None) -> EngineCoreOutput:
    return EngineCoreOutput(request_id=rid, new_token_ids=list(tokens), finish_reason=finish)


def manager(*requests: Request) -> tuple[ProposerManager, Recorder]:
    proposer = Recorder()
    m = ProposerManager(proposer, "recorder", K, vocab_size=100)
    for r in requests:
        m.add_request(r)
    return m, proposer


def test_drafts_go_to_decoding_requests_that_may_speculate():
    ok = decoding("ok")
    opted_out = decoding("opted-out", use_spec_decode=False)
    grammar = decoding("grammar", structured_outputs={"regex": "a+"})  # speculates too
    prefilling = decoding("prefilling")
    prefilling.num_computed_tokens = 1
    last_token = decoding("last", max_tokens=2)  # one more token to go: nothing to draft
    reqs = [ok, grammar, opted_out, prefilling, last_token]
    m, proposer = manager(*reqs)
    m.after_step(SchedulerOutput(), ModelRunnerOutput(), [out(r.request_id) for r in reqs])
    (call,) = proposer.calls
    assert call.req_ids == ["ok", "grammar"] and call.token_ids == [[1, 2, 3, 4]] * 2
    assert call.num_new_tokens == [4, 4] and call.num_spec_tokens == K
    assert ok.spec_token_ids == grammar.spec_token_ids == [7, 7, 7]
    assert all(r.spec_token_ids == [] for r in reqs[2:])
    assert m.get_stats()["spec_num_proposed_tokens"] == 6
    # the next step tells the proposer only the newly accepted tokens
    ok.append_output_token_ids([5, 6])
    ok.num_computed_tokens = ok.num_tokens - 1
    m.after_step(SchedulerOutput(), ModelRunnerOutput(), [out("ok", (5, 6))])
    assert proposer.calls[-1].num_new_tokens == [2]


def test_finished_aborted_and_preempted_requests_are_forgotten():
    a, b, c = decoding("a"), decoding("b"), decoding("c")
    m, proposer = manager(a, b, c)
    so = SchedulerOutput(preempted_req_ids={"c"})
    m.after_step(so, ModelRunnerOutput(), [out("a", finish="stop"), out("b")])
    assert "a" not in m.requests and proposer.removed == [{"a"}, {"c"}]
    assert "c" in m.requests  # preempted: comes back later
    m.remove_requests(["b", "never-seen"])
    assert set(m.requests) == {"c"} and proposer.removed[-1] == {"b"}


def test_malformed_proposals_are_plugin_errors_and_drafts_are_cut_to_k():
    m, proposer = manager(decoding("a"), decoding("b"))
    proposer.reply = Proposal([[1]])
    with pytest.raises(PluginError, match="1 draft lists for 2 requests"):
        m.after_step(SchedulerOutput(), ModelRunnerOutput(), [out("a"), out("b")])
    proposer.reply = Proposal([[1], [100]])
    with pytest.raises(PluginError, match="token id 100, outside the model's vocabulary"):
        m.after_step(SchedulerOutput(), ModelRunnerOutput(), [out("a"), out("b")])
    proposer.reply = Proposal([[1, 2, 3, 4, 5], []])
    m.after_step(SchedulerOutput(), ModelRunnerOutput(), [out("a"), out("b")])
    assert m.requests["a"].spec_token_ids == [1, 2, 3] and m.requests["b"].spec_token_ids == []


def test_draft_distributions_follow_the_scheduled_drafts():
    a = decoding("a")
    m, proposer = manager(a)
    probs = torch.full((K, 100), 0.01)
    proposer.reply = Proposal([[1, 2, 3]], [probs])
    m.after_step(SchedulerOutput(), ModelRunnerOutput(), [out("a")])
    so = SchedulerOutput(scheduled_spec_decode_tokens={"a": [1, 2]})  # the budget cut one
    m.before_execute(so)
    assert so.spec_draft_probs["a"].shape == (2, 100)
    assert m.draft_probs == {}  # handed over once


def test_runner_hosted_proposers_take_the_runner_drafts():
    """A proposer declaring hidden_states is not built in the engine core: its drafts
    come in the runner's output, and are kept only for requests that may speculate."""
    cfg = LMKitConfig.model_validate({"speculative": {"backend": "eagle",
                                                      "num_speculative_tokens": K}})
    spec = Spec(name="eagle", target=lambda: Recorder, caps=Caps({"hidden_states"}))
    stack = ResolvedStack("cpu", "float32", {"speculative": Registration(
        kind="speculative", spec=spec, plugin="test")}, {"speculative": None})
    m = ProposerManager.from_stack(cfg, stack, 100)
    assert m is not None and m.proposer is None
    assert ProposerManager.from_stack(cfg, ResolvedStack("cpu", "float32"), 100) is None
    a, b = decoding("a"), decoding("b", use_spec_decode=False)
    for r in (a, b):
        m.add_request(r)
    m.after_step(SchedulerOutput(num_scheduled_tokens={"a": 1, "b": 1}),
                 ModelRunnerOutput(draft_token_ids={"a": [7, 8, 9, 10], "b": [1]}),
                 [EngineCoreOutput("a", [3], None), EngineCoreOutput("b", [5], None)])
    assert a.spec_token_ids == [7, 8, 9] and b.spec_token_ids == []  # k = 3; b opted out
    with pytest.raises(PluginError, match="outside the model's vocabulary"):
        m.after_step(SchedulerOutput(num_scheduled_tokens={"a": 1}),
                     ModelRunnerOutput(draft_token_ids={"a": [100]}),
                     [EngineCoreOutput("a", [3], None)])
    # under tensor parallelism every rank's runner hosts the head
    # (tests/unit/eagle/test_spec_eagle_tp.py)
    tp = LMKitConfig.model_validate({"speculative": {"backend": "eagle"},
                                     "parallel": {"tensor_parallel_size": 2}})
    assert ProposerManager.from_stack(tp, stack, 100) is not None
    tp_offload = LMKitConfig.model_validate({"speculative": {"backend": "eagle"},
                                             "parallel": {"tensor_parallel_size": 2},
                                             "offload": {"backend": "cpu"}})
    tier = Registration(kind="offload", spec=Spec(name="cpu", target=lambda: None,
                                                  caps=Caps(set())), plugin="test")
    with_tier = ResolvedStack("cpu", "float32", {**stack.entries, "offload": tier},
                              {**stack.options, "offload": None})
    with pytest.raises(ConfigError, match=r"each rank holds 1/2 of the target's KV heads"):
        check_runner_hosted(tp_offload, with_tier)
    check_runner_hosted(tp, stack)  # no tier: fine
    # on one rank a KV offload tier carries the head's blocks
    # (tests/unit/eagle/test_spec_eagle_offload.py)
    offload = LMKitConfig.model_validate({"speculative": {"backend": "eagle"},
                                          "offload": {"backend": "cpu"}})
    check_runner_hosted(offload, with_tier)
    assert ProposerManager.from_stack(offload, stack, 100) is not None


def test_counters_rates_and_per_position_acceptance():
    stats = SpecDecodeStats(3)
    assert stats.as_dict()["spec_mean_accepted_length"] == 0.0
    stats.record_step({"a": 3, "b": 2, "c": 0}, {"a": 3, "b": 0})
    stats.record_step({"a": 3}, {"a": 1})
    d = stats.as_dict()
    assert d["spec_num_verifications"] == 3 and d["spec_num_draft_tokens"] == 8
    assert d["spec_num_accepted_tokens"] == 4
    assert d["spec_acceptance_rate"] == pytest.approx(0.5)
    assert d["spec_mean_accepted_length"] == pytest.approx(1 + 4 / 3)
    assert d["spec_acceptance_rate_pos_0"] == pytest.approx(2 / 3)
    assert d["spec_acceptance_rate_pos_1"] == pytest.approx(1 / 3)
    assert d["spec_acceptance_rate_pos_2"] == pytest.approx(1 / 2)


def test_prometheus_series():
    pytest.importorskip("prometheus_client")
    from lmkit.engine.messages import numeric_stats
    from lmkit.serve.metrics import ServerMetrics

    stats = SpecDecodeStats(2)
    stats.record_step({"a": 2}, {"a": 1})
    metrics = ServerMetrics(lambda: [numeric_stats(stats.as_dict())])  # one engine
    text = metrics.render()[0].decode()
    assert 'lmkit_spec_decode_num_draft_tokens_total{engine="0"} 2.0' in text
    assert 'lmkit_spec_decode_num_accepted_tokens_total{engine="0"} 1.0' in text
    assert 'lmkit_spec_decode_acceptance_rate{engine="0"} 0.5' in text
    assert 'lmkit_spec_decode_mean_accepted_length{engine="0"} 2.0' in text
    assert ('lmkit_spec_decode_acceptance_rate_per_position{engine="0",position="0"} 1.0'
            in text)
    assert ('lmkit_spec_decode_acceptance_rate_per_position{engine="0",position="1"} 0.0'
            in text)
    assert "lmkit_spec_decode_adaptive" not in text  # only with speculative.adaptive


def test_prometheus_series_of_adaptive_speculation():
    pytest.importorskip("prometheus_client")
    from lmkit.engine.messages import numeric_stats
    from lmkit.serve.metrics import ServerMetrics
    from lmkit.spec_decode.adaptive import AdaptiveSpeculation

    switch = AdaptiveSpeculation(probe_steps=1, hold_steps=10)
    switch.record(True, 1, 0.004)
    switch.record(False, 1, 0.001)  # plain faster: held off
    metrics = ServerMetrics(lambda: [numeric_stats(switch.stats())])
    text = metrics.render()[0].decode()
    assert 'lmkit_spec_decode_adaptive_drafting{engine="0"} 0.0' in text
    assert 'lmkit_spec_decode_adaptive_probes_total{engine="0"} 1.0' in text

"""The msgspec wire form of SchedulerOutput / ModelRunnerOutput (the multiprocess
executor's channel): every field round-trips, tensors included, and nothing is pickled."""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest
import torch
from lmkit.api import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    PoolingParams,
    SamplingParams,
    SchedulerOutput,
    TokenLogprob,
)
from lmkit.offload.transfers import KVTransfers, LoadRequest
from lmkit.worker.step_codec import (
    RunnerOutputWire,
    SchedulerOutputWire,
    runner_output_from_wire,
    runner_output_to_wire,
    scheduler_output_from_wire,
    scheduler_output_to_wire,
)


def _round_trip(value, wire_type):
    data = msgspec.msgpack.encode(value)
    return msgspec.msgpack.decode(data, type=wire_type)


def _full_scheduler_output() -> SchedulerOutput:
    params = SamplingParams(temperature=0.7, top_k=5, seed=3, logit_bias={7: -1.5},
                            stop=["x"], logprobs=2, structured_outputs={"regex": "a+"},
                            allowed_token_ids=[1, 7, 9], bad_words=["bad"],
                            bad_words_token_ids=[[5, 6]])
    return SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", [1, 2, 3], [4], params, [0, 1], 2, 9),
                            NewRequestData("e", [1, 2], [], SamplingParams(), [2], 0, None,
                                           PoolingParams("mean", False, 8))],
        scheduled_cached_reqs=CachedRequestData(["b", "c"], [[5], []], [10, 11]),
        num_scheduled_tokens={"a": 2, "b": 1, "c": 3},
        total_num_scheduled_tokens=6,
        scheduled_spec_decode_tokens={"c": [8, 9]},
        spec_draft_probs={"c": torch.rand(2, 16)},
        finished_req_ids={"z", "y"},
        preempted_req_ids={"p"},
        structured_output_request_ids={"a": 0},
        grammar_bitmask=torch.tensor([[-1, 5]], dtype=torch.int32),
        kv_transfers=KVTransfers([b"h1"], [3], [LoadRequest(4, [b"h2", b"h3"], [6, 7], True)],
                                 [b"w"], [8], fence=True),
        spec_drafting=False,  # not the default: the round trip must carry it
    )


def _assert_same(got, want):
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if f.name == "spec_draft_probs":
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        elif f.name == "grammar_bitmask":
            assert torch.equal(a, b) and a.dtype == b.dtype
        else:
            assert a == b, f.name


def test_scheduler_output_round_trips_every_field():
    so = _full_scheduler_output()
    back = scheduler_output_from_wire(_round_trip(scheduler_output_to_wire(so),
                                                  SchedulerOutputWire))
    _assert_same(back, so)


def test_every_scheduler_output_field_is_on_the_wire():
    # a field added to SchedulerOutput must be added to the wire form too
    names = {f.name for f in dataclasses.fields(SchedulerOutput)}
    wire = set(SchedulerOutputWire.__struct_fields__)
    assert names - {"scheduled_cached_reqs"} <= wire
    assert {f.name for f in dataclasses.fields(ModelRunnerOutput)} == set(
        RunnerOutputWire.__struct_fields__)


def test_empty_scheduler_output_and_numpy_bitmask():
    so = SchedulerOutput(grammar_bitmask=np.arange(6, dtype=np.int32).reshape(2, 3))
    back = scheduler_output_from_wire(_round_trip(scheduler_output_to_wire(so),
                                                  SchedulerOutputWire))
    assert isinstance(back.grammar_bitmask, np.ndarray)
    assert (back.grammar_bitmask == so.grammar_bitmask).all()
    assert back.kv_transfers is None and back.total_num_scheduled_tokens == 0


def test_runner_output_round_trips():
    lp = TokenLogprob(5, -0.25, 1, [(5, -0.25), (2, -1.0)])
    out = ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[[5], []],
                            logprobs=[[lp], []], prompt_logprobs={"a": [None, lp]},
                            num_draft_tokens={"a": 2}, num_accepted_tokens={"a": 1},
                            finished_kv_loads={4: True, 5: False},
                            pooled={"e": [0.5, -1.0], "f": [[1.0], [2.0]]},
                            draft_token_ids={"a": [7, 8, 9]})
    back = runner_output_from_wire(_round_trip(runner_output_to_wire(out), RunnerOutputWire))
    assert back == out


def test_a_foreign_message_is_rejected_not_executed():
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"req_ids": "no"}), type=RunnerOutputWire)


def test_model_facts_cross_a_worker_handshake_as_json(tmp_path):
    """The mp/ray workers get the engine's ModelFacts in their JSON handshake."""
    import json

    from lmkit.loading.model_facts import load_model_facts
    from lmkit.plugin_host.manager import PluginHost
    from lmkit.testing.tiny_model import make_tiny_model
    from lmkit_plugins.executors.mp_messages import facts_from_json, facts_to_json

    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    facts = load_model_facts(make_tiny_model(tmp_path / "tiny"), host, 64)
    assert facts_from_json(json.loads(json.dumps(facts_to_json(facts)))) == facts

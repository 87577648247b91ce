"""The engine-core channel's messages: typed msgpack round trips, no pickle, validation
on decode."""

from __future__ import annotations

import pickle

import msgspec
import pytest
from lmkit.api.outputs import EngineCoreOutput, TokenLogprob
from lmkit.api.request import Request
from lmkit.api.sampling_params import SamplingParams
from lmkit.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineOutputs,
    EngineReady,
    EngineStats,
    RequestRejected,
    Shutdown,
    StatsQuery,
    make_encoder,
    make_engine_decoder,
    make_frontend_decoder,
    numeric_stats,
)


def test_add_request_round_trips_the_request():
    params = SamplingParams(n=1, temperature=0.7, top_k=5, logit_bias={42: -3.0}, seed=9,
                            stop=["\n\n"], stop_token_ids=[2], max_tokens=12, logprobs=3)
    req = Request("r1", [1, 2, 3], params, eos_token_id=2, priority=4, cache_salt="s",
                  max_tokens=12)
    wire = make_encoder().encode(AddRequest.from_request(req))
    back = make_engine_decoder().decode(wire)
    assert isinstance(back, AddRequest)
    rebuilt = back.to_request()
    assert rebuilt.request_id == "r1" and rebuilt.prompt_token_ids == [1, 2, 3]
    assert rebuilt.sampling_params == params
    assert rebuilt.sampling_params.logit_bias == {42: -3.0}  # int keys survive
    assert (rebuilt.eos_token_id, rebuilt.priority, rebuilt.cache_salt, rebuilt.max_tokens) == (
        2, 4, "s", 12)
    assert rebuilt.arrival_time == req.arrival_time


@pytest.mark.parametrize("message", [
    AbortRequests(request_ids=["a", "b"]), StatsQuery(query_id=7), Shutdown(),
])
def test_control_messages_round_trip(message):
    assert make_engine_decoder().decode(make_encoder().encode(message)) == message


def test_outputs_and_replies_round_trip():
    out = EngineCoreOutput("r", [5, 6], finish_reason="stop", stop_reason=6,
                           new_logprobs=[TokenLogprob(5, -0.1, 1, [(5, -0.1), (7, -2.5)])],
                           num_cached_tokens=16)
    dec = make_frontend_decoder()
    enc = make_encoder()
    got = dec.decode(enc.encode(EngineOutputs(outputs=[out])))
    assert got.outputs == [out]
    ready = EngineReady(model_dir="/m", max_model_len=2048, vocab_size=100,
                        stack={"device": "cpu"}, plugins=[{"name": "x"}], stats={"a": 1.0})
    assert dec.decode(enc.encode(ready)) == ready
    rej = RequestRejected(request_id="r", message="bad", param="prompt", code="c")
    assert dec.decode(enc.encode(rej)) == rej
    assert dec.decode(enc.encode(EngineStats(stats={"x": 2.0}, query_id=3))).query_id == 3


def test_decoding_validates_sampling_params():
    bad = make_encoder().encode({"type": "add", "request_id": "r", "prompt_token_ids": [1],
                                 "sampling_params": {"n": 0}, "eos_token_id": None,
                                 "arrival_time": 0.0})
    with pytest.raises(msgspec.ValidationError, match="n must be"):
        make_engine_decoder().decode(bad)


def test_pickle_and_unknown_messages_are_refused():
    dec = make_engine_decoder()
    with pytest.raises(msgspec.DecodeError):
        dec.decode(pickle.dumps(Shutdown))
    with pytest.raises(msgspec.ValidationError):
        dec.decode(make_encoder().encode({"type": "exec", "code": "print(1)"}))
    # a frontend-bound message is not something the engine accepts
    with pytest.raises(msgspec.ValidationError):
        dec.decode(make_encoder().encode(EngineStats(stats={})))


def test_numeric_stats_keeps_numbers_only():
    assert numeric_stats({"a": 1, "b": 0.5, "c": "x", "d": True}) == {"a": 1.0, "b": 0.5,
                                                                     "d": 1.0}

"""Requests that are cheap to send but would make every other request wait, against a
live server on the tiny random Llama with the byte tokenizer (one token per byte):

- past a per-request bound (stop strings, bad words, token-id lists, logit_bias,
  counted repetitions in a constraint) they are refused with 400 naming the field,
  before anything reaches the engine process;
- at the bounds they are served, and a stop string is still found among the most stop
  strings a request may have, streamed and not.
"""

from __future__ import annotations

import httpx
import pytest
from lmkit.api.sampling_params import (
    MAX_BAD_WORDS,
    MAX_STOP_STRINGS,
    MAX_TOKEN_IDS,
)
from lmkit.config.schema import LMKitConfig
from serve_live import LiveServer, record_engine_messages
from test_serve_lifecycle import read_stream

pytestmark = pytest.mark.slow  # a live server (a few seconds to start)

MODEL = "tiny"
A = ord("a")  # the byte tokenizer's token for "a"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from lmkit.testing.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("tiny-hostile"), vocab_size=4096)
    config = LMKitConfig.model_validate({
        "model": {"model": str(path), "max_model_len": 256},
        "scheduler": {"max_num_seqs": 8},
        "server": {"served_model_name": MODEL},
    })
    with LiveServer(config) as live:
        yield live


def body(**fields):
    return {"model": MODEL, "prompt": "hello", "max_tokens": 8, **fields}


HOSTILE = [
    (body(stop=["c" * 3999 + chr(0x100 + i) for i in range(100)]), "stop", "invalid_value"),
    (body(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]), "stop", "invalid_value"),
    (body(bad_words=[f"w{i}" for i in range(20_000)]), "bad_words", "invalid_value"),
    (body(allowed_token_ids=list(range(4096)) * 10), "allowed_token_ids", "invalid_value"),
    (body(stop_token_ids=list(range(4096))), "stop_token_ids", "invalid_value"),
    (body(logit_bias={str(i): 1 for i in range(4096)}), "logit_bias", "invalid_value"),
    (body(structured_outputs={"json": {"type": "string", "pattern": "^[a-z]{0,30000}$"}}),
     "structured_outputs", "constraint_too_complex"),
    (body(structured_outputs={"regex": "^([a-z]{1,30}){1,30}$"}), "structured_outputs",
     "constraint_too_complex"),
]


def test_requests_past_a_bound_are_refused_before_the_engine(server, monkeypatch):
    sent = record_engine_messages(server, monkeypatch)
    with httpx.Client(timeout=60) as http:
        for hostile, param, code in HOSTILE:
            resp = http.post(f"{server.url}/v1/completions", json=hostile)
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert (error["param"], error["code"]) == (param, code), error
            assert "at most" in error["message"]
    assert sent == []  # none reached the engine
    ok = httpx.post(f"{server.url}/v1/completions", json=body(), timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_the_most_stop_strings_still_stop_the_output(server, stream):
    """Output forced to "aaaa..." (logit_bias), the matching stop string last among the
    most a request may have, each of the others starting like it."""
    others = [f"a{chr(0x100 + i)}" for i in range(MAX_STOP_STRINGS - 1)]
    request = body(max_tokens=64, temperature=0, n=2, logit_bias={str(A): 100},
                   stop=[*others, "a" * 40], bad_words=[f"w{i}" for i in range(MAX_BAD_WORDS)],
                   allowed_token_ids=list(range(MAX_TOKEN_IDS)), include_stop_str_in_output=True)
    if stream:
        status, events, done = read_stream(server.url, {**request, "stream": True})
        assert status == 200 and done
        texts = ["".join(c["text"] for e in events for c in e["choices"] if c["index"] == i)
                 for i in range(2)]
        reasons = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    else:
        resp = httpx.post(f"{server.url}/v1/completions", json=request, timeout=60)
        assert resp.status_code == 200, resp.text
        texts = [c["text"] for c in resp.json()["choices"]]
        reasons = [c["finish_reason"] for c in resp.json()["choices"]]
    assert texts == ["a" * 40] * 2 and reasons == ["stop"] * 2

"""Hostile requests against a live server on loopback (issue 25): a fan-out request
refused at once while a normal request is served, bad values answered with 4xx (and a
500) without dropping the keep-alive connection, and costly or endless constraints
refused before the engine works on them. Served by the tiny random Llama of
the integration conftest (SmolLM2's tokenizer, fast to load)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from lmkit.config.schema import LMKitConfig
from serve_live import LiveServer, record_engine_messages
from test_serve_lifecycle import read_stream

# alone: refusals are timed (under a second) while the server streams another request
pytestmark = [pytest.mark.slow, pytest.mark.alone]

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_dir):
    config = LMKitConfig.model_validate({
        "model": {"model": str(tiny_dir), "max_model_len": 2048},
        "scheduler": {"max_num_seqs": 8},
        "server": {"served_model_name": MODEL, "max_queued_requests": 24},
    })
    with LiveServer(config) as live:
        yield live


def post(http, server, body, path="/v1/completions"):
    """(response, seconds) of one POST; ``body`` may be raw text (lone surrogates)."""
    content = body if isinstance(body, str) else json.dumps(body)
    start = time.monotonic()
    resp = http.post(f"{server.url}{path}", content=content.encode(),
                     headers={"content-type": "application/json"})
    return resp, time.monotonic() - start


def local_port(resp) -> int:
    """The client-side port of the connection that carried ``resp``."""
    return resp.extensions["network_stream"].get_extra_info("client_addr")[1]


def test_fan_out_is_refused_at_once_while_a_normal_request_is_served(server):
    normal = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1500,
              "ignore_eos": True, "temperature": 0, "stream": True}
    result: dict[str, object] = {}
    worker = threading.Thread(target=lambda: result.update(out=read_stream(server.url, normal)))
    worker.start()
    deadline = time.monotonic() + 30
    # long enough to be seen running: the engine pushes its stats every 0.5 s
    while server.engine_stats().get("num_running") != 1:
        assert time.monotonic() < deadline, "the normal request never started"
        time.sleep(0.02)
    hostile = [
        {"model": MODEL, "prompt": [[1000 + i % 40000] for i in range(190_000)]},  # ~1.7 MB
        {"model": MODEL, "prompt": ["hi"] * 1500, "n": 128},
        {"model": MODEL, "prompt": [f"p{i}" for i in range(33)]},  # just past 8 + 24
    ]
    with httpx.Client(timeout=60) as http:
        for body in hostile:
            resp, seconds = post(http, server, body)
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"]["code"] == "too_many_sequences"
            assert seconds < 1.0, f"refused after {seconds:.2f}s"
    assert worker.is_alive() or result, "the normal request ended before the refusals"
    worker.join(120)
    status, events, done = result["out"]  # type: ignore[misc]
    assert status == 200 and done
    assert sum(len(c["text"]) > 0 for e in events for c in e["choices"]) > 0
    assert server.state.llm.output_processor.has_unfinished() is False


def test_bad_values_are_4xx_and_the_connection_stays_open(server, monkeypatch):
    good = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    bad = [
        ({"model": MODEL, "prompt": "x", "seed": 2**70}, "invalid_value"),
        ({"model": MODEL, "prompt": "x", "priority": 2**70}, "invalid_value"),
        ({"model": MODEL, "prompt": "x", "top_k": 2**70}, "invalid_value"),
        ({"model": MODEL, "prompt": "x", "logit_bias": {str(2**70): 1}}, "invalid_value"),
        ('{"model": "tiny", "prompt": "x\\ud800"}', "invalid_unicode"),
        ('{"model": "tiny", "prompt": "x", "stop": ["\\udc00"]}', "invalid_unicode"),
        ("", "missing_body"),
    ]
    with httpx.Client(timeout=60) as http:
        first, _ = post(http, server, good)
        port = local_port(first)
        for body, code in bad:
            resp, _ = post(http, server, body)
            assert resp.status_code == 400 and resp.json()["error"]["code"] == code, resp.text
            again, _ = post(http, server, good)
            assert again.status_code == 200 and local_port(again) == port
        # an unexpected failure in a handler: a 500, and the connection still serves
        llm = server.state.llm

        def broken(*args, **kwargs):
            raise RuntimeError("tokenizer exploded")

        monkeypatch.setattr(llm.input_processor, "tokenize", broken)
        resp, _ = post(http, server, good)
        assert resp.status_code == 500 and resp.json()["error"]["code"] == "internal_error"
        monkeypatch.undo()
        again, _ = post(http, server, good)
        assert again.status_code == 200 and local_port(again) == port


def test_costly_or_endless_requests_are_refused_before_the_engine(server, monkeypatch):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    cases = [
        ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema",
         "json_schema": {"name": "loop", "schema": {"$ref": "#"}}}}, "invalid_value"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4,
                             "structured_outputs": {"regex": "(ab|cd)" * 30_000}},
         "constraint_too_large"),
        ("/v1/chat/completions", {**chat, "max_tokens": None, "min_tokens": 10**9},
         "invalid_value"),
    ]
    sent = record_engine_messages(server, monkeypatch)
    with httpx.Client(timeout=60) as http:
        for path, body, code in cases:
            resp, seconds = post(http, server, body, path)
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"]["code"] == code and seconds < 1.0
    assert sent == []  # none reached the engine

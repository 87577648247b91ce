"""Structured output through a live server (SmolLM2, CPU, engine core in its own
process): OpenAI ``response_format`` and the ``structured_outputs`` extension through the
official client, bad constraints answered 400 (the server keeps serving), and a schema
too slow to compile refused while other requests run."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import jsonschema
import openai
import pytest
from lmkit.config.schema import LMKitConfig
from serve_live import LiveServer

pytestmark = pytest.mark.slow  # a live server per module (about 10 s to start)

pytest.importorskip("xgrammar")

MODEL = "smol"
COMPILE_TIMEOUT_S = 1.0  # PERSON compiles in ~0.06 s idle, SLOW in ~3 s (2-core CPU)
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
# 30 string patterns: seconds of xgrammar compilation, far past COMPILE_TIMEOUT_S
SLOW = {"type": "object", "required": [f"field_{i}" for i in range(30)], "properties": {
    f"field_{i}": {"type": "string", "pattern": f"[a-z]{{2,40}}@[a-z]{{2,30}}\\.(com|io{i})"}
    for i in range(30)}}


@pytest.fixture(scope="module")
def server(smollm2_dir):
    config = LMKitConfig.model_validate({
        "model": {"model": str(smollm2_dir)},
        "scheduler": {"max_num_seqs": 8},
        "structured_output": {"compile_timeout_s": COMPILE_TIMEOUT_S},
        "server": {"served_model_name": MODEL},
    })
    with LiveServer(config) as live:
        yield live


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                         timeout=120)


def user(text):
    return [{"role": "user", "content": text}]


def post(server, path, body, **kw):
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=120, **kw)


def test_response_format_json_schema_and_json_object(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=user("Describe a person as JSON."), temperature=0, max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {
            "name": "person", "schema": PERSON, "strict": True}})
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    resp = client.chat.completions.create(
        model=MODEL, messages=user("Give me a JSON object about cats."), temperature=0.7,
        seed=2, max_tokens=80, response_format={"type": "json_object"})
    # (seed 1 samples a string that repeats until max_tokens under xgrammar 0.2.9)
    assert resp.choices[0].finish_reason == "stop", resp.choices[0].message.content
    assert isinstance(json.loads(resp.choices[0].message.content), dict)


def test_structured_outputs_extension_on_chat_and_completions(client):
    colors = ["red", "green", "blue"]
    resp = client.chat.completions.create(
        model=MODEL, messages=user("Name a color."), max_tokens=8, n=3, temperature=1.0,
        seed=2, extra_body={"structured_outputs": {"choice": colors}})
    assert all(c.message.content in colors for c in resp.choices)
    resp = client.completions.create(
        model=MODEL, prompt="My phone number is ", max_tokens=16, temperature=0,
        extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", resp.choices[0].text)
    resp = client.completions.create(
        model=MODEL, prompt="Answer: ", max_tokens=8, temperature=0,
        extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}})
    assert resp.choices[0].text in ("yes", "no")


def test_streamed_json_validates(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=user("Describe a person as JSON."), temperature=0, max_tokens=80,
        stream=True, response_format={"type": "json_schema", "json_schema": {
            "name": "person", "schema": PERSON}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize(("constraint", "param", "message"), [
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs",
     "parenthesis is not closed"),
    ({"structured_outputs": {"json": {"type": "no-such-type"}}}, "structured_outputs",
     'Unsupported type "no-such-type"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "structured_outputs", "uniqueItems"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs",
     "EBNF parser error"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one constraint"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "needs json_schema.schema"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs.xml", "unrecognized"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_constraints_are_400_and_the_server_keeps_serving(server, constraint, param,
                                                               message, stream):
    resp = post(server, "/v1/chat/completions",
                {"messages": user("hi"), "max_tokens": 4, "stream": stream, **constraint})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert message in error["message"]
    ok = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    assert ok.status_code == 200


def test_a_schema_too_slow_to_compile_is_refused_without_stalling_others(server):
    slow: dict = {}

    def send_slow():
        started = time.monotonic()
        slow["resp"] = post(server, "/v1/chat/completions", {
            "messages": user("hi"), "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s",
                                                                       "schema": SLOW}}})
        slow["elapsed"] = time.monotonic() - started

    thread = threading.Thread(target=send_slow)
    thread.start()
    time.sleep(0.05)
    other = post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 16,
                                             "temperature": 0})
    assert other.status_code == 200 and other.json()["usage"]["completion_tokens"] == 16
    thread.join(60)
    assert slow["resp"].status_code == 400, slow["resp"].text
    error = slow["resp"].json()["error"]
    assert error["code"] == "constraint_compile_timeout"
    assert f"compile_timeout_s = {COMPILE_TIMEOUT_S:g}s" in error["message"]
    assert slow["elapsed"] < 30
    # the runaway compilation still runs in the background; new grammars compile anyway
    constrained = post(server, "/v1/chat/completions", {
        "messages": user("Describe a person as JSON."), "max_tokens": 80, "temperature": 0,
        "structured_outputs": {"json": {**PERSON, "title": "fresh"}}})
    assert constrained.status_code == 200, constrained.text
    content = constrained.json()["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(content), PERSON)
    stats = server.engine_stats()
    assert stats["grammar_compile_timeouts"] >= 1

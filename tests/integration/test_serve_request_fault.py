"""Requests whose own constraints contradict each other, on a live server over a tiny
random Llama with the byte tokenizer (one token per byte, EOS 256): the engine finds
that no token is left and the server answers 400 ``no_allowed_token`` naming the
cause (500 ``engine_error`` before), streamed or not; the in-process ``LLM`` returns
the completion with a ``RequestFaultError``. The engine goes on serving.
"""

from __future__ import annotations

import pytest
from lmkit.config.schema import LMKitConfig
from serve_live import LiveServer
from test_serve_real_engine_edges import MODEL, TEMPLATE, post, sse_events

pytestmark = pytest.mark.slow  # a live server (a few seconds to start)

pytest.importorskip("xgrammar")

# digits only, yet only "a" allowed: the first step masks every token
IDS_CONFLICT = {"structured_outputs": {"regex": "[0-9]+"}, "allowed_token_ids": [ord("a")]}
SCHEMA_CONFLICT = {"response_format": {"type": "json_schema", "json_schema": {
    "name": "n", "schema": {"type": "integer"}}}, "allowed_token_ids": [ord("a")]}
# exactly 20 digits, then only EOS; min_tokens forbids it until 30 tokens
MIN_CONFLICT = {"structured_outputs": {"regex": "[0-9]{20}"}, "min_tokens": 30,
                "max_tokens": 40}
PATHS = [("/v1/completions", {"prompt": "N"}),
         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "N"}]})]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from lmkit.testing.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("tiny-bytes"))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    config = LMKitConfig.model_validate({
        "model": {"model": str(model_dir), "max_model_len": 256},
        "scheduler": {"max_num_seqs": 4},
        "server": {"served_model_name": MODEL},
    })
    with LiveServer(config) as live:
        yield live


def assert_no_allowed_token(error, param):
    assert error["type"] == "invalid_request_error", error
    assert (error["code"], error["param"]) == ("no_allowed_token", param), error


@pytest.mark.parametrize("path,base", PATHS)
def test_allowed_token_ids_against_a_regex_is_a_400(server, path, base):
    body = {**base, "max_tokens": 8, "temperature": 0, **IDS_CONFLICT}
    plain = post(server, path, body)
    assert plain.status_code == 400, plain.text  # was 500 engine_error
    error = plain.json()["error"]
    assert_no_allowed_token(error, "allowed_token_ids")
    assert ('allowed_token_ids [97] and the regex "[0-9]+" constraint have no token in '
            "common at the first output token") in error["message"]
    status, events, _ = sse_events(server, path, body)
    assert status == 400, events  # failed before its first token: still a status
    assert_no_allowed_token(events[0]["error"], "allowed_token_ids")
    # the engine goes on: the next request, streamed, is served as usual
    status, events, done = sse_events(server, path, {**base, "max_tokens": 3,
                                                     "temperature": 0})
    assert status == 200 and done
    assert [c["finish_reason"] for e in events for c in e["choices"]
            if c["finish_reason"]] == ["length"]


def test_allowed_token_ids_against_a_json_schema_is_a_400(server):
    body = {**PATHS[1][1], "max_tokens": 8, "temperature": 0, **SCHEMA_CONFLICT}
    resp = post(server, "/v1/chat/completions", body)
    assert resp.status_code == 400, resp.text
    assert_no_allowed_token(resp.json()["error"], "allowed_token_ids")
    assert "json" in resp.json()["error"]["message"]


@pytest.mark.parametrize("path,base", PATHS)
def test_min_tokens_longer_than_the_constraint_is_a_400(server, path, base):
    body = {**base, "temperature": 0, **MIN_CONFLICT}
    plain = post(server, path, body)
    assert plain.status_code == 400, plain.text
    error = plain.json()["error"]
    assert_no_allowed_token(error, "min_tokens")
    assert "min_tokens = 30 is more than the regex" in error["message"]
    assert "after 20 output tokens" in error["message"]
    status, events, done = sse_events(server, path, body)
    if status == 200:  # tokens went out first: the failure is the last event
        assert done and events[0]["choices"]
        assert_no_allowed_token(events[-1]["error"], "min_tokens")
    else:  # (all 20 steps came before the server read the first: still a status)
        assert status == 400
        assert_no_allowed_token(events[0]["error"], "min_tokens")


def test_llm_generate_returns_a_request_fault_error(model_dir):
    from lmkit.api.sampling_params import SamplingParams
    from lmkit.errors import InvalidRequestError, RequestFaultError
    from lmkit.frontend.llm import LLM

    with LLM(str(model_dir), max_model_len=256) as llm:
        conflict, fine = llm.generate(["N", "N"], [
            SamplingParams(max_tokens=8, temperature=0, structured_outputs={"regex": "[0-9]"},
                           min_tokens=4),
            SamplingParams(max_tokens=3, temperature=0, structured_outputs={"regex": "[0-9]+"}),
        ])
    c = conflict.outputs[0]
    assert c.finish_reason == "error" and c.stop_reason == str(c.error)
    assert isinstance(c.error, RequestFaultError) and isinstance(c.error, InvalidRequestError)
    assert (c.error.code, c.error.param) == ("no_allowed_token", "min_tokens")
    assert "min_tokens = 4" in str(c.error)
    f = fine.outputs[0]
    assert f.finish_reason == "length" and f.error is None and f.text.isdigit()

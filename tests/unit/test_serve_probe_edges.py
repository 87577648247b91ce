"""Bad requests found by probing the HTTP server, each answered with a specific 4xx
without an engine: integers past 64 bits inside free-form JSON (a 500 from the engine
channel before), the fan-out limit dodged with ``"n": "64"``, texts of the pooling
routes that are not Unicode, bodies that are not JSON objects or are compressed, a
client that leaves while sending its body, and errors that named the wrong field."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging

import pytest
from test_serve_hard_edges import post_raw
from test_serve_http import CHAT, assert_openai_error, make_client

BIG = 10**30
CMP = {"model": "tiny", "prompt": "x"}


@pytest.mark.parametrize(("path", "body", "param", "where"), [
    ("/v1/completions", {**CMP, "extra_args": {"a": [1, {"b": BIG}]}}, "extra_args", "a[1].b"),
    ("/v1/chat/completions", {**CHAT, "extra_args": {"k": -BIG}}, "extra_args", "k"),
    ("/v1/completions", {**CMP, "structured_outputs": {"json": {
        "type": "integer", "minimum": BIG}}}, "structured_outputs.json", "minimum"),
    ("/v1/completions", {**CMP, "structured_outputs": {"structural_tag": {"n": 2**64}}},
     "structured_outputs.structural_tag", "n"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "maximum": BIG}}}},
     "response_format.json_schema.schema", "maximum"),
])
def test_integers_past_64_bits_inside_free_form_json_are_400s(path, body, param, where):
    client = make_client()
    err = assert_openai_error(client.post(path, json=body), 400, code="invalid_value",
                              param=param)
    assert f"{param}: {where} is an integer of" in err["message"]
    assert "64-bit range" in err["message"] and "Value error" not in err["message"]
    ok = {**body, "extra_args": {"a": [1, {"b": 2**63 - 1}]}} if "extra_args" in body else None
    if ok is not None:  # the largest 64-bit integer is fine
        assert_openai_error(client.post(path, json=ok), 503, code="model_loading")


@pytest.mark.parametrize("n", ["4", 4.0])
def test_fan_out_limit_counts_n_given_as_a_string_or_a_float(n):
    client = make_client(max_sequences_per_request=8)
    err = assert_openai_error(client.post("/v1/completions", json={
        **CMP, "prompt": ["a"] * 4, "n": n}), 400, code="too_many_sequences")
    assert "16 sequences (4 prompt(s) x n=4)" in err["message"]
    assert_openai_error(client.post("/v1/completions", json={**CMP, "n": "100",
                                                             "best_of": "100"}), 400,
                        code="too_many_sequences")
    assert_openai_error(client.post("/v1/completions", json={
        **CMP, "prompt": ["a"] * 4, "n": "2"}), 503, code="model_loading")


@pytest.mark.parametrize(("path", "text", "param"), [
    ("/score", '{"model": "tiny", "text_1": "a\\ud800", "text_2": "b"}', "text_1"),
    ("/v1/score", '{"model": "tiny", "text_1": "a", "text_2": ["b", "\\udfff"]}', "text_2[1]"),
    ("/rerank", '{"model": "tiny", "query": "q", "documents": ["\\udc00"]}', "documents[0]"),
    ("/classify", '{"model": "tiny", "input": ["ok", "\\ud83d"]}', "input[1]"),
])
def test_lone_surrogates_in_pooling_routes_are_400s(path, text, param):
    # these reached the tokenizer before: a 500 (TypeError: TextEncodeInput must be ...)
    err = assert_openai_error(post_raw(make_client(), path, text), 400,
                              code="invalid_unicode", param=param)
    assert "surrogate" in err["message"]


def test_empty_texts_to_score_name_their_field():
    client = make_client()
    err = assert_openai_error(client.post("/score", json={
        "model": "tiny", "text_1": "a", "text_2": ["b", ""]}), 400, param="text_2[1]")
    assert "at least 1 character" in err["message"] and "prompt" not in err["message"]
    assert_openai_error(client.post("/rerank", json={
        "model": "tiny", "query": "q", "documents": ["a", ""]}), 400, param="documents[1]")


@pytest.mark.parametrize(("text", "kind"), [
    ("[1, 2]", "an array"), ('"hi"', "a string"), ("3", "a number"), ("null", "null"),
    ("true", "a boolean"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions",
                                  "/v1/embeddings", "/score"])
def test_a_body_that_is_not_a_json_object_says_so(path, text, kind):
    err = assert_openai_error(post_raw(make_client(), path, text), 400, code="invalid_body")
    assert "must be a JSON object" in err["message"] and err["message"].endswith(kind)


def test_chat_reads_json_whatever_the_content_type_like_completions():
    client = make_client()
    for ctype in ("text/plain", "application/x-www-form-urlencoded"):  # curl -d sends the latter
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", CMP)):
            resp = client.post(path, content=json.dumps(body).encode(),
                               headers={"content-type": ctype})
            assert_openai_error(resp, 503, code="model_loading")
    err = assert_openai_error(post_raw(client, "/v1/chat/completions", " \n "), 400,
                              code="missing_body")
    assert "empty" in err["message"]
    err = assert_openai_error(post_raw(client, "/v1/chat/completions", '{"a": 1} x'), 400,
                              code="invalid_json")
    assert "Extra data" in err["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
def test_compressed_bodies_are_415_not_unparsable_json(path):
    client = make_client()
    body = json.dumps(CHAT).encode()
    for content in (gzip.compress(body), body):  # also when the body is not compressed
        resp = client.post(path, content=content, headers={
            "content-type": "application/json", "content-encoding": "gzip"})
        err = assert_openai_error(resp, 415, code="unsupported_content_encoding")
        assert "'gzip' is not supported" in err["message"]
    resp = client.post("/v1/chat/completions", content=body, headers={
        "content-type": "application/json", "content-encoding": "identity"})
    assert_openai_error(resp, 503, code="model_loading")


def test_a_client_leaving_while_sending_its_body_is_no_server_error(caplog):
    client = make_client()
    app = client.app
    sent: list[dict] = []

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    async def call(path):
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
                 "query_string": b"", "root_path": "", "server": ("test", 80),
                 "client": ("test", 1), "app": app,
                 "headers": [(b"content-type", b"application/json"),
                             (b"content-length", b"9999")]}
        await app(scope, receive, send)

    with caplog.at_level(logging.INFO, logger="lmkit.serve.errors"):
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings"):
            asyncio.run(call(path))
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "before sending the whole request body" in caplog.text
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [499] * 3
    assert 'outcome="error"' not in client.get("/metrics").text.replace(
        'outcome="error"} 0.0', "")
    assert_openai_error(client.post("/v1/completions", json=CMP), 503, code="model_loading")


@pytest.mark.parametrize(("body", "param", "message"), [
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0].text", "missing required parameter: messages[0].content[0].text"),
    ({**CHAT, "tool_choice": 5}, "tool_choice", "tool_choice: Input should be a valid string"),
    ({**CMP, "prompt": [1, "a"]}, "prompt[1]", "prompt[1]: Input should be a valid integer"),
    ({"model": "tiny", "text_1": 5, "text_2": "a"}, "text_1", "text_1: Input should be"),
])
def test_union_fields_are_named_without_pydantic_member_tags(body, param, message):
    path = ("/v1/chat/completions" if "messages" in body else
            "/score" if "text_1" in body else "/v1/completions")
    err = assert_openai_error(make_client().post(path, json=body), 400, param=param)
    assert message in err["message"]
    for tag in (".str", "list[", "dict[", "constrained-", ".ids"):
        assert tag not in err["message"]


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "f"}}])
def test_a_tool_choice_that_cannot_be_honored_is_a_400(choice):
    client = make_client()
    err = assert_openai_error(client.post("/v1/chat/completions", json={
        **CHAT, "tool_choice": choice}), 400, code="unsupported_parameter", param="tool_choice")
    assert "does not call tools" in err["message"]
    for fine in ("none", "auto"):  # what it does anyway
        assert_openai_error(client.post("/v1/chat/completions", json={
            **CHAT, "tool_choice": fine}), 503, code="model_loading")


def test_the_largest_seed_is_taken_with_several_completions():
    """Completion ``i`` samples with ``seed + i``, wrapped within 64 bits (the engine's
    rule, :func:`lmkit.frontend.processor.child_params`), so no seed in range is refused for ``n``."""
    client = make_client()
    top = 2**63 - 1
    for n in (1, 2, 5):
        assert_openai_error(client.post("/v1/chat/completions", json={
            **CHAT, "n": n, "seed": top}), 503, code="model_loading")
    assert_openai_error(client.post("/v1/chat/completions", json={
        **CHAT, "n": 2, "seed": top + 1}), 400, code="invalid_value", param="seed")


@pytest.mark.parametrize("key", [" 1", "1_0", "\u0661", "--1", "1\n", "9" * 101])
def test_logit_bias_keys_are_plain_decimal_token_ids(key):
    client = make_client()
    err = assert_openai_error(client.post("/v1/completions", json={
        **CMP, "logit_bias": {key: 1}}), 400, code="invalid_value", param="logit_bias")
    assert "must be token ids" in err["message"] and len(err["message"]) < 200
    assert_openai_error(client.post("/v1/completions", json={
        **CMP, "logit_bias": {"10": 1, "-1": 2}}), 503)  # -1: the engine names the vocabulary


def test_method_not_allowed_and_long_names_say_what_to_do():
    client = make_client()
    err = assert_openai_error(client.get("/v1/chat/completions"), 405,
                              code="method_not_allowed")
    assert err["message"] == "method GET is not allowed on /v1/chat/completions; use POST"
    err = assert_openai_error(client.post("/health"), 405, code="method_not_allowed")
    assert "method POST is not allowed on /health; use GET" in err["message"]
    err = assert_openai_error(client.get("/" + "a" * 50_000), 404, code="not_found")
    assert len(err["message"]) < 400 and "(50001 characters)" in err["message"]
    err = assert_openai_error(client.post("/v1/completions", json={**CMP, "model": "m" * 50_000}),
                              404, code="model_not_found")
    assert len(err["message"]) < 400 and "'tiny'" in err["message"]

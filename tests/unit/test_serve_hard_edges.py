"""Hostile request bodies refused at the HTTP edge, without an engine (issue 25): fan-out
past the per-request limit, integers past 64 bits, lone UTF-16 surrogates, endless JSON
schemas, empty and unparsable bodies; and an unexpected exception answered as a 500."""

from __future__ import annotations

import time

import pytest
from test_serve_http import CHAT, assert_openai_error, make_client

BIG = 2**70


def post_raw(client, path, text):
    """POST ``text`` as it is (json= would refuse lone surrogates before sending)."""
    return client.post(path, content=text.encode(), headers={"content-type": "application/json"})


def test_fan_out_past_the_limit_is_refused_before_any_work():
    client = make_client(max_sequences_per_request=8)
    prompts = [[1]] * 190_000  # the 3 MB body of one-token prompts
    start = time.monotonic()
    err = assert_openai_error(
        client.post("/v1/completions", json={"model": "tiny", "prompt": prompts}), 400,
        code="too_many_sequences", param="prompt")
    assert time.monotonic() - start < 2.0  # parsing the body is all it costs
    assert "190000 sequences" in err["message"] and "max_sequences_per_request" in err["message"]
    assert_openai_error(client.post("/v1/completions", json={
        "model": "tiny", "prompt": ["a", "b", "c"], "n": 3}), 400, code="too_many_sequences")
    assert_openai_error(client.post("/v1/chat/completions", json={**CHAT, "n": 9}), 400,
                        code="too_many_sequences", param="n")
    # within the limit the request goes on (and meets the loading engine)
    assert_openai_error(client.post("/v1/completions", json={
        "model": "tiny", "prompt": ["a", "b"], "n": 4}), 503, code="model_loading")


def test_fan_out_limit_never_exceeds_what_admission_takes():
    client = make_client(max_sequences_per_request=10_000, max_queued_requests=4)
    state = client.app.state.lmkit
    assert state.max_sequences_per_request == state.admission.capacity == 64 + 4
    assert_openai_error(client.post("/v1/completions", json={
        "model": "tiny", "prompt": ["a"] * 69}), 400, code="too_many_sequences")


@pytest.mark.parametrize("field", ["seed", "top_k", "priority", "n", "max_tokens",
                                   "min_tokens", "best_of", "logprobs"])
def test_integers_past_64_bits_are_400s(field):
    body = {"model": "tiny", "prompt": "x", field: BIG}
    # n and best_of count sequences: the fan-out check, before validation, refuses them
    code = "too_many_sequences" if field in ("n", "best_of") else "invalid_value"
    assert_openai_error(make_client().post("/v1/completions", json=body), 400, code=code,
                        param="prompt" if code == "too_many_sequences" else field)
    if field not in ("best_of", "logprobs"):  # not chat fields (or not integers there)
        resp = make_client().post("/v1/chat/completions", json={**CHAT, field: BIG})
        assert_openai_error(resp, 400, param=field)


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "tiny", "prompt": "x", "stop_token_ids": [BIG]}, "stop_token_ids[0]"),
    ({"model": "tiny", "prompt": [1, BIG]}, "prompt"),
    ({**CHAT, "max_completion_tokens": BIG}, "max_completion_tokens"),
    ({**CHAT, "seed": -BIG}, "seed"),
])
def test_other_big_integers_are_400s(body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    err = assert_openai_error(make_client().post(path, json=body), 400)
    assert err["param"].startswith(param)


def test_integer_too_long_to_parse_has_a_code():
    text = '{"model": "tiny", "prompt": "x", "seed": ' + "9" * 5000 + "}"
    err = assert_openai_error(post_raw(make_client(), "/v1/completions", text), 400,
                              code="invalid_json")
    assert "digits" in err["message"]


@pytest.mark.parametrize(("text", "param"), [
    ('{"model": "tiny", "messages": [{"role": "user", "content": "hi \\ud800"}]}',
     "messages[0].content"),
    ('{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", '
     '"text": "\\udfff"}]}]}', "messages[0].content[0].text"),
    ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": ["\\udc00"]}',
     "stop[0]"),
    ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
     '"logit_bias": {"\\ud800": 1}}', "logit_bias (a key)"),
])
def test_lone_surrogates_in_chat_are_400s(text, param):
    err = assert_openai_error(post_raw(make_client(), "/v1/chat/completions", text), 400,
                              code="invalid_unicode", param=param)
    assert "surrogate" in err["message"]


def test_lone_surrogates_in_prompts_are_400s_and_pairs_are_fine():
    client = make_client()
    bad = '{"model": "tiny", "prompt": ["ok", "x\\ud83d"]}'
    assert_openai_error(post_raw(client, "/v1/completions", bad), 400, code="invalid_unicode",
                        param="prompt[1]")
    paired = '{"model": "tiny", "prompt": "emoji \\ud83d\\ude00"}'  # a valid pair: U+1F600
    assert_openai_error(post_raw(client, "/v1/completions", paired), 503, code="model_loading")


def test_endless_json_schema_is_refused_at_the_front():
    client = make_client()  # no engine: the check is the frontend's
    body = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "loop", "schema": {"$ref": "#"}}}}
    err = assert_openai_error(client.post("/v1/chat/completions", json=body), 400,
                              param="response_format")
    assert "infinitely deep" in err["message"]
    required_self = {"type": "object", "properties": {"child": {"$ref": "#"}},
                     "required": ["child"]}
    assert_openai_error(client.post("/v1/chat/completions", json={
        **CHAT, "structured_outputs": {"json": required_self}}), 400, param="structured_outputs")
    optional_self = {"type": "object", "properties": {"child": {"$ref": "#"}}}
    assert_openai_error(client.post("/v1/chat/completions", json={
        **CHAT, "structured_outputs": {"json": optional_self}}), 503)  # fine: on to the engine


def test_empty_and_unparsable_bodies_say_what_is_wrong():
    client = make_client()
    for path in ("/v1/completions", "/v1/chat/completions"):
        err = assert_openai_error(post_raw(client, path, ""), 400, code="missing_body")
        assert "None" not in err["message"] and "empty" in err["message"]
        assert_openai_error(post_raw(client, path, "{"), 400, code="invalid_json")
        digits = '{"model": "tiny", "n": ' + "1" * 5000 + "}"
        assert_openai_error(post_raw(client, path, digits), 400, code="invalid_json")
    assert_openai_error(client.get("/v1/completions"), 405, code="method_not_allowed")
    assert_openai_error(client.get("/v1/nothing"), 404, code="not_found")


def test_an_unexpected_exception_is_a_500_and_the_app_goes_on():
    client = make_client()

    async def boom():
        raise RuntimeError("kaput")

    client.app.add_api_route("/boom", boom, methods=["POST"])
    # TestClient re-raises what escapes the app: the middleware must let nothing out
    resp = client.post("/boom")
    err = assert_openai_error(resp, 500, code="internal_error")
    assert "RuntimeError: kaput" in err["message"] and err["type"] == "server_error"
    assert 'lmkit_requests_total{outcome="error"} 1.0' in client.get("/metrics").text
    assert_openai_error(client.post("/v1/chat/completions", json=CHAT), 503)


def test_deeply_nested_bodies_are_400s_not_500s():
    deep = '{"model": "tiny", "prompt": "x", "user": ' + "[" * 5000 + "]" * 5000 + "}"
    resp = post_raw(make_client(), "/v1/completions", deep)
    assert_openai_error(resp, 400)
    nested = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], ' \
        '"tool_choice": ' + '{"a": ' * 900 + '"\\ud800"' + "}" * 900 + "}"
    assert_openai_error(post_raw(make_client(), "/v1/chat/completions", nested), 400,
                        code="invalid_unicode")


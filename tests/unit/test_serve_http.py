"""The HTTP layer without an engine: auth, body limit, error shapes, admission, CORS,
and answers while the model is still loading."""

from __future__ import annotations

import pytest
from lmkit.config.schema import LMKitConfig
from lmkit.serve.app import build_app
from lmkit.serve.errors import APIError
from lmkit.serve.limits import AdmissionController
from starlette.testclient import TestClient

KEY = "sk-test-123"


def make_client(**server) -> TestClient:
    config = LMKitConfig.model_validate({"model": {"model": "tiny"}, "server": server})
    # No `with`: the lifespan (which would start the engine) does not run, so the
    # server stays in its "loading" state.
    return TestClient(build_app(config))


def assert_openai_error(resp, status, code=None, param=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    return err


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def test_health_is_503_while_loading_and_needs_no_key():
    client = make_client(api_key=KEY)
    resp = client.get("/health")
    assert resp.status_code == 503 and resp.json()["status"] == "loading"


@pytest.mark.parametrize("path", ["/v1/models", "/metrics", "/v1/lmkit/stack", "//health",
                                  "/health/", "/nope"])
def test_every_other_path_needs_the_key(path):
    client = make_client(api_key=KEY)
    assert_openai_error(client.get(path), 401, code="invalid_api_key")
    assert_openai_error(client.get(path, headers={"Authorization": "Bearer wrong"}), 401)
    assert_openai_error(client.get(path, headers={"Authorization": f"Basic {KEY}"}), 401)
    assert client.get(path, headers={"Authorization": f"Bearer {KEY}"}).status_code != 401


def test_post_routes_need_the_key():
    client = make_client(api_key=KEY)
    assert_openai_error(client.post("/v1/chat/completions", json=CHAT), 401)
    ok = client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {KEY}"})
    assert_openai_error(ok, 503, code="model_loading")  # authorized; the model still loads
    assert ok.headers["retry-after"]


def test_generation_answers_503_while_loading():
    client = make_client()
    assert_openai_error(client.post("/v1/completions", json={"model": "tiny", "prompt": "x"}),
                        503, code="model_loading")


def test_validation_errors_are_openai_shaped_400s():
    client = make_client()
    assert_openai_error(client.post("/v1/chat/completions", content=b"{not json",
                                    headers={"content-type": "application/json"}), 400,
                        code="invalid_json")
    assert_openai_error(client.post("/v1/chat/completions", json={**CHAT, "bogus": 1}), 400,
                        code="unknown_parameter", param="bogus")
    assert_openai_error(client.post("/v1/chat/completions", json={"model": "tiny"}), 400,
                        code="missing_required_parameter", param="messages")
    assert_openai_error(client.post("/v1/chat/completions", json={**CHAT, "n": 0}), 400,
                        param="n")
    assert_openai_error(client.post("/v1/chat/completions", json={**CHAT, "temperature": "hot"}),
                        400, param="temperature")
    assert_openai_error(client.post("/v1/completions", json={"model": "tiny", "prompt": "x",
                                                             "max_tokens": 4, "min_tokens": 9}),
                        400, param="min_tokens")


def test_unknown_model_is_404():
    client = make_client()
    err = assert_openai_error(client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"}),
                              404, code="model_not_found", param="model")
    assert "tiny" in err["message"]
    assert_openai_error(client.get("/v1/nothing"), 404)


def test_body_size_limit_is_413():
    client = make_client(max_request_body_bytes=1000)
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 2000}]}
    assert_openai_error(client.post("/v1/chat/completions", json=big), 413,
                        code="request_too_large")

    def chunks():  # no Content-Length: counted while reading
        for _ in range(20):
            yield b" " * 100

    assert_openai_error(client.post("/v1/chat/completions", content=chunks(),
                                    headers={"content-type": "application/json"}), 413)
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 503  # small is fine


def test_metrics_count_invalid_requests():
    client = make_client()
    client.post("/v1/chat/completions", json={**CHAT, "n": 0})
    text = client.get("/metrics").text
    assert 'lmkit_requests_total{outcome="invalid"} 1.0' in text
    assert "lmkit_time_to_first_token_seconds_bucket" in text


def test_cors_is_off_unless_configured():
    preflight = {"Origin": "http://example.com", "Access-Control-Request-Method": "POST"}
    off = make_client().options("/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in off.headers
    on = make_client(cors_origins=["http://example.com"]).options("/v1/chat/completions",
                                                                  headers=preflight)
    assert on.headers["access-control-allow-origin"] == "http://example.com"


def test_models_lists_the_served_name():
    data = make_client(served_model_name="my-model").get("/v1/models").json()
    assert data["object"] == "list" and data["data"][0]["id"] == "my-model"


def test_admission_controller_bounds_sequences():
    adm = AdmissionController(capacity=4)
    a = adm.admit(3)
    with pytest.raises(APIError) as info:
        adm.admit(2)
    assert info.value.status == 429 and info.value.headers == {"Retry-After": "1"}
    a.release()
    a.release()  # idempotent
    assert adm.in_flight == 0
    big = adm.admit(10)  # an oversized request is admitted alone rather than never
    assert adm.in_flight == 10
    big.release()

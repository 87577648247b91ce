"""``/v1/embeddings`` on a live loopback server (all-MiniLM-L6-v2) driven by the
unchanged ``openai`` client: every input form, float and base64, errors in the same
shape as the other endpoints, and the same vectors as the offline ``LLM.embed``."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
from lmkit import LLM
from lmkit.config.schema import LMKitConfig
from serve_live import LiveServer

pytestmark = pytest.mark.slow  # a live server and an offline engine (~15 s on 2 cores)

MODEL = "minilm"
TEXTS = ["A man is eating food.", "The girl is carrying a baby.", "Paris is in France."]


@pytest.fixture(scope="module")
def server(minilm_dir):
    config = LMKitConfig.model_validate({
        "model": {"model": str(minilm_dir), "dtype": "float32"},  # compared at 1e-5
        "scheduler": {"max_num_seqs": 8},
        "server": {"served_model_name": MODEL, "max_queued_requests": 8},
    })
    with LiveServer(config, startup_timeout=180) as live:
        yield live


@pytest.fixture(scope="module")
def offline(minilm_dir):
    llm = LLM(str(minilm_dir), progress=False, dtype="float32")
    yield np.array([o.embedding for o in llm.embed(TEXTS)])
    llm.shutdown()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                         timeout=60)


def _close(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) > 0.99999


def test_openai_client_embeddings_create(client, offline):
    one = client.embeddings.create(model=MODEL, input=TEXTS[0])  # the client asks base64
    assert len(one.data) == 1 and len(one.data[0].embedding) == 384
    assert _close(one.data[0].embedding, offline[0])
    assert one.usage.prompt_tokens == one.usage.total_tokens > 0
    batch = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [d.index for d in batch.data] == [0, 1, 2]
    for d, ref in zip(batch.data, offline, strict=True):
        assert _close(d.embedding, ref)


def test_token_id_inputs_and_dimensions(server, client, offline):
    tok = server.state.llm.tokenizer
    ids = [tok.encode(t) for t in TEXTS]
    single = client.embeddings.create(model=MODEL, input=ids[1], encoding_format="float")
    assert _close(single.data[0].embedding, offline[1])
    lists = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    assert all(_close(d.embedding, r) for d, r in zip(lists.data, offline, strict=True))
    short = client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=32,
                                     encoding_format="float")
    assert len(short.data[0].embedding) == 32
    assert abs(np.linalg.norm(short.data[0].embedding) - 1.0) < 1e-5


def test_base64_is_little_endian_float32(server, offline):
    resp = httpx.post(f"{server.url}/v1/embeddings", timeout=60,
                      json={"model": MODEL, "input": TEXTS[2], "encoding_format": "base64"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
    vec = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert vec.shape == (384,) and _close(vec, offline[2])


INVALID = [
    ("empty_input", {"model": MODEL, "input": []}, 400, "invalid_value"),
    ("empty_string", {"model": MODEL, "input": ["ok", ""]}, 400, "invalid_value"),
    ("unknown_model", {"model": "gpt-5", "input": "x"}, 404, "model_not_found"),
    ("dimensions", {"model": MODEL, "input": "x", "dimensions": 0}, 400, "invalid_value"),
    ("format", {"model": MODEL, "input": "x", "encoding_format": "int8"}, 400, None),
    ("unknown_field", {"model": MODEL, "input": "x", "temperature": 1}, 400, None),
    ("too_many", {"model": MODEL, "input": ["x"] * 100}, 400, "too_many_sequences"),
    ("too_long", {"model": MODEL, "input": [[101] * 600]}, 400, "context_length_exceeded"),
    ("token_id", {"model": MODEL, "input": [1, 10_000_000]}, 400, "invalid_value"),
    ("pooler", {"model": MODEL, "input": "x", "pooling_type": "nope"}, 400, "invalid_value"),
]


@pytest.mark.parametrize("name,body,status,code", INVALID, ids=[i[0] for i in INVALID])
def test_invalid_input_is_4xx_and_server_still_serves(server, name, body, status, code):
    resp = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code:
        assert err["code"] == code
    ok = httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL, "input": "x"},
                    timeout=60)
    assert ok.status_code == 200


def test_generation_on_an_encoder_is_a_400(server):
    resp = httpx.post(f"{server.url}/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "hello", "max_tokens": 4})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "model_cannot_generate"


def test_score_and_rerank(server, offline):
    cos = offline @ offline.T  # unit vectors: cosine is the dot product
    resp = httpx.post(f"{server.url}/score", timeout=60,
                      json={"model": MODEL, "text_1": TEXTS[0], "text_2": TEXTS})
    assert resp.status_code == 200, resp.text
    scores = [d["score"] for d in resp.json()["data"]]
    assert scores == pytest.approx(list(cos[0]), abs=1e-5) and scores[0] == pytest.approx(1.0)
    pairwise = httpx.post(f"{server.url}/v1/score", timeout=60, json={
        "model": MODEL, "text_1": TEXTS[:2], "text_2": TEXTS[1:]}).json()["data"]
    assert [d["score"] for d in pairwise] == pytest.approx([cos[0, 1], cos[1, 2]], abs=1e-5)
    resp = httpx.post(f"{server.url}/rerank", timeout=60, json={
        "model": MODEL, "query": "Someone is having a meal.", "documents": TEXTS, "top_n": 2})
    assert resp.status_code == 200, resp.text
    results = resp.json()["results"]
    assert len(results) == 2 and results[0]["index"] == 0  # the eating sentence first
    assert results[0]["relevance_score"] >= results[1]["relevance_score"]
    assert results[0]["document"] == {"text": TEXTS[0]}
    bad = httpx.post(f"{server.url}/v2/rerank", timeout=60,
                     json={"model": MODEL, "query": "q", "documents": []})
    assert bad.status_code == 400
    mismatch = httpx.post(f"{server.url}/score", timeout=60, json={
        "model": MODEL, "text_1": ["a", "b"], "text_2": ["a", "b", "c"]})
    assert mismatch.status_code == 400 and mismatch.json()["error"]["param"] == "text_2"


def test_classify_without_a_head_is_a_400(server):
    resp = httpx.post(f"{server.url}/classify", json={"model": MODEL, "input": "x"}, timeout=60)
    assert resp.status_code == 400, resp.text
    assert "no classification head" in resp.json()["error"]["message"]


def test_pooling_requests_are_counted_in_metrics(server):
    import time

    httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL, "input": "x"}, timeout=60)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{server.url}/metrics").text
        line = [m for m in metrics.splitlines() if m.startswith("lmkit_num_pooling_requests")]
        if line and float(line[0].split()[-1]) > 0:
            return
        time.sleep(0.5)
    raise AssertionError(f"no lmkit_num_pooling_requests in /metrics: {line}")

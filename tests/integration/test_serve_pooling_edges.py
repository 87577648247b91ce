"""Edges of the pooling endpoints that only the real engine decides, on a live server
with a tiny random Qwen3 (a decoder: it generates and embeds; byte tokenizer, one
token per UTF-8 byte, 64-token context):

- a batch with one input past the context is a 400 naming it, and the engine pools
  none of the batch (before, every input ahead of it was pooled for nothing);
- a large embeddings batch and generation requests served at the same time are each
  what they are alone (greedy tokens; embeddings equal to transformers'), and the
  generation requests are not queued behind the whole batch (the latency is printed,
  not asserted);
- ``truncate_prompt_tokens``, ``dimensions`` past the model's size, base64, and rerank's
  ``top_n`` 0 on real outputs.
"""

from __future__ import annotations

import asyncio
import base64
import time

import httpx
import numpy as np
import pytest
import torch
from lmkit.config.schema import LMKitConfig
from lmkit.testing.tiny_model import make_tiny_qwen3
from serve_live import LiveServer

pytestmark = pytest.mark.slow  # a live server (a few seconds to start)

MODEL = "tiny"
CONTEXT = 64
HIDDEN = 64
PROMPTS = ["count: 1 2 3", "the sea is", "abc" * 10]
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3-pool-edges")
    return directory, make_tiny_qwen3(directory)


@pytest.fixture(scope="module")
def server(qwen3):
    config = LMKitConfig.model_validate({
        "model": {"model": str(qwen3[0]), "max_model_len": CONTEXT, "dtype": "float32"},
        "scheduler": {"max_num_seqs": 8},
        "server": {"served_model_name": MODEL, "max_sequences_per_request": 1000,
                   "max_queued_requests": 1000},
    })
    with LiveServer(config) as live:
        yield live


def post(server, path, body):
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=120)


def reference(model, text: str) -> np.ndarray:
    """transformers' last-token hidden state, normalized (the Qwen3 family's default)."""
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([list(text.encode())])).last_hidden_state
    return torch.nn.functional.normalize(hidden[0, -1], dim=0).numpy()


def pooled(server) -> float:
    return server.engine_stats()["num_pooling_requests"]


def test_a_long_input_in_a_batch_is_a_400_naming_it_and_costs_no_engine_work(server):
    before = pooled(server)
    resp = post(server, "/v1/embeddings", {"input": ["a"] * 300 + ["x" * 100]})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "input[300]" and err["code"] == "context_length_exceeded"
    assert f"input[300] has 100 tokens, but this model's context is {CONTEXT}" in err["message"]
    resp = post(server, "/rerank", {"query": "q", "documents": ["a", "y" * 70]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "documents[1]"
    time.sleep(0.5)  # the stats are pushed after each step
    assert pooled(server) == before
    assert post(server, "/v1/embeddings", {"input": "ok"}).status_code == 200


async def _generate(client, prompt):
    start = time.monotonic()
    resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                      **GREEDY})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"], time.monotonic() - start


async def _embed(client, texts):
    resp = await client.post("/v1/embeddings", json={"model": MODEL, "input": texts})
    assert resp.status_code == 200, resp.text[:300]
    return np.array([d["embedding"] for d in resp.json()["data"]])


def test_a_big_batch_and_generation_together_are_each_as_alone(server, qwen3):
    texts = [f"text {i}: " + "words " * (i % 8) for i in range(800)]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            alone = [await _generate(client, p) for p in PROMPTS]
            batch = asyncio.create_task(_embed(client, texts))
            await asyncio.sleep(0.2)  # the batch is in the engine
            mixed = await asyncio.gather(*(_generate(client, p) for p in PROMPTS))
            return alone, mixed, await batch

    alone, mixed, vectors = asyncio.run(main())
    assert [m[0] for m in mixed] == [a[0] for a in alone]
    print(f"\ngeneration latency alone {max(a[1] for a in alone):.3f}s, beside an "
          f"{len(texts)}-input embeddings batch {max(m[1] for m in mixed):.3f}s")
    _, model = qwen3
    for i in (0, 7, 401, 799):
        assert np.allclose(vectors[i], reference(model, texts[i]), atol=1e-4)


def test_truncation_dimensions_and_base64(server):
    long = "".join(chr(ord("a") + i % 26) for i in range(100))
    cut = post(server, "/v1/embeddings", {"input": long, "truncate_prompt_tokens": -1,
                                          "encoding_format": "float"})
    assert cut.status_code == 200, cut.text
    assert cut.json()["usage"]["prompt_tokens"] == CONTEXT
    first = post(server, "/v1/embeddings", {"input": long[:CONTEXT]}).json()
    assert np.allclose(cut.json()["data"][0]["embedding"], first["data"][0]["embedding"],
                       atol=1e-6)  # the byte tokenizer truncates on the right
    ten = post(server, "/v1/embeddings", {"input": [list(long.encode())],
                                          "truncate_prompt_tokens": 10}).json()
    assert ten["usage"]["prompt_tokens"] == 10
    too_many = post(server, "/v1/embeddings", {"input": "a", "dimensions": HIDDEN + 1})
    assert too_many.status_code == 400 and f"have {HIDDEN} values" in too_many.text
    floats = post(server, "/v1/embeddings", {"input": "abc", "dimensions": 16}).json()
    packed = post(server, "/v1/embeddings", {"input": "abc", "dimensions": 16,
                                             "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), dtype="<f4")
    assert vec.shape == (16,) and np.allclose(vec, floats["data"][0]["embedding"], atol=1e-6)
    assert abs(float(np.linalg.norm(vec)) - 1.0) < 1e-5
    per_token = post(server, "/v1/embeddings", {"input": "abc", "pooling_type": "all",
                                                "encoding_format": "base64"})
    assert per_token.status_code == 400
    assert per_token.json()["error"]["param"] == "encoding_format"


def test_rerank_edges(server):
    docs = ["the sea", "a ship", "the sea is blue"]
    every = post(server, "/rerank", {"query": "the sea", "documents": docs, "top_n": 0})
    assert every.status_code == 200, every.text
    results = every.json()["results"]
    assert len(results) == 3 and results[0]["index"] == 0
    assert results[0]["relevance_score"] == pytest.approx(1.0, abs=1e-5)
    assert [r["relevance_score"] for r in results] == sorted(
        (r["relevance_score"] for r in results), reverse=True)
    assert post(server, "/rerank", {"query": "q", "documents": docs, "top_n": -1}
                ).status_code == 400
    long_query = {"query": "q" * 100, "documents": docs}
    refused = post(server, "/rerank", long_query)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "query"
    cut = post(server, "/rerank", {**long_query, "truncate_prompt_tokens": -1})
    assert cut.status_code == 200 and cut.json()["usage"]["total_tokens"] == CONTEXT + sum(
        len(d) for d in docs)
    classify = post(server, "/classify", {"input": "abc"})
    assert classify.status_code == 400 and "no classification head" in classify.text

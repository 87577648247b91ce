"""Edges of the pooling paths found by probing them with the real engine.

The HTTP routes run against a stand-in ``AsyncLLM`` (:class:`PoolingLLM`) that pools
like the engine (the first ``dimensions`` values, per-token outputs for ``all``) and
records what was submitted and how much ran at once:

- a bad input anywhere in a batch (too long, a token id outside the vocabulary, empty)
  is a 400 naming it (``input[200]``, ``documents[1]``, ``text_2[0]``) before any input
  reaches the engine (before, the inputs ahead of it were pooled for nothing, past
  admission's count);
- a batch goes to the engine a window at a time, and a failure cancels the rest;
- ``truncate_prompt_tokens`` (vLLM's), ``dimensions`` past the model's size or given as
  ``true``, base64 of per-token vectors, ``top_n`` 0, NaN outputs.

Offline, on a tiny random BERT with the real engine: ``dimensions`` past the model's
size, and BERT's ``cls``/``mean``/``all`` pooling against transformers.
"""

from __future__ import annotations

import asyncio
import base64
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from lmkit import LLM
from lmkit.api import PoolingParams
from lmkit.api.outputs import PoolingOutput
from lmkit.config.schema import LMKitConfig
from lmkit.errors import InvalidRequestError
from lmkit.frontend.processor import InputProcessor
from lmkit.serve.app import build_app
from lmkit.serve.routes_embeddings import pool_windowed
from lmkit.testing.tiny_model import make_byte_tokenizer
from starlette.testclient import TestClient
from test_serve_http import assert_openai_error

CONTEXT = 32
WIDTH = 8  # the stand-in model's embedding size


class PoolingLLM:
    """What the pooling routes need of an ``AsyncLLM``: a byte tokenizer, a 32-token
    context, and ``embed`` that answers after a yield, counting how many run at once."""

    can_serve = True
    num_engines = 1

    def __init__(self, fail_at: int | None = None, nan_at: int | None = None,
                 per_token_default: bool = False) -> None:
        self.input_processor = InputProcessor(make_byte_tokenizer(), CONTEXT, 257)
        self.tokenizer = self.input_processor.tokenizer
        self.ready = SimpleNamespace(model_dir="/nonexistent")
        self.submitted: list[list[int]] = []
        self.active = self.max_active = 0
        self.fail_at, self.nan_at = fail_at, nan_at
        self.per_token_default = per_token_default

    async def embed(self, prompt, params, *, request_id, priority=0):
        _, ids = self.input_processor.tokenize(prompt)
        index = len(self.submitted)
        self.submitted.append(ids)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await asyncio.sleep(0.001)
            if index == self.fail_at:
                raise InvalidRequestError("refused by the engine", param="input",
                                          code="invalid_value")
            vector = [float(len(ids)), *([1.0] * (WIDTH - 1))][:params.dimensions or WIDTH]
            if index == self.nan_at:
                vector[0] = float("nan")
            per_token = params.pooling_type == "all" or (
                params.pooling_type is None and self.per_token_default)
            data = [vector] * len(ids) if per_token else vector
            return PoolingOutput(request_id, ids, data)
        finally:
            self.active -= 1


def client_with(llm: PoolingLLM, max_num_seqs: int = 4) -> TestClient:
    config = LMKitConfig.model_validate({"model": {"model": "tiny"},
                                         "scheduler": {"max_num_seqs": max_num_seqs}})
    client = TestClient(build_app(config))
    client.app.state.lmkit.llm = llm
    return client


def post(client, path, body):
    return client.post(path, json={"model": "tiny", **body})


@pytest.mark.parametrize(("path", "body", "param", "code"), [
    ("/v1/embeddings", {"input": ["a"] * 200 + ["x" * 40]}, "input[200]",
     "context_length_exceeded"),
    ("/v1/embeddings", {"input": "x" * 40}, "input", "context_length_exceeded"),
    ("/v1/embeddings", {"input": [[1, 2], [3, 400]]}, "input[1]", "invalid_value"),
    ("/v1/embeddings", {"input": [1, -5]}, "input", "invalid_value"),
    ("/v1/embeddings", {"input": [[1, 2], []]}, "input[1]", "invalid_value"),
    ("/classify", {"input": ["ok", "x" * 40]}, "input[1]", "context_length_exceeded"),
    ("/rerank", {"query": "x" * 40, "documents": ["a"]}, "query", "context_length_exceeded"),
    ("/rerank", {"query": "q", "documents": ["a", "x" * 40]}, "documents[1]",
     "context_length_exceeded"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["x" * 40, "a"]}, "text_2[0]",
     "context_length_exceeded"),
    ("/score", {"text_1": "a", "text_2": []}, "text_2", "invalid_value"),
])
def test_a_bad_input_is_a_400_naming_it_before_any_input_is_pooled(path, body, param, code):
    llm = PoolingLLM()
    err = assert_openai_error(post(client_with(llm), path, body), 400, code=code, param=param)
    if code == "context_length_exceeded":
        assert f"{param} has 40 tokens" in err["message"]
        assert f"context is {CONTEXT} tokens" in err["message"]
        assert "truncate_prompt_tokens" in err["message"]
    assert llm.submitted == []  # the engine saw none of the batch


def test_a_batch_goes_to_the_engine_a_window_at_a_time_in_order():
    llm = PoolingLLM()
    texts = ["y" * (1 + i % 20) for i in range(200)]
    resp = post(client_with(llm, max_num_seqs=4), "/v1/embeddings",
                {"input": texts, "normalize": False})
    assert resp.status_code == 200, resp.text
    assert 1 < llm.max_active <= 8  # two steps' worth: 2 x max_num_seqs
    data = resp.json()["data"]
    assert [d["index"] for d in data] == list(range(200))
    assert [d["embedding"][0] for d in data] == [float(len(t)) for t in texts]


def test_a_failure_cancels_the_rest_of_the_batch():
    llm = PoolingLLM(fail_at=5)
    resp = post(client_with(llm), "/v1/embeddings", {"input": ["a"] * 100})
    assert_openai_error(resp, 400, param="input")
    assert llm.active == 0  # nothing of the batch is still waiting on the engine
    assert len(llm.submitted) < 100


def test_pool_windowed_bounds_concurrency_and_cancels_siblings_on_error():
    running, cancelled = set(), []

    async def run(i):
        running.add(i)
        try:
            await asyncio.sleep(0.01 if i != 3 else 0.001)
            if i == 3:
                raise ValueError("boom")
            return i * 10
        except asyncio.CancelledError:
            cancelled.append(i)
            raise
        finally:
            running.discard(i)

    async def ok(i):
        await asyncio.sleep(0)
        return -i

    assert asyncio.run(pool_windowed(ok, 7, 3)) == [0, -1, -2, -3, -4, -5, -6]
    with pytest.raises(ValueError, match="boom"):
        asyncio.run(pool_windowed(run, 20, 4))
    assert not running and sorted(cancelled) == [0, 1, 2]


def test_truncate_prompt_tokens_keeps_the_tokenizers_side_and_checks_its_range():
    llm = PoolingLLM()
    client = client_with(llm)
    resp = post(client, "/v1/embeddings", {"input": ["ab", "x" * 40], "normalize": False,
                                          "truncate_prompt_tokens": -1})
    assert resp.status_code == 200, resp.text
    assert [len(ids) for ids in llm.submitted] == [2, CONTEXT]
    assert resp.json()["usage"]["prompt_tokens"] == 2 + CONTEXT
    ids = list(range(40))
    post(client, "/v1/embeddings", {"input": [ids], "truncate_prompt_tokens": 10})
    assert llm.submitted[-1] == ids[:10]  # the tokenizer's side: right by default
    llm.tokenizer.truncation_side = "left"
    post(client, "/rerank", {"query": "abcdefghij" * 4, "documents": ["d"],
                             "truncate_prompt_tokens": 5})
    assert llm.submitted[-2] == list(b"fghij")  # the query
    for value, message in ((0, "got 0"), (CONTEXT + 1, f"at most {CONTEXT}"), (-2, None)):
        err = assert_openai_error(post(client, "/classify", {
            "input": "a", "truncate_prompt_tokens": value}), 400,
            param="truncate_prompt_tokens")
        assert message is None or message in err["message"]


def test_dimensions_past_the_model_size_or_not_an_integer_are_400s():
    client = client_with(PoolingLLM())
    ok = post(client, "/v1/embeddings", {"input": "a", "dimensions": WIDTH})
    assert len(ok.json()["data"][0]["embedding"]) == WIDTH
    err = assert_openai_error(post(client, "/v1/embeddings", {"input": "a", "dimensions": 9}),
                              400, code="invalid_value", param="dimensions")
    assert f"have {WIDTH} values" in err["message"]
    for value in (True, 2.0):
        assert_openai_error(post(client, "/v1/embeddings", {"input": "a", "dimensions": value}),
                            400, param="dimensions")
    assert_openai_error(post(client, "/rerank", {"query": "a", "documents": ["b"],
                                                 "top_n": True}), 400, param="top_n")


def test_base64_of_per_token_vectors_is_a_400():
    llm = PoolingLLM()
    client = client_with(llm)
    err = assert_openai_error(post(client, "/v1/embeddings", {
        "input": "ab", "pooling_type": "all", "encoding_format": "base64"}), 400,
        param="encoding_format")
    assert "encoding_format 'float'" in err["message"] and llm.submitted == []
    one = post(client, "/v1/embeddings", {"input": "ab", "encoding_format": "base64",
                                          "normalize": False, "dimensions": 2})
    vec = np.frombuffer(base64.b64decode(one.json()["data"][0]["embedding"]), dtype="<f4")
    assert vec.tolist() == [2.0, 1.0]
    # a model whose default pooler gives per-token vectors: known only once pooled
    defaulted = client_with(PoolingLLM(per_token_default=True))
    assert_openai_error(post(defaulted, "/v1/embeddings", {
        "input": "ab", "encoding_format": "base64"}), 400, param="encoding_format")


def test_rerank_top_n_zero_means_all_and_negative_is_a_400():
    client = client_with(PoolingLLM())
    docs = ["a", "bb", "ccc"]
    for top_n, count in ((0, 3), (None, 3), (2, 2), (100, 3)):
        resp = post(client, "/rerank", {"query": "q", "documents": docs, "top_n": top_n})
        assert resp.status_code == 200, resp.text
        assert len(resp.json()["results"]) == count
    assert_openai_error(post(client, "/rerank", {"query": "q", "documents": docs,
                                                 "top_n": -1}), 400, param="top_n")


def test_non_finite_outputs_are_a_500_naming_the_input():
    client = client_with(PoolingLLM(nan_at=1))
    err = assert_openai_error(post(client, "/v1/embeddings", {"input": ["a", "b", "c"]}), 500,
                              code="non_finite_output")
    assert "input[1]" in err["message"]
    client = client_with(PoolingLLM(nan_at=1))
    err = assert_openai_error(post(client, "/rerank", {"query": "q", "documents": ["a"]}), 500,
                              code="non_finite_output")
    assert "documents[0]" in err["message"]


def test_zero_vectors_normalize_and_score_to_zero_not_nan():
    from lmkit.frontend.scoring import score
    from lmkit.worker.pooling import finalize

    zero = finalize(torch.zeros(4), PoolingParams())
    assert zero.tolist() == [0.0] * 4  # not NaN: the norm is clamped
    per_token = finalize(torch.tensor([[0.0, 0.0], [3.0, 4.0]]), PoolingParams())
    assert torch.allclose(per_token, torch.tensor([[0.0, 0.0], [0.6, 0.8]]))
    assert score([0.0, 0.0], [1.0, 0.0]) == 0.0
    assert score([[0.0, 0.0], [1.0, 0.0]], [[1.0, 0.0]]) == 1.0  # MaxSim: the zero row adds 0


# ---------------------------------------------------------------- the real engine, offline


def test_bert_pooling_matches_transformers_and_dimensions_are_checked(tmp_path):
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=320, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64,
                        max_position_embeddings=64, initializer_range=0.2)
    torch.manual_seed(0)
    model = BertModel(config).eval()
    model.save_pretrained(tmp_path)
    make_byte_tokenizer().save_pretrained(tmp_path)
    texts = ["hello there", "a somewhat longer sentence to pool", "x"]
    tok = make_byte_tokenizer()
    with LLM(str(tmp_path), progress=False, dtype="float32") as llm:
        for pooling_type in ("cls", "mean", "all"):
            outs = llm.embed(texts, PoolingParams(pooling_type=pooling_type, normalize=False))
            for text, out in zip(texts, outs, strict=True):
                with torch.no_grad():
                    hidden = model(input_ids=torch.tensor([tok.encode(text)])
                                   ).last_hidden_state[0]
                ref = {"cls": hidden[0], "mean": hidden.mean(0), "all": hidden}[pooling_type]
                assert torch.allclose(torch.tensor(out.data), ref, atol=1e-4), pooling_type
        with pytest.raises(InvalidRequestError, match="have 32 values") as info:
            llm.embed(texts, dimensions=33)  # before: 32 values, silently
        assert info.value.param == "dimensions"
        assert not llm.pooling.dimensions and not llm.pooling.results
        assert len(llm.embed(texts[0], dimensions=32)[0].data) == 32

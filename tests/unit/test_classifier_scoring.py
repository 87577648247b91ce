"""A sequence classifier (a cross-encoder reranker: ``num_labels=1``) in lmkit.

- ``classify`` of one label is ``sigmoid(logit)``, as transformers' text-classification
  pipeline (before: softmax over one value, always ``[1.0]``);
- scoring (``LLM.score``, ``/score``, ``/rerank``) pools each text on its own, so it
  refuses a classifier with a 400 naming it (before: every pair scored 1.0), and a
  request's ``pooling_type: classify``; embedding with the model's default pooler, as
  the server's warm-up does, still works.
"""

from __future__ import annotations

import pytest
import torch
from lmkit import LLM
from lmkit.api import PoolingParams
from lmkit.engine.core_proc import _ready_message
from lmkit.errors import InvalidRequestError
from lmkit.testing.tiny_model import make_byte_tokenizer, make_tiny_bert_classifier
from test_pooling_probe_edges import PoolingLLM, client_with, post
from test_serve_http import assert_openai_error

TEXTS = ["hello there", "a somewhat longer sentence to classify", "x"]


def _reference_scores(model, texts: list[str], num_labels: int) -> torch.Tensor:
    """transformers' text-classification pipeline scores (its default function)."""
    from transformers import pipeline

    classifier = pipeline("text-classification", model=model, tokenizer=make_byte_tokenizer(),
                          device="cpu", top_k=None)
    rows = []
    for result in classifier(texts):
        by_label = {r["label"]: r["score"] for r in result}
        rows.append([by_label[model.config.id2label[i]] for i in range(num_labels)])
    return torch.tensor(rows)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    """A tiny random ``BertForSequenceClassification`` with one label, saved."""
    directory = tmp_path_factory.mktemp("cross-encoder")
    return directory, make_tiny_bert_classifier(directory, 1)


def test_one_label_is_a_sigmoid_and_scoring_a_classifier_is_refused(cross_encoder):
    directory, model = cross_encoder
    ref = _reference_scores(model, TEXTS, 1)  # [3, 1]
    assert not torch.allclose(ref, torch.ones_like(ref))
    with LLM(str(directory), progress=False, dtype="float32") as llm:
        probs = torch.tensor([o.data for o in llm.classify(TEXTS)])
        assert probs.shape == (3, 1)
        assert torch.allclose(probs, ref, atol=1e-5)  # before: [[1.0]] * 3
        # the server's warm-up (default params) still pools with the default pooler
        assert len(llm.embed(TEXTS[0], PoolingParams())[0].data) == 1
        default = llm.embed(TEXTS, PoolingParams(normalize=False))
        assert torch.allclose(torch.tensor([o.data for o in default]), ref, atol=1e-5)
        # probabilities are never L2-normalized (one label would always be [1.0])
        normalized = llm.embed(TEXTS, PoolingParams(normalize=True))
        assert torch.allclose(torch.tensor([o.data for o in normalized]), ref, atol=1e-5)
        with pytest.raises(InvalidRequestError, match=r"sequence classifier \(cross-encoder\)"
                           ) as info:
            llm.score(TEXTS[0], TEXTS[1:])  # before: [1.0, 1.0]
        assert info.value.param == "model" and "/classify" in str(info.value)
        with pytest.raises(InvalidRequestError, match="sequence classifier"):
            llm.score(TEXTS[0], TEXTS[1:], PoolingParams(pooling_type="cls"))
        assert not llm.pooling.pending and not llm.pooling.results  # nothing was submitted
        assert _ready_message(llm.engine, llm.host).default_pooler == "classify"


def test_a_sentence_transformers_mode_overrides_the_classifier_default(cross_encoder,
                                                                     tmp_path):
    import shutil

    directory, _ = cross_encoder
    shutil.copytree(directory, tmp_path, dirs_exist_ok=True)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_cls_token": true}')
    with LLM(str(tmp_path), progress=False, dtype="float32") as llm:
        assert _ready_message(llm.engine, llm.host).default_pooler == "cls"
        scores = llm.score(TEXTS[0], TEXTS)  # the engine pools [CLS] states: embeddings
        assert scores[0] == pytest.approx(1.0) and all(s < 0.9999 for s in scores[1:])


def test_two_labels_stay_a_softmax(tmp_path):
    model = make_tiny_bert_classifier(tmp_path, 2, seed=1)
    ref = _reference_scores(model, TEXTS, 2)
    with LLM(str(tmp_path), progress=False, dtype="float32") as llm:
        probs = torch.tensor([o.data for o in llm.classify(TEXTS)])
    assert torch.allclose(probs, ref, atol=1e-5)
    assert torch.allclose(probs.sum(-1), torch.ones(3), atol=1e-6)


class ClassifierLLM(PoolingLLM):
    """The routes' stand-in ``AsyncLLM``, for a model whose default pooler is classify."""

    def __init__(self) -> None:
        super().__init__()
        self.ready.default_pooler = "classify"


@pytest.mark.parametrize(("path", "body"), [
    ("/score", {"text_1": "q", "text_2": ["a", "b"]}),
    ("/v1/rerank", {"query": "q", "documents": ["a", "b"]}),
])
def test_score_and_rerank_refuse_a_classifier_with_a_400(path, body):
    llm = ClassifierLLM()
    err = assert_openai_error(post(client_with(llm), path, body), 400, "invalid_value", "model")
    assert err["type"] == "invalid_request_error"
    assert "sequence classifier (cross-encoder)" in err["message"]
    assert "/classify" in err["message"]
    assert llm.submitted == []  # refused before any text is pooled


@pytest.mark.parametrize(("path", "body"), [
    ("/score", {"text_1": "q", "text_2": ["a", "b"], "pooling_type": "classify"}),
    ("/rerank", {"query": "q", "documents": ["a"], "pooling_type": "classify"}),
])
def test_scoring_with_pooling_type_classify_is_a_400(path, body):
    llm = PoolingLLM()
    err = assert_openai_error(post(client_with(llm), path, body), 400, "invalid_value",
                              "pooling_type")
    assert "not embeddings" in err["message"] and llm.submitted == []
    ok = post(client_with(llm), path, {**body, "pooling_type": None})
    assert ok.status_code == 200, ok.text  # an embedding model still scores

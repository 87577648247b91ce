"""A sequence classifier's config ``problem_type`` picks its activation in lmkit.

As transformers' text-classification pipeline: ``single_label_classification`` (or
``None`` over two or more labels) a softmax, ``multi_label_classification`` (or a single
label) a sigmoid per label, ``regression`` none (raw values). Before, lmkit ignored
``problem_type``: a multi-label or regression model over several labels got a softmax,
a one-output regression model a sigmoid. Any other value fails the load, naming it and
the allowed ones (before: served as if ``None``). ``/classify`` keeps ``label`` (the
highest score) and adds ``labels`` (every label above 0.5) for a multi-label model.
"""

from __future__ import annotations

import json

import pytest
import torch
from lmkit import LLM
from lmkit.api import PoolingParams
from lmkit.api.pooling import ClassifierHead
from lmkit.errors import ModelLoadError
from lmkit.testing.tiny_model import make_byte_tokenizer, make_tiny_bert_classifier
from test_pooling_probe_edges import PoolingLLM, client_with, post

TEXTS = ["hello there", "a somewhat longer sentence to classify", "x"]
NAMES = ["red", "green", "blue"]
ROUTE_TEXTS = ["hello there", "short text", "x", "another one"]  # the stand-in: 32 tokens


def _save_classifier(directory, num_labels: int, problem_type: str | None, seed: int = 0):
    """A tiny random ``BertForSequenceClassification``, saved with a byte tokenizer."""
    model = make_tiny_bert_classifier(directory, num_labels, seed=seed, initializer_range=0.5,
                                      label_names=NAMES[:num_labels], problem_type=problem_type)
    assert model.config.num_labels == num_labels
    return model


def _pipeline_scores(model, texts: list[str]) -> torch.Tensor:
    """transformers' text-classification pipeline scores (its default function for the
    model's ``problem_type``), in label order: ``[len(texts), num_labels]``."""
    from transformers import pipeline

    classifier = pipeline("text-classification", model=model, tokenizer=make_byte_tokenizer(),
                          device="cpu", top_k=None)
    num_labels = model.config.num_labels
    rows = []
    for result in classifier(texts):
        by_label = {r["label"]: r["score"] for r in result}
        rows.append([by_label[model.config.id2label[i]] for i in range(num_labels)])
    return torch.tensor(rows)


def _logits(model, texts: list[str]) -> torch.Tensor:
    tok = make_byte_tokenizer()
    with torch.no_grad():
        return torch.cat([model(**tok(t, return_tensors="pt")).logits for t in texts])


CASES = [  # (problem_type, num_labels, the activation transformers' pipeline applies)
    (None, 1, torch.sigmoid),
    (None, 3, lambda x: torch.softmax(x, -1)),
    ("single_label_classification", 3, lambda x: torch.softmax(x, -1)),
    ("multi_label_classification", 3, torch.sigmoid),
    ("multi_label_classification", 1, torch.sigmoid),
    ("regression", 1, lambda x: x),
    ("regression", 3, lambda x: x),
]


@pytest.mark.parametrize(("problem_type", "num_labels", "activation"), CASES)
def test_classify_applies_the_problem_types_activation(tmp_path, problem_type, num_labels,
                                                      activation):
    model = _save_classifier(tmp_path, num_labels, problem_type)
    ref = _pipeline_scores(model, TEXTS)  # [3, num_labels]
    logits = _logits(model, TEXTS)
    # the pipeline is the activation named for this problem type on the model's logits
    assert torch.allclose(ref, activation(logits), atol=1e-5)
    with LLM(str(tmp_path), progress=False, dtype="float32") as llm:
        scores = torch.tensor([o.data for o in llm.classify(TEXTS)])
        # the model's default pooler (classify) gives the same, never normalized
        default = torch.tensor([o.data for o in llm.embed(TEXTS, PoolingParams())])
    assert scores.shape == (len(TEXTS), num_labels)
    assert torch.allclose(scores, ref, atol=1e-5)
    assert torch.allclose(default, ref, atol=1e-5)


@pytest.mark.parametrize("bad", ["multilabel", "classification", ""])
def test_an_unknown_problem_type_fails_the_load(tmp_path, bad):
    _save_classifier(tmp_path, 3, None)
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    cfg["problem_type"] = bad
    path.write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as info:
        LLM(str(tmp_path), progress=False, dtype="float32")
    message = str(info.value)
    assert f"problem_type {bad!r} is not supported" in message
    for allowed in ("'regression'", "'single_label_classification'",
                    "'multi_label_classification'"):
        assert allowed in message
    # the same check, on the head alone
    with pytest.raises(ModelLoadError, match="problem_type 'multilabel'"):
        ClassifierHead(3, "multilabel")


@pytest.mark.parametrize(("problem_type", "num_labels", "expected"), [
    (None, 1, "sigmoid"), (None, 2, "softmax"), ("single_label_classification", 2, "softmax"),
    ("multi_label_classification", 2, "sigmoid"), ("multi_label_classification", 1, "sigmoid"),
    ("regression", 1, "none"), ("regression", 4, "none"),
])
def test_classifier_head_from_a_transformers_config(problem_type, num_labels, expected):
    from transformers import BertConfig

    head = ClassifierHead.from_hf(BertConfig(num_labels=num_labels, problem_type=problem_type))
    assert (head.num_labels, head.problem_type, head.activation) == (
        num_labels, problem_type, expected)


class ClassifierOverHTTP(PoolingLLM):
    """The routes' stand-in ``AsyncLLM``, pooling with a real engine (``LLM``) over the
    model in ``model_dir``."""

    def __init__(self, llm: LLM, model_dir) -> None:
        super().__init__()
        self.llm = llm
        self.ready.model_dir = str(model_dir)
        self.ready.default_pooler = "classify"

    async def embed(self, prompt, params, *, request_id, priority=0):
        self.submitted.append(prompt)
        return self.llm.embed(prompt, params)[0]


@pytest.mark.parametrize(("problem_type", "num_labels"), [
    ("multi_label_classification", 3), ("single_label_classification", 3),
    ("regression", 1), (None, 3),
])
def test_classify_route_reports_the_problem_types_scores(tmp_path, problem_type, num_labels):
    model = _save_classifier(tmp_path, num_labels, problem_type, seed=3)
    ref = _pipeline_scores(model, ROUTE_TEXTS)
    with LLM(str(tmp_path), progress=False, dtype="float32") as llm:
        resp = post(client_with(ClassifierOverHTTP(llm, tmp_path)), "/classify",
                    {"input": ROUTE_TEXTS})
    assert resp.status_code == 200, resp.text
    data = resp.json()["data"]
    assert torch.allclose(torch.tensor([d["probs"] for d in data]), ref, atol=1e-5)
    assert [d["label"] for d in data] == [NAMES[int(r.argmax())] for r in ref]
    assert all(d["num_classes"] == num_labels for d in data)
    if problem_type == "multi_label_classification":
        assert [d["labels"] for d in data] == [
            [NAMES[i] for i in range(num_labels) if r[i] > 0.5] for r in ref]
    else:  # the schema of the other problem types is unchanged
        assert all(set(d) == {"index", "object", "label", "probs", "num_classes"}
                   for d in data)

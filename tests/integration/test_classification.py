"""A BERT sequence classifier (random tiny weights, the MiniLM tokenizer) through
``LLM.classify`` and ``POST /classify`` against transformers' probabilities."""

from __future__ import annotations

import shutil

import httpx
import pytest
import torch
from lmkit import LLM
from lmkit.config.schema import LMKitConfig
from serve_live import LiveServer

pytestmark = pytest.mark.slow  # an engine and a live server (~10 s on 2 cores)

TEXTS = ["this movie was wonderful", "terrible, a waste of time", "it was fine I guess"]


@pytest.fixture(scope="module")
def classifier(minilm_dir, tmp_path_factory):
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    directory = tmp_path_factory.mktemp("bert-cls")
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                        num_labels=3, id2label={0: "neg", 1: "neutral", 2: "pos"},
                        label2id={"neg": 0, "neutral": 1, "pos": 2}, initializer_range=0.2)
    torch.manual_seed(0)
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(minilm_dir / name, directory / name)
    tok = AutoTokenizer.from_pretrained(directory)
    with torch.no_grad():
        ref = [torch.softmax(model(**tok(t, return_tensors="pt")).logits[0], -1) for t in TEXTS]
    return directory, torch.stack(ref)


def test_classify_matches_transformers(classifier):
    directory, ref = classifier
    with LLM(str(directory), progress=False, dtype="float32") as llm:  # auto may be bf16
        probs = torch.tensor([o.data for o in llm.classify(TEXTS)])
        assert torch.allclose(probs, ref, atol=1e-5)
        default = torch.tensor([o.data for o in llm.embed(TEXTS, normalize=False)])
        assert torch.allclose(default, ref, atol=1e-5)  # the model's default pooler


def test_classify_endpoint(classifier):
    directory, ref = classifier
    config = LMKitConfig.model_validate({"model": {"model": str(directory), "dtype": "float32"},
                                         "server": {"served_model_name": "cls"}})
    with LiveServer(config, startup_timeout=120) as server:
        resp = httpx.post(f"{server.url}/classify", json={"model": "cls", "input": TEXTS},
                          timeout=60)
        assert resp.status_code == 200, resp.text
        data = resp.json()["data"]
        labels = ["neg", "neutral", "pos"]
        assert [d["label"] for d in data] == [labels[int(r.argmax())] for r in ref]
        assert torch.allclose(torch.tensor([d["probs"] for d in data]), ref, atol=1e-5)
        assert all(d["num_classes"] == 3 for d in data)
        bad = httpx.post(f"{server.url}/v1/classify", json={"model": "cls", "input": []},
                         timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_value"

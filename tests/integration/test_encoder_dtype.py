"""Encoders in bfloat16: ``--dtype bfloat16`` on a tiny random BERT gives embeddings
within cosine 0.999 of float32's, and ``auto`` means bfloat16 for an encoder exactly
when the CPU multiplies bfloat16 in hardware (float32 for a decoder)."""

from __future__ import annotations

import pytest
import torch
from lmkit import LLM
from lmkit.config import LMKitConfig
from lmkit.platform import cpu_has_bf16_matmul
from lmkit.plugin_host import resolve as resolve_mod
from lmkit.testing.tiny_model import make_byte_tokenizer

TEXTS = [f"sentence number {i}: " + "words that vary in length " * (i % 7) + "end."
         for i in range(24)]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    from transformers import BertConfig, BertModel

    directory = tmp_path_factory.mktemp("bert-bf16")
    config = BertConfig(vocab_size=320, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128,
                        max_position_embeddings=256, initializer_range=0.1)
    torch.manual_seed(0)
    BertModel(config).eval().save_pretrained(directory)
    make_byte_tokenizer().save_pretrained(directory)
    return directory


def _embed(directory, dtype: str) -> tuple[torch.Tensor, str]:
    with LLM(str(directory), progress=False, dtype=dtype, max_num_seqs=32) as llm:
        emb = torch.tensor([o.embedding for o in llm.embed(TEXTS)])
        return emb, llm.engine.stack.dtype


def test_bfloat16_embeddings_stay_within_cosine_0999_of_float32(bert_dir):
    full, full_dtype = _embed(bert_dir, "float32")
    half, half_dtype = _embed(bert_dir, "bfloat16")
    assert (full_dtype, half_dtype) == ("float32", "bfloat16")
    cos = torch.nn.functional.cosine_similarity(full, half, dim=-1)
    assert float(cos.min()) >= 0.999, cos
    assert not torch.equal(full, half)  # it did compute in bfloat16


def test_auto_dtype_is_bfloat16_for_encoders_on_bf16_cpus(bert_dir):
    _, dtype = _embed(bert_dir, "auto")
    assert dtype == ("bfloat16" if cpu_has_bf16_matmul() else "float32")


def test_auto_dtype_policy(monkeypatch):
    monkeypatch.setattr(resolve_mod, "cpu_has_bf16_matmul", lambda: True)
    assert resolve_mod.auto_dtype("cpu", encoder=True) == "bfloat16"
    assert resolve_mod.auto_dtype("cpu", encoder=False) == "float32"  # decoders unchanged
    assert resolve_mod.auto_dtype("cuda", encoder=False) == "bfloat16"
    config = LMKitConfig.model_validate({"executor": {"device": "cpu"}})
    assert resolve_mod.resolve_device(config, encoder=True) == ("cpu", "bfloat16")
    pinned = LMKitConfig.model_validate({"executor": {"device": "cpu"},
                                         "model": {"dtype": "float32"}})
    assert resolve_mod.resolve_device(pinned, encoder=True) == ("cpu", "float32")
    monkeypatch.setattr(resolve_mod, "cpu_has_bf16_matmul", lambda: False)
    assert resolve_mod.auto_dtype("cpu", encoder=True) == "float32"

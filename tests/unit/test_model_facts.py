"""ModelFacts: one rule each for the context length, the EOS ids, the architecture and
the attention needs, and every process (engine, runner, frontend) using the same facts."""

from __future__ import annotations

import json
import pickle
import types
from pathlib import Path

import pytest
from lmkit.api import CausalLM, Spec, hookimpl
from lmkit.engine.core_proc import _ready_message
from lmkit.errors import ConfigError, ModelLoadError, PluginError
from lmkit.loading.model_facts import DEFAULT_MAX_MODEL_LEN, load_model_facts
from lmkit.plugin_host.manager import PluginHost
from transformers import LlamaConfig, PretrainedConfig

NO_AUTOLOAD = {"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}


def _host() -> PluginHost:
    return PluginHost.load(env=NO_AUTOLOAD)


def _model_dir(tmp_path: Path, generation: dict | None = None, tokenizer_eos: bool = False,
               **config: object) -> Path:
    """A model directory with just the config files the facts read (no weights)."""
    values = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2,
                  architectures=["LlamaForCausalLM"])
    values.update(config)
    LlamaConfig(**values).save_pretrained(tmp_path)
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    if tokenizer_eos:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({
            "eos_token": "<|im_end|>",
            "added_tokens_decoder": {"9": {"content": "<|im_end|>", "special": True}}}))
    return tmp_path


def test_eos_ids_tokenizer_first_then_the_generation_config_list(tmp_path):
    model_dir = _model_dir(tmp_path, generation={"eos_token_id": [2, 7, 9]},
                           tokenizer_eos=True, eos_token_id=3)
    facts = load_model_facts(model_dir, _host())
    # the generation config's list wins over config.json's eos_token_id (3)
    assert facts.eos_token_ids == (9, 2, 7)
    assert facts.eos_token_id == 9 and facts.extra_eos_token_ids == (2, 7)


def test_eos_ids_from_config_json_without_a_generation_config(tmp_path):
    facts = load_model_facts(_model_dir(tmp_path, eos_token_id=[5, 6]), _host())
    assert facts.eos_token_ids == (5, 6)


def test_no_eos_anywhere_is_empty(tmp_path):
    facts = load_model_facts(_model_dir(tmp_path, generation={"eos_token_id": None},
                                        eos_token_id=None), _host())
    assert facts.eos_token_ids == () and facts.eos_token_id is None


def test_max_model_len_asked_above_the_native_context_is_refused(tmp_path):
    model_dir = _model_dir(tmp_path, max_position_embeddings=128)
    assert load_model_facts(model_dir, _host()).max_model_len == 128
    assert load_model_facts(model_dir, _host(), max_model_len=64).max_model_len == 64
    with pytest.raises(ConfigError, match=r"max_model_len=129 exceeds .* 128 tokens.*at most 128"):
        load_model_facts(model_dir, _host(), max_model_len=129)


def test_missing_max_position_embeddings(tmp_path):
    # a config class with no default context (LlamaConfig would fill in 2048)
    values = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, rms_norm_eps=1e-6, architectures=["LlamaForCausalLM"])
    facts = load_model_facts(tmp_path, _host(), hf_config=PretrainedConfig(**values))
    assert facts.native_max_model_len is None and facts.max_model_len == DEFAULT_MAX_MODEL_LEN
    asked = load_model_facts(tmp_path, _host(), 8192, hf_config=PretrainedConfig(**values))
    assert asked.max_model_len == 8192
    # GPT-2's name for the context length counts too
    gpt2 = load_model_facts(tmp_path, _host(), hf_config=PretrainedConfig(n_positions=300,
                                                                          **values))
    assert gpt2.max_model_len == 300


def test_architecture_by_alias_and_unknown_ones_listed(tmp_path):
    facts = load_model_facts(_model_dir(tmp_path, architectures=["Qwen2ForCausalLM"]), _host())
    assert facts.architecture == "Qwen2ForCausalLM"
    assert (facts.vocab_size, facts.num_layers, facts.head_size) == (100, 2, 16)
    assert facts.attention_needs.values["head_size"] == 16
    bad = _model_dir(tmp_path / "fancy", architectures=["FancyForCausalLM"])
    with pytest.raises(ModelLoadError, match="FancyForCausalLM.*not supported.*LlamaForCausalLM"):
        load_model_facts(bad, _host())


class NotAModel:
    """Registered as a model but not a CausalLM."""


def test_a_model_class_outside_the_contract_is_named(tmp_path):
    plugin = types.ModuleType("loose_model_plugin")
    plugin.LMKIT_PLUGIN_API = ">=1.0,<2"

    @hookimpl
    def register_models(register):
        register(Spec(name="LooseForCausalLM", target=lambda: NotAModel))

    plugin.register_models = register_models
    host = PluginHost.load(env=NO_AUTOLOAD, extra=[("loose", plugin)])
    model_dir = _model_dir(tmp_path, architectures=["LooseForCausalLM"])
    with pytest.raises(PluginError, match="does not subclass lmkit.api.CausalLM"):
        load_model_facts(model_dir, host)


def test_causal_lm_default_needs_nothing():
    assert CausalLM.attention_needs(None).features == frozenset()


def test_facts_pickle_for_workers_in_other_processes(tmp_path):
    facts = load_model_facts(_model_dir(tmp_path, eos_token_id=1), _host())
    assert pickle.loads(pickle.dumps(facts)) == facts


def test_engine_runner_and_frontend_agree(tmp_path):
    """One directory where the three old rules disagreed: the tokenizer's EOS (256), a
    generation config list, and a max_model_len below the model's context."""
    from lmkit import LLM
    from lmkit.testing.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "tiny", max_position_embeddings=512)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 256]}))
    with LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=200,
             num_blocks=64, block_size=4) as llm:
        facts = llm.engine.facts
        assert facts.eos_token_ids == (256, 7) and facts.max_model_len == 200
        runner = llm.engine.executor.runner
        assert (runner.default_eos_token_id, runner.max_model_len) == (256, 200)
        processor = llm.input_processor
        assert (processor.eos_token_id, processor.extra_eos_token_ids) == (256, [7])
        assert processor.max_model_len == llm.config.model.max_model_len == 200
        ready = _ready_message(llm.engine, llm.host)
        assert (ready.eos_token_ids, ready.max_model_len) == ([256, 7], 200)

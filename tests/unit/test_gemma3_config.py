"""Gemma-3 text and Gemma-2 configs: two KV cache groups from ``layer_types``, per-kind
RoPE, attention soft-capping as a declared need, and refusals before weights load."""

from __future__ import annotations

from pathlib import Path

import pytest
from lmkit.api import FullAttentionSpec, ModelLoadError, Needs, SlidingWindowSpec
from lmkit.config.schema import LMKitConfig
from lmkit.errors import NoBackendError
from lmkit.loading.model_facts import load_model_facts
from lmkit.plugin_host.manager import PluginHost
from lmkit.plugin_host.resolve import resolve_stack
from lmkit_plugins.models.gemma3 import Gemma2ForCausalLM, Gemma3ForCausalLM
from lmkit_plugins.models.rotary import rope_config_from_hf
from transformers import Gemma2Config, Gemma3TextConfig


def _config(**extra) -> Gemma3TextConfig:
    return Gemma3TextConfig(vocab_size=100, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, sliding_window=32, architectures=["Gemma3ForCausalLM"],
                            **extra)


def test_default_pattern_is_five_sliding_layers_then_one_global():
    specs = Gemma3ForCausalLM.kv_cache_specs(_config())
    assert specs == (SlidingWindowSpec(window=32),) * 5 + (FullAttentionSpec(),)


def test_each_layer_kind_has_its_rope_base():
    cfg = _config(rope_local_base_freq=10.0, rope_theta=500.0)
    assert rope_config_from_hf(cfg, 16, "sliding_attention").theta == 10.0
    assert rope_config_from_hf(cfg, 16, "full_attention").theta == 500.0
    with pytest.raises(ModelLoadError, match="per layer type"):
        rope_config_from_hf(cfg, 16)


@pytest.mark.parametrize("extra, match", [
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(hidden_activation="gelu"), "hidden_activation"),
])
def test_unsupported_settings_are_refused_before_loading(extra, match):
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    with pytest.raises(ModelLoadError, match=match):
        load_model_facts(Path("/nonexistent"), host, hf_config=_config(**extra))


def test_a_backend_without_sliding_window_cannot_serve_it():
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    facts = load_model_facts(Path("/nonexistent"), host, hf_config=_config())
    assert facts.architecture == "Gemma3ForCausalLM"
    assert "sliding_window" in facts.attention_needs.features
    # what stack resolution checks (no CUDA device needed): triton has no window
    triton = host.registry.get("attention", "triton").spec
    assert "does not support sliding_window" in triton.why_not(facts.attention_needs)
    assert not host.registry.get("attention", "torch").spec.why_not(
        facts.attention_needs.merge(Needs(values={"device": "cpu", "dtype": "float32"})))


def _gemma2(**extra) -> Gemma2Config:
    return Gemma2Config(vocab_size=100, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, sliding_window=32, architectures=["Gemma2ForCausalLM"],
                        **extra)


def test_gemma2_alternates_sliding_and_full_layers_with_one_rope():
    specs = Gemma2ForCausalLM.kv_cache_specs(_gemma2())
    assert specs == (SlidingWindowSpec(window=32), FullAttentionSpec()) * 2
    cfg = _gemma2()
    assert (rope_config_from_hf(cfg, 16, "sliding_attention")
            == rope_config_from_hf(cfg, 16, "full_attention"))


def test_attention_soft_capping_is_a_need_torch_and_flashinfer_serve():
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    facts = load_model_facts(Path("/nonexistent"), host, hf_config=_gemma2())
    assert {"sliding_window", "logits_soft_cap"} <= facts.attention_needs.features
    for name in ("cpu", "triton", "flash_attn"):
        why = host.registry.get("attention", name).spec.why_not(facts.attention_needs)
        assert "does not support logits_soft_cap" in why, name
    cpu = Needs(values={"device": "cpu", "dtype": "float32"})
    assert not host.registry.get("attention", "torch").spec.why_not(
        facts.attention_needs.merge(cpu))
    cuda = Needs(values={"device": "cuda", "dtype": "bfloat16"})
    assert "does not support logits_soft_cap" not in host.registry.get(
        "attention", "flashinfer").spec.why_not(facts.attention_needs.merge(cuda))
    # Gemma-3 leaves it null: no such need; set, it is needed there too
    gemma3 = load_model_facts(Path("/nonexistent"), host, hf_config=_config())
    assert "logits_soft_cap" not in gemma3.attention_needs.features
    capped = load_model_facts(Path("/nonexistent"), host,
                              hf_config=_config(attn_logit_softcapping=50.0))
    assert "logits_soft_cap" in capped.attention_needs.features


def _resolve(tmp_path, attention: str):
    _gemma2().save_pretrained(tmp_path)
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    config = LMKitConfig.model_validate({
        "model": {"model": str(tmp_path), "dtype": "float32"},
        "attention": {"backend": attention}, "executor": {"device": "cpu"}})
    return resolve_stack(config, host, load_model_facts(tmp_path, host).attention_needs)


def test_cpu_gemma2_auto_picks_torch_and_a_named_cpu_backend_is_refused(tmp_path):
    assert _resolve(tmp_path, "auto").names()["attention"] == "torch"
    with pytest.raises(NoBackendError, match="does not support logits_soft_cap.*instead: torch"):
        _resolve(tmp_path, "cpu")

"""Gemma-3 text configs: two KV cache groups from ``layer_types``, per-kind RoPE, and the
refusals of what no backend implements (before weights load)."""

from __future__ import annotations

from pathlib import Path

import pytest
from lmkit.api import FullAttentionSpec, ModelLoadError, Needs, SlidingWindowSpec
from lmkit.loading.model_facts import load_model_facts
from lmkit.plugin_host.manager import PluginHost
from lmkit_plugins.models.gemma3 import Gemma3ForCausalLM
from lmkit_plugins.models.rotary import rope_config_from_hf
from transformers import Gemma3TextConfig


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
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
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

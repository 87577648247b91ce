"""The Llama family's per-layer windows (``layer_types``): a config mixing sliding and
full layers declares two KV cache specs, and a backend that cannot serve the sliding
group is refused before weights load."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
from lmkit.api import Caps, FullAttentionSpec, SlidingWindowSpec, Spec, hookimpl
from lmkit.config import LMKitConfig
from lmkit.errors import ModelLoadError, NoBackendError
from lmkit.loading.model_facts import load_model_facts
from lmkit.plugin_host.manager import PluginHost
from lmkit.plugin_host.resolve import resolve_stack
from lmkit_plugins.models.llama import LlamaForCausalLM
from lmkit_plugins.models.llama_dims import layer_windows
from transformers import Qwen2Config


def _hybrid_qwen2() -> Qwen2Config:
    return Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, num_hidden_layers=2, vocab_size=100,
                       use_sliding_window=True, sliding_window=8, max_window_layers=1,
                       architectures=["Qwen2ForCausalLM"])


def _host_with_full_only_backend() -> PluginHost:
    plugin = types.ModuleType("full_only_plugin")
    plugin.LMKIT_PLUGIN_API = ">=1.0,<2"

    @hookimpl
    def register_attention_backends(register):
        register(Spec(name="full_only", priority=1000,
                      target="lmkit_plugins.attention.torch_ref:TorchAttention",
                      caps=Caps({"multi_token_query"},
                                {"device": {"cpu"}, "dtype": {"float32"}})))

    plugin.register_attention_backends = register_attention_backends
    return PluginHost.load(env={}, extra=[("full_only", plugin)])


def test_a_backend_that_cannot_serve_a_group_is_refused_before_loading():
    host = _host_with_full_only_backend()
    needs = load_model_facts(Path("/nonexistent"), host, hf_config=_hybrid_qwen2()).attention_needs
    assert "sliding_window" in needs.features
    auto = resolve_stack(LMKitConfig.model_validate({"executor": {"device": "cpu"}}), host, needs)
    assert auto.get("attention").name != "full_only"  # auto avoids it
    named = LMKitConfig.model_validate({"executor": {"device": "cpu"},
                                        "attention": {"backend": "full_only"}})
    with pytest.raises(NoBackendError, match="sliding_window"):
        resolve_stack(named, host, needs)


def test_mixed_layer_types_declare_one_spec_per_layer():
    cfg = _hybrid_qwen2()
    assert layer_windows(cfg) == (None, 8)
    assert LlamaForCausalLM.kv_cache_specs(cfg) == (FullAttentionSpec(),
                                                    SlidingWindowSpec(window=8))
    cfg.max_window_layers = 0
    cfg.layer_types = ["sliding_attention"] * 2  # one kind for all layers: one group
    assert LlamaForCausalLM.kv_cache_specs(cfg) is None


def test_layer_types_of_the_wrong_length_are_refused():
    cfg = _hybrid_qwen2()
    cfg.layer_types = ["sliding_attention"]
    with pytest.raises(ModelLoadError, match="each of the 2 layers"):
        layer_windows(cfg)

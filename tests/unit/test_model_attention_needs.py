"""A model's own needs of attention (head size, sliding window) steer stack resolution."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
from lmkit.api import Caps, Spec, hookimpl
from lmkit.config import LMKitConfig
from lmkit.errors import NoBackendError
from lmkit.loading.model_facts import load_model_facts
from lmkit.plugin_host.manager import PluginHost
from lmkit.plugin_host.resolve import resolve_stack
from transformers import MistralConfig


def _host_with_windowless_backend() -> PluginHost:
    plugin = types.ModuleType("windowless_plugin")
    plugin.LMKIT_PLUGIN_API = ">=1.0,<2"

    @hookimpl
    def register_attention_backends(register):
        register(Spec(name="windowless", priority=1000,
                      target="lmkit_plugins.attention.torch_ref:TorchAttention",
                      caps=Caps({"multi_token_query"},
                                {"device": {"cpu"}, "dtype": {"float32"}})))

    plugin.register_attention_backends = register_attention_backends
    return PluginHost.load(env={}, extra=[("windowless", plugin)])


def _mistral(window: int | None) -> MistralConfig:
    return MistralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, num_hidden_layers=1, vocab_size=100,
                         sliding_window=window, architectures=["MistralForCausalLM"])


def model_attention_needs(host: PluginHost, hf_config: MistralConfig):
    """The needs the engine resolves the stack with (no model files needed for them)."""
    return load_model_facts(Path("/nonexistent"), host, hf_config=hf_config).attention_needs


def test_window_model_needs_the_feature_and_its_head_size():
    host = _host_with_windowless_backend()
    needs = model_attention_needs(host, _mistral(8))
    assert "sliding_window" in needs.features and needs.values["head_size"] == 16
    assert "sliding_window" not in model_attention_needs(host, _mistral(None)).features


def test_auto_avoids_a_backend_without_sliding_window_and_a_named_one_fails():
    host = _host_with_windowless_backend()
    config = LMKitConfig.model_validate({"executor": {"device": "cpu"}})
    plain = resolve_stack(config, host, model_attention_needs(host, _mistral(None)))
    assert plain.get("attention").name == "windowless"  # highest priority when it fits
    windowed = resolve_stack(config, host, model_attention_needs(host, _mistral(8)))
    # the next backend by priority that has the feature: cpu (20; float32 on the CPU)
    assert windowed.get("attention").name == "cpu"
    named = LMKitConfig.model_validate({"executor": {"device": "cpu"},
                                        "attention": {"backend": "windowless"}})
    with pytest.raises(NoBackendError, match="sliding_window"):
        resolve_stack(named, host, model_attention_needs(host, _mistral(8)))

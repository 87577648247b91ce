"""The ``quantization`` plugin kind: registered through ``register_quantization_methods``,
chosen by ``--quantization`` / the ``quantization:`` section, ``auto`` picking a method
that reads the checkpoint's weight format on this device (and none otherwise)."""

from __future__ import annotations

from pathlib import Path

import pytest
from lmkit.api import QuantizationMethod
from lmkit.api.contract import CONSTRUCTORS, build
from lmkit.config import LMKitConfig
from lmkit.errors import ConfigError, PluginError
from lmkit.loading.gguf import GGUF_NAME
from lmkit.loading.model_facts import load_model_facts
from lmkit.plugin_host.kinds import KINDS, OPTIONAL_KINDS, REGISTER_HOOKS, STACK_KINDS
from lmkit.plugin_host.manager import PluginHost
from lmkit.plugin_host.resolve import resolve_stack
from lmkit.plugin_host.spec import Needs


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})


def _config(backend: str = "auto") -> LMKitConfig:
    cfg = LMKitConfig()
    cfg.executor.device = "cpu"
    cfg.quantization.backend = backend
    return cfg


def test_the_kind_is_declared_like_the_others():
    assert REGISTER_HOOKS["quantization"] == "register_quantization_methods"
    assert "quantization" in KINDS and "quantization" in STACK_KINDS
    assert "quantization" in OPTIONAL_KINDS
    # off by default: the gguf method's outputs depend on batch composition
    assert LMKitConfig().quantization.backend == "none"


def test_gguf_method_declares_formats_devices_and_kernels(host):
    spec = host.registry.get("quantization", "gguf").spec
    assert spec.caps.values["weight_format"] == {"gguf"}
    assert spec.caps.values["device"] == {"cpu"}
    assert {"Q4_1", "Q8_0", "Q4_0", "kernel:q8_dot_avx2"} <= spec.caps.features


def test_auto_follows_the_checkpoint_format(host):
    assert resolve_stack(_config(), host, weight_format="gguf").names()["quantization"] == "gguf"
    assert resolve_stack(_config(), host, weight_format="safetensors").names()[
        "quantization"] is None


def test_auto_without_a_checkpoint_chooses_none_and_names_are_checked(host):
    assert resolve_stack(_config(), host).get("quantization") is None
    assert resolve_stack(_config("gguf"), host).names()["quantization"] == "gguf"


def test_none_keeps_weights_dense(host):
    assert resolve_stack(_config("none"), host, weight_format="gguf").get("quantization") is None


def test_a_method_that_cannot_read_the_checkpoint_is_refused(host):
    with pytest.raises(ConfigError, match=r"quantization 'gguf'.*weight_format safetensors "
                                          r"not supported \(supports: gguf\)"):
        resolve_stack(_config("gguf"), host, weight_format="safetensors")


def test_a_method_for_another_device_is_refused(host):
    with pytest.raises(ConfigError, match=r"device cuda not supported \(supports: cpu\)"):
        host.select("quantization", "gguf", Needs(values={"device": "cuda",
                                                          "weight_format": "gguf"}))


def test_unknown_method_lists_the_known_ones(host):
    with pytest.raises(ConfigError, match=r"unknown quantization 'ggfu'; known: fp8, gguf.*"
                                          r"Did you mean 'gguf'"):
        resolve_stack(_config("ggfu"), host, weight_format="gguf")


def _model_dir(tmp_path: Path, gguf: bool) -> Path:
    """Config files only (no weights), with or without the kept GGUF file."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2,
                architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    if gguf:
        (tmp_path / GGUF_NAME).write_bytes(b"GGUF")
    return tmp_path


def test_model_facts_give_the_weight_format_and_head_counts(host, tmp_path):
    facts = load_model_facts(_model_dir(tmp_path / "a", gguf=True), host)
    assert (facts.weight_format, facts.num_attention_heads, facts.num_key_value_heads) == ("gguf", 4, 2)
    plain = load_model_facts(_model_dir(tmp_path / "b", gguf=False), host)
    assert plain.weight_format == "safetensors"
    assert resolve_stack(_config(), host, plain.attention_needs,
                         weight_format=plain.weight_format).get("quantization") is None


class _OldStyle(QuantizationMethod):  # abstract: build refuses it before calling it
    def __init__(self, options=None):  # the pre-contract signature: no facts
        super().__init__(None, options=options)  # type: ignore[arg-type]


def test_methods_are_built_through_the_constructor_contract(host, tmp_path):
    assert CONSTRUCTORS["quantization"].interface is QuantizationMethod
    assert CONSTRUCTORS["quantization"].signature == "cls(facts, *, options)"
    facts = load_model_facts(_model_dir(tmp_path, gguf=True), host)
    with pytest.raises(PluginError, match=r"cannot build the quantization plugin \(plugin "
                                          r"mine\).*cls\(facts, \*, options\)"):
        build("quantization", _OldStyle, facts, options=None, plugin="mine")
    with pytest.raises(PluginError, match="does not subclass lmkit.api.QuantizationMethod"):
        build("quantization", object, facts, options=None)

"""The ``quantization`` plugin kind: registered through ``register_quantization_methods``,
chosen by ``--quantization`` / the ``quantization:`` section, ``auto`` picking a method
that reads the checkpoint's weight format on this device (and none otherwise)."""

from __future__ import annotations

import pytest
from lmkit.config import LMKitConfig
from lmkit.errors import ConfigError
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
    assert LMKitConfig().quantization.backend == "auto"


def test_gguf_method_declares_formats_devices_and_kernels(host):
    spec = host.registry.get("quantization", "gguf").spec
    assert spec.caps.values["weight_format"] == {"gguf"}
    assert spec.caps.values["device"] == {"cpu"}
    assert {"Q4_1", "Q8_0", "Q4_0", "kernel:q8_dot_avx2"} <= spec.caps.features


def test_auto_follows_the_checkpoint_format(host):
    assert resolve_stack(_config(), host, weight_format="gguf").names()["quantization"] == "gguf"
    assert resolve_stack(_config(), host, weight_format="safetensors").names()[
        "quantization"] is None


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
    with pytest.raises(ConfigError, match=r"unknown quantization 'ggfu'; known: gguf.*"
                                          r"Did you mean 'gguf'"):
        resolve_stack(_config("ggfu"), host, weight_format="gguf")


def test_fp8_is_refused_as_not_built_yet(host):
    with pytest.raises(ConfigError, match=r"--quantization fp8 .* not built yet"):
        host.hook.configure(config=_config("fp8"))

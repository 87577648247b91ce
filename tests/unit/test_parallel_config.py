"""The ``parallel`` section: flags, refusals of what is not built, the devices present
and the model's head counts, all before any weights load."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from lmkit.config import load_config
from lmkit.config.parallel import check_model_split, check_parallel_settings
from lmkit.errors import ConfigError, NoBackendError
from lmkit.plugin_host.manager import PluginHost
from lmkit.plugin_host.resolve import resolve_stack


def _config(**parallel):
    return load_config(None, {f"parallel.{k}": v for k, v in parallel.items()}, env={},
                       cli_flags={f"parallel.{k}": f"--{k}" for k in parallel})[0]


def _load(settings):
    return load_config(None, settings, env={})[0]


def test_defaults_are_one_rank_mp():
    par = _load({}).parallel
    assert (par.tensor_parallel_size, par.data_parallel_size, par.distributed_backend) == (
        1, 1, "mp")


def test_data_parallel_is_refused_as_not_built():
    with pytest.raises(ConfigError, match=r"data_parallel_size is 2 \(set by .*--data_parallel_size\).*not built yet"):
        check_parallel_settings(_config(data_parallel_size=2), "cpu")


def test_ray_is_not_bound_by_this_hosts_devices(monkeypatch):
    monkeypatch.setattr("lmkit.config.parallel.cuda_device_count", lambda: 1)
    check_parallel_settings(_config(distributed_backend="ray", tensor_parallel_size=4), "cuda")


def test_cpu_allows_any_size_cuda_counts_devices(monkeypatch):
    check_parallel_settings(_config(tensor_parallel_size=8), "cpu")
    monkeypatch.setattr("lmkit.config.parallel.cuda_device_count", lambda: 2)
    check_parallel_settings(_config(tensor_parallel_size=2), "cuda")
    with pytest.raises(ConfigError, match="has 2 CUDA device.*--tp 2 or fewer"):
        check_parallel_settings(_config(tensor_parallel_size=4), "cuda")


def _facts(heads=4, kv_heads=2, intermediate=128):
    # the ModelFacts fields check_model_split reads
    return SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads,
                           intermediate_size=intermediate)


def test_head_counts_must_divide():
    check_model_split(_config(tensor_parallel_size=2), _facts())
    with pytest.raises(ConfigError, match=r"num_key_value_heads=2 is not divisible.*"
                                          r"split into: 1, 2\.?$"):
        check_model_split(_config(tensor_parallel_size=4), _facts())
    with pytest.raises(ConfigError, match="num_attention_heads=6, num_key_value_heads=6"):
        check_model_split(_config(tensor_parallel_size=4), _facts(6, 6, 120))


def test_model_facts_carry_the_split_sizes(tmp_path):
    from lmkit.loading.model_facts import load_model_facts, split_sizes
    from lmkit.testing.tiny_model import make_tiny_model
    from transformers import PretrainedConfig

    # no num_key_value_heads: every attention head has its own
    assert split_sizes(PretrainedConfig(num_attention_heads=6, intermediate_size=96)) == {
        "num_attention_heads": 6, "num_key_value_heads": 6, "intermediate_size": 96}
    assert split_sizes(PretrainedConfig()) == {
        "num_attention_heads": 0, "num_key_value_heads": 0, "intermediate_size": 0}
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    facts = load_model_facts(make_tiny_model(tmp_path / "tiny"), host)
    assert facts.num_attention_heads % facts.num_key_value_heads == 0
    assert facts.intermediate_size > 0
    check_model_split(_config(tensor_parallel_size=facts.num_key_value_heads), facts)
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        check_model_split(_config(tensor_parallel_size=facts.num_key_value_heads + 1), facts)


def test_tp_picks_the_distributed_backend_and_refuses_uniproc():
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    base = {"executor.device": "cpu", "attention.backend": "torch"}
    stack = resolve_stack(_load({**base, "parallel.tensor_parallel_size": 2}), host)
    assert stack.get("executor").name == "mp"
    one = resolve_stack(_load(base), host)
    assert one.get("executor").name == "uniproc"
    with pytest.raises(NoBackendError, match="tensor_parallel"):
        resolve_stack(_load({**base, "executor.backend": "uniproc",
                                "parallel.tensor_parallel_size": 2}), host)


def test_cli_flags_set_the_section():
    from lmkit.cli.options import ConfigOptions

    settings, flags = ConfigOptions({"tensor_parallel_size": 2, "data_parallel_size": 1}
                                    ).cli_settings()
    assert settings == {"parallel.tensor_parallel_size": 2, "parallel.data_parallel_size": 1}
    assert flags["parallel.tensor_parallel_size"] == "--tp"


def test_tp_keeps_the_cpu_offload_tier_and_refuses_a_shared_directory():
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    base = {"executor.device": "cpu", "attention.backend": "torch",
            "parallel.tensor_parallel_size": 2}
    assert resolve_stack(_load({**base, "offload.backend": "cpu"}), host).get(
        "offload").name == "cpu"
    with pytest.raises(NoBackendError, match="offload 'disk'.*does not support tensor_parallel"):
        resolve_stack(_load({**base, "offload.backend": "disk"}), host)


def test_tp_refuses_quantized_weights_and_auto_keeps_them_dense():
    """Quantized layers are not sharded: a GGUF checkpoint split over ranks runs its
    dense (converted) weights under auto, and naming the gguf method is refused."""
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    base = {"executor.device": "cpu", "attention.backend": "torch",
            "parallel.tensor_parallel_size": 2, "quantization.backend": "auto"}
    assert resolve_stack(_load(base), host, weight_format="gguf").get("quantization") is None
    assert resolve_stack(_load({**base, "parallel.tensor_parallel_size": 1}), host,
                         weight_format="gguf").get("quantization").name == "gguf"
    with pytest.raises(NoBackendError, match="quantization 'gguf'.*tensor_parallel"):
        resolve_stack(_load({**base, "quantization.backend": "gguf"}), host,
                      weight_format="gguf")

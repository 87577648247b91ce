"""The ``parallel`` section: flags, refusals of what is not built, the devices present
and the model's head counts, all before any weights load."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from lmkit.config import load_config
from lmkit.config.parallel import (
    check_model_split,
    check_parallel_settings,
    data_parallel_devices,
)
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


def test_data_parallel_runs_on_the_cpu_and_counts_tp_times_dp_cuda_devices(monkeypatch):
    check_parallel_settings(_config(data_parallel_size=4, tensor_parallel_size=2), "cpu")
    monkeypatch.setattr("lmkit.config.parallel.cuda_device_count", lambda: 4)
    check_parallel_settings(_config(data_parallel_size=2, tensor_parallel_size=2), "cuda")
    with pytest.raises(ConfigError, match=r"data_parallel_size 3 \(set by .*--data_parallel_size\)"
                                          r" x tensor_parallel_size 2.*needs 6 CUDA devices.*"
                                          r"has 4; use --dp 2 or fewer at --tp 2"):
        check_parallel_settings(_config(data_parallel_size=3, tensor_parallel_size=2), "cuda")


def test_each_data_parallel_engine_gets_its_own_devices():
    cfg = _config(data_parallel_size=2, tensor_parallel_size=2)
    assert data_parallel_devices(cfg, "cuda", cuda_devices=4) == ["0,1", "2,3"]
    # a slice of what this process may see, in its order
    assert data_parallel_devices(cfg, "cuda", visible="7, 3,5,1,6",
                                 cuda_devices=5) == ["7,3", "5,1"]
    assert data_parallel_devices(_config(data_parallel_size=3), "cuda",
                                 cuda_devices=3) == ["0", "1", "2"]
    assert data_parallel_devices(cfg, "cpu") == [None, None]  # the engines share the cores
    ray = _config(data_parallel_size=2, tensor_parallel_size=2, distributed_backend="ray")
    assert data_parallel_devices(ray, "cuda", cuda_devices=1) == [None, None]
    with pytest.raises(ConfigError, match="needs 4 CUDA devices"):
        data_parallel_devices(cfg, "cuda", cuda_devices=3)


def test_engine_launches_plan_one_engine_config_each(monkeypatch):
    from lmkit.frontend.engine_set import engine_launches

    cfg = _load({"parallel.data_parallel_size": 2, "executor.device": "cuda"})
    for where in ("lmkit.config.parallel", "lmkit.plugin_host.resolve"):
        monkeypatch.setattr(f"{where}.cuda_device_count", lambda: 2)
    launches = engine_launches(cfg, {"CUDA_VISIBLE_DEVICES": "4,6", "X": "1"})
    assert [la.index for la in launches] == [0, 1]
    assert [la.env for la in launches] == [{"CUDA_VISIBLE_DEVICES": "4", "X": "1"},
                                           {"CUDA_VISIBLE_DEVICES": "6", "X": "1"}]
    assert all(la.config_json["parallel"]["data_parallel_size"] == 1 for la in launches)
    cpu = engine_launches(_load({"parallel.data_parallel_size": 2, "executor.device": "cpu"}))
    assert len(cpu) == 2 and all("CUDA_VISIBLE_DEVICES" not in la.env for la in cpu)


def test_data_parallel_size_must_be_positive():
    with pytest.raises(ConfigError, match="data_parallel_size"):
        _load({"parallel.data_parallel_size": 0})


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


def test_kv_heads_need_one_per_rank_and_the_mlp_must_divide():
    check_model_split(_config(tensor_parallel_size=2), _facts())
    # KV heads that do not divide are dealt out unevenly (SmolLM2: 9 / 3 heads at tp 2)
    check_model_split(_config(tensor_parallel_size=2), _facts(9, 3, 1536))
    with pytest.raises(ConfigError, match=r"num_key_value_heads=2 is fewer than the ranks.*"
                                          r"split into: 1, 2\.?$"):
        check_model_split(_config(tensor_parallel_size=4), _facts())
    with pytest.raises(ConfigError, match=r"intermediate_size=100 is not divisible by it\. "
                                          r"Sizes this model can be split into: 1, 2, 4, 5\."):
        check_model_split(_config(tensor_parallel_size=3), _facts(8, 8, 100))
    with pytest.raises(ConfigError, match="num_attention_heads=7 is not a multiple of "
                                          "num_key_value_heads=2"):
        check_model_split(_config(tensor_parallel_size=2), _facts(7, 2, 128))


def test_kv_heads_of_rank_deals_whole_groups_first_ranks_first():
    from lmkit.api import kv_heads_of_rank

    assert [kv_heads_of_rank(3, r, 2) for r in range(2)] == [range(0, 2), range(2, 3)]
    assert [kv_heads_of_rank(8, r, 2) for r in range(2)] == [range(0, 4), range(4, 8)]
    assert [len(kv_heads_of_rank(7, r, 3)) for r in range(3)] == [3, 2, 2]
    for kv, size in ((3, 2), (7, 3), (8, 8), (5, 4)):  # every head once, in order
        assert [h for r in range(size) for h in kv_heads_of_rank(kv, r, size)] == list(
            range(kv))
    with pytest.raises(ValueError, match="each rank needs at least one"):
        kv_heads_of_rank(2, 0, 4)


def test_across_ranks_budget_counts_blocks_of_each_ranks_size():
    from lmkit.api import ModelInfo, across_ranks

    def info(per_block, available):
        return ModelInfo(kv_bytes_per_block=per_block, available_kv_bytes=available,
                         device="cpu", dtype="float32")

    # rank 0 has 2 KV heads (200 B blocks), rank 1 one (100 B) but less memory
    combined = across_ranks([info(200, 10_000), info(100, 4_000)])
    assert combined.kv_bytes_per_block == 200
    assert combined.available_kv_bytes // 200 == 40  # rank 1 holds only 40 blocks
    assert across_ranks([info(200, 10_000), info(100, 6_000)]).available_kv_bytes == 10_000


def test_uneven_split_refused_for_a_model_that_does_not_declare_it():
    from lmkit.api import CausalLM, ModelLoadError
    from lmkit.worker.model_build import check_tensor_parallel

    class EvenOnly(CausalLM):
        supports_tensor_parallel = True

    reg = SimpleNamespace(origin="third-party-models")
    ctx = SimpleNamespace(tp_size=2, quantization=None)
    check_tensor_parallel(EvenOnly, reg, "EvenLM", ctx, _facts(kv_heads=4))  # divides: fine
    with pytest.raises(ModelLoadError, match=r"3 key/value heads, which do not divide by 2 "
                                             r"ranks.*supports_uneven_tensor_parallel"):
        check_tensor_parallel(EvenOnly, reg, "EvenLM", ctx, _facts(kv_heads=3))


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


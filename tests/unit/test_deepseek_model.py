"""The DeepSeek-V2/V3 model plugins' wiring: registration (``lmkit plugins list``),
their attention needs (an MLA backend of the latent width; Llama never gets one), what
they refuse (tensor parallelism, draft heads, quantized weights, unknown RoPE types,
a non-MLA backend) and their checkpoint loading (V3's MTP layers skipped). Numerics
against transformers: tests/integration/test_model_parity.py (``deepseek-*``) and
test_deepseek_engine.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lmkit.api import ModelBuildContext, ModelLoadError  # noqa: E402
from lmkit.config.schema import LMKitConfig  # noqa: E402
from lmkit.errors import ConfigError, NoBackendError  # noqa: E402
from lmkit.loading.model_facts import load_model_facts  # noqa: E402
from lmkit.plugin_host.manager import PluginHost  # noqa: E402
from lmkit.plugin_host.resolve import resolve_stack  # noqa: E402
from lmkit.worker.model_build import build_draft_proposer, check_tensor_parallel  # noqa: E402
from lmkit_plugins.attention.mla_torch import MLATorchAttention  # noqa: E402
from lmkit_plugins.attention.torch_ref import TorchAttention  # noqa: E402
from lmkit_plugins.models.deepseek import (  # noqa: E402
    DeepseekV2ForCausalLM,
    DeepseekV3ForCausalLM,
)
from lmkit_plugins.models.moe import SparseMoE  # noqa: E402

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24,
             qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
             first_k_dense_replace=1, max_position_embeddings=128)


def _config(version: int = 3, **kw):
    extra = dict(n_group=2, topk_group=1) if version == 3 else {}
    cls = getattr(transformers, f"DeepseekV{version}Config")
    return cls(**{**SMALL, **extra, "architectures": [f"DeepseekV{version}ForCausalLM"], **kw})


def _host() -> PluginHost:
    return PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})


def _ctx(attention: type = MLATorchAttention, **kw) -> ModelBuildContext:
    return ModelBuildContext(torch.float32, torch.device("cpu"), 16, attention, **kw)


def _needs(hf_config):
    return load_model_facts(Path("/nonexistent"), _host(), hf_config=hf_config).attention_needs


def test_registered_and_listed():
    from lmkit.cli.main import build_app
    from typer.testing import CliRunner

    env = {"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}
    out = CliRunner().invoke(build_app(env=env), ["plugins", "list", "--json"], env=env)
    specs = json.loads(out.stdout)["specs"]
    models = {s["name"]: s for s in specs["model"]}
    assert models["DeepseekV2ForCausalLM"]["available"] is True
    assert models["DeepseekV3ForCausalLM"]["available"] is True
    assert {s["name"]: s for s in specs["attention"]}["mla_torch"]["available"] is True
    assert _host().registry.get("model", "DeepseekV3ForCausalLM").spec.load() \
        is DeepseekV3ForCausalLM


@pytest.mark.parametrize("version", [2, 3])
def test_needs_an_mla_backend_and_auto_picks_one(version):
    needs = _needs(_config(version))
    assert needs.values["attention_kind"] == "mla" and needs.values["head_size"] == 16 + 4
    for dtype in ("float32", "bfloat16"):
        config = LMKitConfig.model_validate({"executor": {"device": "cpu"},
                                             "model": {"dtype": dtype}})
        assert resolve_stack(config, _host(), needs).get("attention").name == "mla_torch"


def test_llama_needs_mha_and_never_gets_an_mla_backend():
    llama = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1,
                                     vocab_size=100, intermediate_size=128,
                                     architectures=["LlamaForCausalLM"])
    needs = _needs(llama)
    assert needs.values["attention_kind"] == "mha"
    for dtype in ("float32", "bfloat16"):
        config = LMKitConfig.model_validate({"executor": {"device": "cpu"},
                                             "model": {"dtype": dtype}})
        assert resolve_stack(config, _host(), needs).get("attention").name in ("cpu", "torch")
    named = LMKitConfig.model_validate({"executor": {"device": "cpu"},
                                        "attention": {"backend": "mla_torch"}})
    with pytest.raises(NoBackendError, match="attention_kind mha not supported"):
        resolve_stack(named, _host(), needs)


def test_refuses_tensor_parallel_draft_heads_and_quantized_weights():
    host = _host()
    reg = host.registry.get("model", "DeepseekV2ForCausalLM")
    with pytest.raises(ModelLoadError, match="supports_tensor_parallel"):
        check_tensor_parallel(DeepseekV2ForCausalLM, reg, "DeepseekV2ForCausalLM",
                              _ctx(tp_size=2), load_model_facts(Path("/nonexistent"), host,
                                                                hf_config=_config(2)))
    config = LMKitConfig.model_validate({"executor": {"device": "cpu"},
                                         "speculative": {"backend": "eagle"}})
    stack = resolve_stack(config, host, _needs(_config(2)))
    with pytest.raises(ConfigError, match="supports_draft_heads"):
        build_draft_proposer(config, stack, DeepseekV2ForCausalLM, "DeepseekV2ForCausalLM",
                             _config(2))
    with pytest.raises(ModelLoadError, match="quantized weights"):
        DeepseekV2ForCausalLM(_config(2), _ctx(quantization=object()))


def test_refuses_a_non_mla_backend_and_an_unknown_rope_type():
    with pytest.raises(ModelLoadError, match="need an MLA attention backend"):
        DeepseekV2ForCausalLM(_config(2), _ctx(TorchAttention))
    with pytest.raises(ModelLoadError, match="unsupported RoPE type 'dynamic'.*default, yarn"):
        DeepseekV3ForCausalLM(_config(3, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
                              _ctx())


@pytest.mark.parametrize(("version", "q_lora"), [(2, None), (3, 24)])
def test_loads_hf_names_and_skips_mtp_layers(version, q_lora):
    config = _config(version, q_lora_rank=q_lora)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    model = DeepseekV3ForCausalLM(config, _ctx()) if version == 3 else \
        DeepseekV2ForCausalLM(config, _ctx())
    assert not isinstance(model.model.layers[0].mlp, SparseMoE)  # first_k_dense_replace
    assert isinstance(model.model.layers[1].mlp, SparseMoE)
    assert (model.model.layers[0].self_attn.q_b_proj is None) == (q_lora is None)
    mtp = {"model.layers.2.eh_proj.weight": torch.zeros(3, 3)}  # a V3 MTP module's tensor
    names = model.load_weights([*_hf_names(hf), *mtp.items()])
    assert "model.layers.2.eh_proj.weight" not in names
    with pytest.raises(ModelLoadError, match="unexpected 1 weight"):
        model.load_weights([*_hf_names(hf), ("model.layers.0.self_attn.bogus", torch.zeros(1))])


def _hf_names(hf) -> list[tuple[str, torch.Tensor]]:
    """The tensors as a checkpoint names them (save_pretrained's per-expert names)."""
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        return sorted(load_file(str(Path(d) / "model.safetensors")).items())


@pytest.mark.parametrize("version", [2, 3])
def test_rope_frequencies_live_on_the_model_device(version):
    """cos/sin are computed on the positions' device with no host copy: a copy from the
    host inside a forward breaks CUDA-graph capture (seen on the H100). On the meta
    device, a host-resident tensor in the product would raise."""
    from lmkit_plugins.models.deepseek_rope import DeepseekRope

    rope = DeepseekRope.from_hf(_config(version), "meta")
    assert rope.inv_freq.device.type == "meta"
    cos, sin = rope.cos_sin(torch.arange(5, device="meta"), torch.bfloat16)
    assert cos.device.type == sin.device.type == "meta" and cos.shape[0] == 5

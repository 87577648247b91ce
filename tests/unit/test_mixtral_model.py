"""The Mixtral model plugin's wiring: its registration (``lmkit plugins list``, model
facts), which experts implementation it runs on the CPU and on CUDA, its tensor-parallel
shards (and TP=2 greedy tokens equal TP=1's), and the load errors of a checkpoint that
does not fit its config. Its
numerics against transformers are in tests/integration/test_model_parity.py and
test_engine_parity.py (``mixtral``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lmkit.api import ModelBuildContext, ModelLoadError, SamplingParams  # noqa: E402
from lmkit.config.schema import LMKitConfig  # noqa: E402
from lmkit.loading.model_facts import load_model_facts  # noqa: E402
from lmkit.plugin_host.manager import PluginHost  # noqa: E402
from lmkit.plugin_host.resolve import resolve_stack  # noqa: E402
from lmkit.worker.model_runner import ModelRunner  # noqa: E402
from lmkit_kernels.moe_ref import fused_moe_ref  # noqa: E402
from lmkit_plugins.attention.torch_ref import TorchAttention  # noqa: E402
from lmkit_plugins.models.mixtral import MixtralForCausalLM  # noqa: E402
from lmkit_plugins.models.moe import SparseMoE  # noqa: E402


def _config(**kw):
    return transformers.MixtralConfig(**{
        "vocab_size": 96, "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
        "num_experts_per_tok": 2, "max_position_embeddings": 128,
        "architectures": ["MixtralForCausalLM"], **kw})


def _host() -> PluginHost:
    return PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})


def _save(directory: Path, **kw) -> Path:
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_config(**kw)).save_pretrained(directory)
    return directory


def _runner(model_dir: Path) -> ModelRunner:
    host = _host()
    config = LMKitConfig.model_validate({
        "model": {"model": str(model_dir), "dtype": "float32", "max_model_len": 64},
        "attention": {"backend": "torch"}, "executor": {"device": "cpu"}})
    return ModelRunner(config, resolve_stack(config, host), host,
                       load_model_facts(model_dir, host, 64))


def test_registered_and_listed():
    from lmkit.cli.main import build_app
    from typer.testing import CliRunner

    env = {"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}
    out = CliRunner().invoke(build_app(env=env), ["plugins", "list", "--json"], env=env)
    models = {s["name"]: s for s in json.loads(out.stdout)["specs"]["model"]}
    assert models["MixtralForCausalLM"]["available"] is True
    registration = _host().registry.get("model", "MixtralForCausalLM")
    assert registration.spec.load() is MixtralForCausalLM


def test_model_facts_and_sliding_window_need():
    facts = load_model_facts(Path("/nonexistent"), _host(), hf_config=_config(sliding_window=8))
    assert facts.architecture == "MixtralForCausalLM" and facts.head_size == 8
    assert "sliding_window" in facts.attention_needs.features
    plain = load_model_facts(Path("/nonexistent"), _host(), hf_config=_config())
    assert "sliding_window" not in plain.attention_needs.features


def test_cpu_layers_are_moe_blocks_on_the_torch_reference():
    model = MixtralForCausalLM(_config(sliding_window=8), ModelBuildContext(
        torch.float32, torch.device("cpu"), 16, TorchAttention))
    assert model.dims.sliding_window == 8
    for layer in model.model.layers:
        assert isinstance(layer.mlp, SparseMoE)
        assert layer.mlp._experts is fused_moe_ref
        assert tuple(layer.mlp.w13.shape) == (4, 80, 32)
        assert tuple(layer.mlp.w2.shape) == (4, 32, 40)


def test_a_tensor_parallel_rank_holds_a_slice_of_every_expert():
    from lmkit_plugins.models.tensor_parallel import TensorParallel

    assert MixtralForCausalLM.supports_tensor_parallel
    ctx = ModelBuildContext(torch.float32, torch.device("cpu"), 16, TorchAttention,
                            tp_rank=1, tp_size=2, tp_group=None)
    model = MixtralForCausalLM(_config(), ctx)
    moe = model.model.layers[0].mlp
    assert moe.tp == TensorParallel(1, 2, None)
    assert tuple(moe.w13.shape) == (4, 40, 32) and tuple(moe.w2.shape) == (4, 32, 20)
    assert moe.gate.weight.shape == (4, 32)  # the router is whole on every rank
    g = torch.Generator().manual_seed(0)
    w1, w3, w2 = (torch.randn(40, 32, generator=g), torch.randn(40, 32, generator=g),
                  torch.randn(32, 40, generator=g))
    targets = moe.weight_targets("b")
    for name, t in (("w1", w1), ("w3", w3), ("w2", w2)):
        targets[f"b.experts.2.{name}.weight"](t)
    # rank 1 of 2: the second half of the gate and up rows, of the down columns
    assert torch.equal(moe.w13[2, :20], w1[20:]) and torch.equal(moe.w13[2, 20:], w3[20:])
    assert torch.equal(moe.w2[2], w2[:, 20:])


def test_checkpoint_with_fewer_experts_is_refused(tmp_path):
    model_dir = _save(tmp_path / "m", num_local_experts=3)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["num_local_experts"] = 4  # config.json says 4 experts, the weights hold 3
    (model_dir / "config.json").write_text(json.dumps(cfg))
    # the router is the first tensor to disagree: one row per expert
    with pytest.raises(ModelLoadError, match=r"block_sparse_moe.gate.weight: .*checkpoint "
                                             r"shape \(3, 32\) does not match the model's "
                                             r"\(4, 32\)"):
        _runner(model_dir).load_model()


def test_checkpoint_without_an_expert_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = _save(tmp_path / "m")
    weights = load_file(model_dir / "model.safetensors")
    for name in [n for n in weights if ".experts.3." in n]:
        del weights[name]
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing 6 weight\(s\): "
                                             r"model.layers.0.block_sparse_moe.experts.3.w1"):
        _runner(model_dir).load_model()


def test_cuda_layers_choose_the_fused_kernel(monkeypatch):
    """On CUDA (any dtype) the experts run lmkit's fused Triton kernel unless
    LMKIT_FUSED_OPS=0; on the CPU always the torch reference."""
    pytest.importorskip("triton")
    from lmkit_plugins.models.fused_ops import fused_moe_enabled, fused_moe_kernel

    monkeypatch.delenv("LMKIT_FUSED_OPS", raising=False)
    assert fused_moe_enabled("cuda") and not fused_moe_enabled("cpu")
    assert fused_moe_kernel().__name__ == "fused_moe"
    monkeypatch.setenv("LMKIT_FUSED_OPS", "0")
    assert not fused_moe_enabled("cuda")


@pytest.mark.slow  # starts two worker processes (about 10 s on 2 CPU cores)
def test_tp2_greedy_equals_tp1(tmp_path):
    """Through LLM on the CPU (gloo): Mixtral split over two ranks (attention heads, a
    slice of every expert) generates the same greedy tokens as on one."""
    from lmkit.frontend.llm import LLM
    from lmkit.testing.tiny_model import make_byte_tokenizer

    model_dir = _save(tmp_path / "m", vocab_size=320, hidden_size=64, intermediate_size=96,
                      initializer_range=0.1, eos_token_id=256, sliding_window=16)
    make_byte_tokenizer().save_pretrained(model_dir)
    prompts = ["hello there", "a much longer prompt about experts and ranks", "x"]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = {}
    for tp in (1, 2):
        with LLM(str(model_dir), device="cpu", dtype="float32", attention="torch",
                 tensor_parallel_size=tp, progress=False) as llm:
            outs[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs[2] == outs[1]
    assert all(len(ids) == 32 for ids in outs[1])

"""``model.load_format: dummy``: random weights from config.json alone, named and shaped
as the architecture's checkpoint, the same on every tensor-parallel rank."""

from __future__ import annotations

import json

import pytest
import torch
from lmkit import LLM, SamplingParams
from lmkit.errors import ConfigError, LMKitError
from lmkit.loading.dummy import _per_expert, checkpoint_shapes, dummy_tensor
from lmkit.loading.weights import load_hf_config
from lmkit.testing.tiny_model import make_tiny_model
from safetensors import safe_open

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(a tiny model with its weights file, the same directory without it)."""
    full = make_tiny_model(tmp_path_factory.mktemp("tiny-full"))
    bare = make_tiny_model(tmp_path_factory.mktemp("tiny-bare"))
    (bare / "model.safetensors").unlink()
    return full, bare


def test_names_and_shapes_are_the_checkpoints(dirs):
    full, _ = dirs
    with safe_open(str(full / "model.safetensors"), "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    assert checkpoint_shapes(load_hf_config(full)) == saved  # tied LM head omitted too


def test_stacked_experts_are_named_per_expert():
    assert _per_expert("model.layers.0.mlp.experts.gate_up_proj", (2, 8, 4)) == {
        "model.layers.0.mlp.experts.0.gate_proj.weight": (4, 4),
        "model.layers.0.mlp.experts.0.up_proj.weight": (4, 4),
        "model.layers.0.mlp.experts.1.gate_proj.weight": (4, 4),
        "model.layers.0.mlp.experts.1.up_proj.weight": (4, 4)}
    assert _per_expert("model.layers.0.mlp.experts.down_proj", (2, 4, 4)) == {
        "model.layers.0.mlp.experts.0.down_proj.weight": (4, 4),
        "model.layers.0.mlp.experts.1.down_proj.weight": (4, 4)}
    assert _per_expert("model.norm.weight", (4,)) == {"model.norm.weight": (4,)}


def test_values_are_seeded_by_name():
    w = dummy_tensor("model.layers.0.mlp.up_proj.weight", (256, 128), torch.float32, "cpu")
    assert abs(float(w.std()) - 0.02) < 0.002 and abs(float(w.mean())) < 0.002
    again = dummy_tensor("model.layers.0.mlp.up_proj.weight", (256, 128), torch.float32, "cpu")
    other = dummy_tensor("model.layers.1.mlp.up_proj.weight", (256, 128), torch.float32, "cpu")
    reseeded = dummy_tensor("model.layers.0.mlp.up_proj.weight", (256, 128), torch.float32,
                            "cpu", seed=1)
    assert torch.equal(w, again) and not torch.equal(w, other) and not torch.equal(w, reseeded)
    assert torch.equal(dummy_tensor("model.norm.weight", (8,), torch.float32, "cpu"),
                       torch.ones(8))
    assert torch.equal(dummy_tensor("model.layers.0.self_attn.q_proj.bias", (8,),
                                    torch.float32, "cpu"), torch.zeros(8))


def test_a_model_without_weight_files_runs_with_dummy_weights(dirs):
    _, bare = dirs
    with pytest.raises(LMKitError, match="safetensors"):
        LLM(str(bare), device="cpu", dtype="float32", progress=False)
    outs = []
    for _ in range(2):
        with LLM(str(bare), device="cpu", dtype="float32", load_format="dummy",
                 progress=False) as llm:
            outs.append([o.outputs[0].token_ids for o in llm.generate(["hi", "a b c"], GREEDY)])
    assert outs[0] == outs[1] and all(len(ids) == 8 for ids in outs[0])


def test_dummy_weights_refuse_a_quantization_method():
    """(On the CPU no method resolves for a dense checkpoint, so the runner's check is
    called directly; on CUDA ``--quantization fp8`` would reach it.)"""
    from types import SimpleNamespace

    from lmkit.config.schema import LMKitConfig
    from lmkit.worker.model_build import check_load_format

    fp8 = SimpleNamespace(get=lambda kind: SimpleNamespace(name="fp8") if kind ==
                          "quantization" else None)
    none = SimpleNamespace(get=lambda kind: None)
    dummy = LMKitConfig.model_validate({"model": {"load_format": "dummy"}})
    with pytest.raises(ConfigError, match="load_format dummy draws dense random weights, "
                                          "which quantization 'fp8' cannot read"):
        check_load_format(dummy, fp8)
    check_load_format(dummy, none)  # dense: fine
    check_load_format(LMKitConfig(), fp8)  # the checkpoint's weights: the method's business


def test_unknown_load_format_is_refused(dirs):
    _, bare = dirs
    with pytest.raises(LMKitError, match="load_format"):
        LLM(str(bare), device="cpu", load_format="random", progress=False)


@pytest.mark.slow
def test_every_rank_draws_the_same_weights(dirs):
    """TP=2 (gloo, two worker processes, each drawing full tensors and keeping its
    shard) gives TP=1's greedy tokens."""
    _, bare = dirs
    got = {}
    for tp in (1, 2):
        with LLM(str(bare), device="cpu", dtype="float32", load_format="dummy",
                 tensor_parallel_size=tp, progress=False) as llm:
            got[tp] = [o.outputs[0].token_ids for o in llm.generate(["hi", "a b c"], GREEDY)]
    assert got[2] == got[1]


def test_the_cli_flag_sets_it(dirs):
    from lmkit.cli.options import FLAGS

    flag = next(f for f in FLAGS if f.name == "load_format")
    assert flag.path == "model.load_format" and "--load-format" in flag.decls
    assert json.loads((dirs[1] / "config.json").read_text())["architectures"]

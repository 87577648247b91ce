"""Tensor-parallel building blocks without a process group: checkpoint slicing (with
the vocabulary's padding) and the single-rank model, which must build no parallel
code at all (no collective, no copy)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from lmkit_plugins.models.tensor_parallel import TensorParallel


def test_shard_splits_rows_and_columns_evenly():
    t = torch.arange(24.0).reshape(4, 6)
    r0, r1 = TensorParallel(0, 2, None), TensorParallel(1, 2, None)
    assert torch.equal(torch.cat([r0.shard(t, 0), r1.shard(t, 0)], 0), t)
    assert torch.equal(torch.cat([r0.shard(t, 1), r1.shard(t, 1)], 1), t)
    assert r1.shard(t, 1).shape == (4, 3)


def test_shard_pads_an_uneven_vocabulary_with_zero_rows():
    table = torch.arange(1.0, 11.0).reshape(5, 2)  # vocab 5 over 2 ranks: 3 rows each
    shards = [TensorParallel(r, 2, None).shard(table, 0) for r in range(2)]
    assert [s.shape for s in shards] == [(3, 2), (3, 2)]
    assert torch.equal(torch.cat(shards)[:5], table)
    assert torch.equal(shards[1][2], torch.zeros(2))
    assert TensorParallel(2, 3, None).shard(torch.ones(4, 1), 0).shape == (2, 1)


def test_one_rank_builds_no_tensor_parallel_code():
    ctx = SimpleNamespace(tp_rank=0, tp_size=1, tp_group=None)
    assert TensorParallel.from_context(ctx) is None
    from lmkit.api import ModelBuildContext
    from lmkit_plugins.attention.torch_ref import TorchAttention
    from lmkit_plugins.models.layers import VocabEmbedding
    from lmkit_plugins.models.llama import LlamaForCausalLM
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg, ModelBuildContext(torch.float32, torch.device("cpu"), 4,
                                                    TorchAttention))
    assert model.tp is None and type(model.model.embed_tokens) is VocabEmbedding
    layer = model.model.layers[0]
    assert layer.self_attn.tp is None and layer.mlp.tp is None
    assert LlamaForCausalLM.supports_tensor_parallel


def test_a_model_without_the_declaration_is_refused_over_ranks(tmp_path, monkeypatch):
    """``CausalLM.supports_tensor_parallel`` defaults to False; the runner refuses to
    split such a model (before building it) naming the architecture and the fix."""
    import pytest
    from lmkit.api import CausalLM, ModelLoadError, ModelRunner
    from lmkit.config.schema import LMKitConfig
    from lmkit.loading.model_facts import load_model_facts
    from lmkit.plugin_host.manager import PluginHost
    from lmkit.plugin_host.resolve import resolve_stack
    from lmkit.testing.tiny_model import make_tiny_model
    from lmkit_plugins.models.llama import LlamaForCausalLM

    assert CausalLM.supports_tensor_parallel is False
    monkeypatch.setattr(LlamaForCausalLM, "supports_tensor_parallel", False)
    model_dir = make_tiny_model(tmp_path / "tiny")
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    config = LMKitConfig.model_validate({
        "model": {"model": str(model_dir), "dtype": "float32", "max_model_len": 64},
        "attention": {"backend": "torch"}, "executor": {"device": "cpu"}})
    runner = ModelRunner(config, resolve_stack(config, host), host,
                         load_model_facts(model_dir, host, 64), tp_rank=0, tp_size=2)
    with pytest.raises(ModelLoadError, match=r"does not declare supports_tensor_parallel.*"
                                             r"split over 2 ranks; use --tp 1"):
        runner.load_model()

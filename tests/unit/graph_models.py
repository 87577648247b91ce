"""Tiny models on Triton backends for the CUDA-graph runner's CPU tests (padded and
flattened replays in Triton's interpreter): a Llama on ``triton`` and a DeepSeek-V3 on
``mla_triton`` (its latent cache), 16-token blocks. Import the fixtures into a test
module to use them."""

from __future__ import annotations

import pytest

BLOCK = 16


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from lmkit.testing.tiny_model import load_tiny_model, make_tiny_model
    from lmkit_plugins.attention.triton_backend import TritonAttention
    from lmkit_plugins.models.llama import LlamaForCausalLM

    path = make_tiny_model(tmp_path_factory.mktemp("tiny"), num_layers=2, hidden_size=64,
                           num_heads=4, num_kv_heads=2)
    return load_tiny_model(path, LlamaForCausalLM, TritonAttention, block_size=BLOCK)


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory):
    pytest.importorskip("transformers")
    from lmkit.testing.tiny_model import load_tiny_model, make_tiny_deepseek
    from lmkit_plugins.attention.mla_triton import MLATritonAttention
    from lmkit_plugins.models.deepseek import DeepseekV3ForCausalLM

    path = make_tiny_deepseek(tmp_path_factory.mktemp("tiny-deepseek"), 3)
    return load_tiny_model(path, DeepseekV3ForCausalLM, MLATritonAttention, block_size=BLOCK)


def random_caches(model, num_blocks: int = 64, seed: int = 1):
    """Random KV caches for ``model`` (one per layer) and a copy of them: the replayed
    path writes one, the eager reference the other."""
    import torch

    shape = model.attn.kv_cache_shape(num_blocks)
    g = torch.Generator().manual_seed(seed)
    caches = [torch.randn(shape, generator=g) for _ in range(model.dims.num_layers)]
    return caches, [c.clone() for c in caches]

"""Shared fixtures for unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    """The real SmolLM2-135M-Instruct tokenizer (byte-level BPE, 49152 ids, chat template),
    from the default model that the alias source fetched into lmkit's cache."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture
def random_trainable_head():
    """A tiny EAGLE-3 training head (hidden 32, vocabulary 50, three taps) with weights
    drawn large (N(0, 0.3)) so that every term of its forward matters; seeded."""
    import torch
    from lmkit_plugins.spec.eagle_trainable import TrainableEagle3
    from transformers import LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=50)
    head = TrainableEagle3(cfg, 3, 50)
    for param in head.parameters():
        param.data.normal_(0, 0.3)
    return head


@pytest.fixture
def fp8_gpu_rounding():
    """Triton's interpreter converts float32 to e4m3 (and bfloat16) as the GPU does, for
    bit-exact FP8 kernel tests; skips where this Triton has no conversion hook."""
    from lmkit_kernels.interpreter import fp8_round_to_nearest

    with fp8_round_to_nearest() as patched:
        if not patched:
            pytest.skip("this Triton's interpreter has no conversion hook to patch")
        yield

"""Fixtures of the integration tests: a tiny random-weight Llama (fast to load)."""

from __future__ import annotations

import shutil

import pytest


@pytest.fixture(scope="session")
def tiny_dir(smollm2_dir, tmp_path_factory):
    """A 2-layer random Llama with SmolLM2's tokenizer and chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja"):
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, path / name)
    return path

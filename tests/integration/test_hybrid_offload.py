"""A hybrid model (Gemma-3: sliding and full layers, two KV cache groups with their own
cache tensors) through the CPU offload tier: prefixes pushed out of a small device pool
come back from the tier, every group's blocks alike, with greedy outputs identical to
recomputing them and to HF's."""

from __future__ import annotations

import json
import random

import pytest
import torch
from lmkit import LLM, SamplingParams
from lmkit.testing.tiny_model import NUM_BYTE_TOKENS, make_byte_tokenizer

BLOCK = 16
PREFIX = 15 * BLOCK  # one prefix nearly fills the device pool
ENGINE = dict(block_size=BLOCK, num_blocks=20, max_model_len=256)  # 19 usable blocks
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _prefix(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(PREFIX)]


P1, P2, P3 = _prefix(1), _prefix(2), _prefix(3)
PROMPTS = [P1 + [1, 2, 3], P2 + [4, 5], P3 + [6], P1 + [7, 8, 9, 10]]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    directory = tmp_path_factory.mktemp("gemma3-offload")
    config = Gemma3TextConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=32,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=512, eos_token_id=NUM_BYTE_TOKENS, bos_token_id=None,
        pad_token_id=NUM_BYTE_TOKENS, architectures=["Gemma3ForCausalLM"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(directory)
    make_byte_tokenizer().save_pretrained(directory)
    (directory / "generation_config.json").write_text(
        json.dumps({"eos_token_id": NUM_BYTE_TOKENS}))
    return directory, model


def _generate(llm: LLM) -> tuple[list[list[int]], list[int]]:
    """One request at a time, so that each one's prefix pushes the last one out."""
    outs = [llm.generate([p], PARAMS)[0] for p in PROMPTS]
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def test_hybrid_groups_offload_and_load_back(gemma3):
    directory, hf = gemma3
    with LLM(str(directory), **ENGINE) as llm:
        reference, cached = _generate(llm)
    assert cached[3] < PREFIX // 2, "the device pool was meant to lose P1"
    size_gb = 200 * 3 * 2 * BLOCK * 2 * 16 * 4 / 2**30  # 200 blocks of 3 layers
    with LLM(str(directory), offload="cpu", **ENGINE,
             **{"offload.options": {"size_gb": size_gb}}) as llm:
        tokens, cached = _generate(llm)
        stats = llm.stats()
    assert tokens == reference
    assert cached[3] == PREFIX, "P1's whole prefix should have come back from the tier"
    assert stats["offload_loaded_blocks"] >= PREFIX // BLOCK - 4 and \
        stats["offload_failed_loads"] == 0, stats
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([PROMPTS[3]]), max_new_tokens=6, min_new_tokens=6,
                          do_sample=False, pad_token_id=0)
    assert tokens[3] == ref[0, len(PROMPTS[3]):].tolist()

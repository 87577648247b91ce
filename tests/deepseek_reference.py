"""Tiny DeepSeek models and transformers' greedy tokens for them, shared by the
engine tests that check DeepSeek against HF (CPU reference and interpreted Triton)."""

from __future__ import annotations

import random

import torch
from lmkit.testing.tiny_model import make_tiny_deepseek


def tiny_deepseek_and_hf(tmp_path_factory, version: int):
    """``(directory, HF model)``: DeepSeek-V2 without q-LoRA, V3 with q-LoRA and YaRN."""
    from transformers import AutoModelForCausalLM

    directory = make_tiny_deepseek(tmp_path_factory.mktemp(f"deepseek-v{version}"), version,
                                   q_lora_rank=None if version == 2 else 32)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return directory, hf


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """HF's greedy continuation, EOS included (a full forward per token: ``generate``
    would stop at EOS or, with ``min_new_tokens``, mask it)."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def tokens(seed: int, n: int) -> list[int]:
    """``n`` seeded random token ids below 256."""
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]

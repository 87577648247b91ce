"""The synthetic target and draft head of the speculative-step benchmarks
(``bench/draft_chain.py``, ``bench/spec_host_profile.py``, ``bench/spec_timeline.py``): a
random SmolLM2-135M-shaped Llama and a random EAGLE-3 head over its layers 2, 15 and 27
(its drafts are almost never accepted, so every speculative step has the same shape),
and random token-id prompts; or a real target and head given on the command line, on
the built-in chat prompts."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any


def synthetic_pair(root: Path) -> tuple[Path, Path]:
    """Write the target and the head under ``root``; their directories."""
    from lmkit.testing.eagle_head import make_tiny_eagle3_head
    from lmkit.testing.tiny_model import make_tiny_model

    target = make_tiny_model(root / "target", vocab_size=49152, num_layers=30, hidden_size=576,
                             num_heads=9, num_kv_heads=3, max_position_embeddings=2048)
    head = make_tiny_eagle3_head(root / "head", target, layer_ids=(2, 15, 27),
                                 draft_vocab_size=8192, layer_std=0.02)
    return target, head


def random_prompts(n: int, length: int = 40, seed: int = 0) -> list[dict]:
    """``n`` prompts of ``length`` random token ids (the same for the same seed)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(300, 40000, (length,), generator=gen).tolist()}
            for _ in range(n)]


def pair_and_prompts(model: str | None, head: str | None, n: int
                     ) -> tuple[str, str | None, list[dict] | None]:
    """``(target, head, prompts)`` for a benchmark: ``model`` resolved once (a GGUF file
    converted once, not per engine) with ``head`` and ``None`` for prompts (take
    :func:`chat_prompts` of the engine's tokenizer); without ``model`` the synthetic
    pair (``head`` defaults to its random head) and ``n`` random prompts."""
    if model is not None:
        from lmkit.loading.resolve import resolve_model
        from lmkit.plugin_host.manager import PluginHost

        return str(resolve_model(model, PluginHost.load())), head, None
    target, random_head = synthetic_pair(Path(tempfile.mkdtemp(prefix="spec-pair-")))
    return str(target), head or str(random_head), random_prompts(n)


def chat_prompts(tokenizer: Any, n: int, output_len: int) -> list[dict]:
    """``n`` of the built-in chat prompts, rendered with ``tokenizer``'s chat template,
    as token-id prompts."""
    from lmkit.benchmarking.workload import chat_workload

    return [{"prompt_token_ids": p} for p in chat_workload(tokenizer, n, output_len).prompts]

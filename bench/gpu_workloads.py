"""The GPU engine benchmark's workloads W1-W7 as token ids (fixed seed), and the subsets
a slow peer runs (``--hf-subset``)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench_sides as sides  # noqa: E402

SMALL, LARGE, DEEPSEEK = "qwen3-0.6b", "llama-3.1-8b", "deepseek-v2-lite"
HUGE = "llama-3.1-70b"  # W6/W7: W2/W3 on the 70B shape (several GPUs: --tp 2)
#: each workload's model, and the toy model --smoke puts in its place
WORKLOAD_MODELS = {"W1": SMALL, "W2": LARGE, "W3": LARGE, "W4": DEEPSEEK, "W5": DEEPSEEK,
                   "W6": HUGE, "W7": HUGE}
SMOKE_MODELS = {SMALL: "tiny-qwen3", LARGE: "tiny-llama", DEEPSEEK: "tiny-deepseek-v2",
                HUGE: "tiny-llama"}


def make_workloads(smoke: bool) -> dict[str, sides.Workload]:
    """W1-W7 as token ids (fixed seed); toy sizes with ``smoke``. W4/W5 are W3/W2's
    requests (the same ids) for the DeepSeek model, W6/W7 W2/W3's for the 70B shape."""
    rng = np.random.default_rng(0)
    n1, lo, hi = (8, 10, 40) if smoke else (256, 100, 1024)
    vocab = 1000 if smoke else 10000
    prompt_lens = rng.integers(lo, hi + 1, n1)
    output_lens = rng.integers(lo, hi + 1, n1)
    w1 = [rng.integers(0, vocab, int(n)).tolist() for n in prompt_lens]
    p2, o2 = (16, 8) if smoke else (128, 256)
    n3, p3, o3 = (6, 32, 8) if smoke else (256, 512, 256)
    w2 = {"name": "W2", "prompts": [rng.integers(0, vocab, p2).tolist()], "output_lens": [o2]}
    w3 = {"name": "W3", "prompts": [rng.integers(0, vocab, p3).tolist() for _ in range(n3)],
          "output_lens": [o3] * n3}
    return {"W1": {"name": "W1", "prompts": w1, "output_lens": output_lens.tolist()},
            "W2": w2, "W3": w3, "W4": {**w3, "name": "W4"}, "W5": {**w2, "name": "W5"},
            "W6": {**w2, "name": "W6"}, "W7": {**w3, "name": "W7"}}


def subset(wl: sides.Workload, n: int | None) -> sides.Workload:
    """The first ``n`` requests of ``wl`` (all of them for ``n`` None or too large)."""
    if not n or n >= len(wl["prompts"]):
        return wl
    return {**wl, "prompts": wl["prompts"][:n], "output_lens": wl["output_lens"][:n],
            "subset_of": len(wl["prompts"])}


def parse_subsets(text: str) -> dict[str, int]:
    """``"W1=32,W3=64"`` -> ``{"W1": 32, "W3": 64}``."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, n = part.partition("=")
        out[name.strip().upper()] = int(n)
    return out

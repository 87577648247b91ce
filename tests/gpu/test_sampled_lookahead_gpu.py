"""Sampled decode steps launched ahead on CUDA (graphs, triton): requests sampling at
random with top-k 1 (the argmax, so the tokens are known) get greedy decoding's tokens
while their steps come from the lookahead; unfiltered sampling stays in the vocabulary.
Float32: in bf16 the top logits tie now and then, and top-k 1 keeps every tied token
(the argmax takes the first), so the tokens could differ without any fault."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_only import require_cuda_and_triton  # noqa: E402

require_cuda_and_triton()
pytestmark = pytest.mark.gpu

from lmkit import LLM, SamplingParams  # noqa: E402
from lmkit.testing.tiny_model import make_tiny_model  # noqa: E402


def test_sampled_steps_are_launched_ahead_with_the_same_tokens(tmp_path):
    model = str(make_tiny_model(tmp_path / "tiny", hidden_size=256, num_heads=4,
                                num_kv_heads=2))
    prompts = [{"prompt_token_ids": [3 + (11 * i + j) % 200 for j in range(5 + 9 * i)]}
               for i in range(6)]

    def run(**sampling):
        params = SamplingParams(**sampling, max_tokens=80, ignore_eos=True)
        with LLM(model, device="cuda", dtype="float32", attention="triton",
                 max_model_len=256, progress=False) as llm:
            outs = llm.generate(prompts, params)
            stats = llm.engine.executor.runner.lookahead.stats
            return [list(o.outputs[0].token_ids) for o in outs], stats

    greedy, _ = run(temperature=0.0)
    sampled, stats = run(temperature=0.8, top_k=1)
    assert sampled == greedy
    assert stats.used >= 60, stats  # most of the 80 decode steps came from the lookahead
    free, stats = run(temperature=1.0, top_p=0.9)
    assert all(len(t) == 80 and all(0 <= x < 320 for x in t) for t in free)
    assert stats.used >= 60, stats

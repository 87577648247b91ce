"""EAGLE and EAGLE-3 over an FP8 KV cache (CPU): the target's cache and the head's own
are both float8 e4m3, and greedy outputs with speculation equal the same engine's
without it (speculation stays lossless over a quantized cache)."""

from __future__ import annotations

import pytest
import torch
from eagle_engine import COMMON, GREEDY, PROMPTS, tokens
from lmkit import LLM

FP8 = dict(kv_cache_dtype="fp8", **{**COMMON, "max_model_len": 64})


@pytest.fixture(scope="module")
def fp8_baseline(tiny):
    with LLM(str(tiny), num_blocks=96, **FP8) as llm:
        return tokens(llm.generate(PROMPTS, GREEDY))


@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
def test_greedy_outputs_identical_with_eagle_over_fp8(tiny, heads, fp8_baseline, proposer):
    with LLM(str(tiny), speculative=proposer, speculative_model=str(heads[proposer]),
             num_speculative_tokens=3, num_blocks=96, max_num_seqs=8, **FP8) as llm:
        runner = llm.engine.executor.runner
        assert all(c.dtype == torch.float8_e4m3fn for c in runner.kv_caches)
        head_caches = runner.drafter.kv_caches
        assert head_caches and all(c.dtype == torch.float8_e4m3fn for c in head_caches)
        assert tokens(llm.generate(PROMPTS, GREEDY)) == fp8_baseline
        stats = llm.stats()
    assert stats["spec_num_verifications"] > 0 and stats["spec_num_draft_tokens"] > 0

"""The llama.cpp side of ``lmkit bench throughput --peer llamacpp`` and of the quality
bench's perplexity: many sequences in one llama.cpp context give the same greedy tokens
as each sequence alone, and teacher-forced log-probabilities match one-token-at-a-time
decoding of the same ids."""

from __future__ import annotations

import math

import pytest
from lmkit.benchmarking.workload import Workload
from test_model_sources import write_tiny_llama_gguf

pytest.importorskip("llama_cpp")
from lmkit.benchmarking.llamacpp_batch import (  # noqa: E402
    LlamaCppContext,
    greedy,
    llamacpp_throughput,
    prompt_logprobs,
)

PROMPTS = [[3, 4, 5, 6, 7, 8, 9], [10, 4], [5, 5, 6, 12, 13, 3, 4, 8, 9, 10]]
WANTS = [6, 3, 5]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("llamacpp") / "tiny.gguf"
    write_tiny_llama_gguf(path)
    return path


def test_batched_greedy_matches_each_sequence_alone(tiny_gguf):
    lc = LlamaCppContext(tiny_gguf, len(PROMPTS), 32, threads=1, n_batch=8)
    try:  # n_batch 8 < the 19 prompt tokens: the prefill spans several decode calls
        together = greedy(lc, PROMPTS, WANTS)
        alone = [greedy(lc, [p], [n])[0] for p, n in zip(PROMPTS, WANTS, strict=True)]
    finally:
        lc.close()
    assert [len(t) for t in together] == WANTS
    assert together == alone


def test_prompt_logprobs_match_token_by_token_decoding(tiny_gguf):
    ids = PROMPTS[2]
    scored = prompt_logprobs(tiny_gguf, ids, threads=1)
    assert len(scored) == len(ids) - 1 and all(lp < 0 for lp in scored)
    lc = LlamaCppContext(tiny_gguf, 1, 32, threads=1)
    try:
        for i, tok in enumerate(ids[:-1]):
            row = lc.decode([(tok, i, 0, True)])[0].astype(float)
            m = row.max()
            ref = row[ids[i + 1]] - m - math.log(sum(math.exp(x - m) for x in row))
            assert scored[i] == pytest.approx(ref, abs=1e-4)
    finally:
        lc.close()


def test_throughput_side_counts_every_requested_token(tiny_gguf):
    result = llamacpp_throughput(tiny_gguf, Workload("toy", PROMPTS, WANTS), threads=1)
    assert result["output_tokens"] == sum(WANTS) and result["elapsed_s"] > 0

"""bench/greedy_divergence.py: the first difference between two token lists, the plain
engine's logprob gap at a position, and a run on SmolLM2 (CPU, float32), where greedy
ngram speculation must not differ at all."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import greedy_divergence as gd  # noqa: E402


def test_first_difference_counts_lengths():
    assert gd.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert gd.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert gd.first_difference([1, 2], [1, 2, 3]) == 2
    assert gd.first_difference([], []) is None


def test_gap_at_reads_the_plain_engines_logprobs(smollm2_dir):
    from lmkit import SamplingParams
    from lmkit.frontend.llm import LLM

    with LLM(str(smollm2_dir), device="cpu", dtype="float32") as llm:
        (context,) = gd.chat_prompts(llm)[-1:]
        (out,) = llm.generate([context], SamplingParams(temperature=0.0, max_tokens=1,
                                                        logprobs=5))
        lp = out.outputs[0].logprobs[0]
        runner_up = next(t for t, _ in lp.iter_top() if t != lp.token_id)
        gap = gd.gap_at(llm, context, lp.token_id, runner_up)
    top = dict(lp.iter_top())
    assert gap["greedy"] == gap["want"] == lp.token_id and gap["got"] == runner_up
    # (the second call reads the first's cached prefix: its sums round a little apart)
    assert gap["gap_want_got"] == pytest.approx(top[lp.token_id] - top[runner_up], abs=1e-4)
    assert gap["gap_want_got"] > 0.01
    assert gap["top2_gap"] == gap["gap_want_got"]  # the runner-up is the second best


def test_ngram_speculation_on_cpu_float32_differs_nowhere(smollm2_dir, tmp_path):
    out = tmp_path / "d.json"
    report = gd.main(["--model", str(smollm2_dir), "--count", "2", "--max-tokens", "24",
                      "--max-num-seqs", "1", "2", "--out", str(out)])
    assert report["num_prompts"] == 2
    assert [(r["max_num_seqs"], r["identical"], r["differences"]) for r in report["runs"]] == [
        (1, True, []), (2, True, [])]
    assert json.loads(out.read_text())["runs"] == report["runs"]

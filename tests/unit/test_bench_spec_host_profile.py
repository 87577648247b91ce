"""bench/spec_host_profile.py: the per-engine profile (run here on the CPU's tiny model)
writes both tables and reports its steps; without CUDA the command refuses to run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import spec_host_profile  # noqa: E402


def test_profile_side_writes_its_tables(tmp_path):
    from lmkit import LLM, SamplingParams
    from lmkit.testing.tiny_model import make_tiny_model

    tiny = make_tiny_model(tmp_path / "tiny")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}]
    with LLM(str(tiny), device="cpu", dtype="float32", max_model_len=64, num_blocks=64,
             block_size=4) as llm:
        line = spec_host_profile.profile_side(llm, prompts, params, 1, tmp_path, "plain")
    assert line.startswith("plain: 12 steps,") and "ms per token" in line
    table = (tmp_path / "prof_plain.txt").read_text()
    assert "Ordered by: internal time" in table and "Ordered by: cumulative time" in table
    assert "execute_model" in table


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CUDA present")
def test_needs_cuda(tmp_path, capsys):
    assert spec_host_profile.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "message"), [
    (["--proposer", "ngram", "--speculative-model", "HEAD", "--model", "M"],
     "--proposer ngram takes no --speculative-model"),
    (["--model", "M"], "--model and --speculative-model go together"),
])
def test_refuses_mismatched_pair(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        spec_host_profile.main(["--out", str(tmp_path), *args])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err

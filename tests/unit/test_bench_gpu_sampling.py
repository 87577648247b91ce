"""bench/gpu_engine.py's ``--sampling``: the same sampling parameters for every request
of both sides (lmkit and vLLM), the workloads' lengths kept; bad values refused."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import gpu_bench_sides  # noqa: E402
import gpu_bench_vllm  # noqa: E402
import gpu_engine  # noqa: E402

SAMPLING = {"temperature": 0.7, "repetition_penalty": 1.1, "presence_penalty": 0.3}


def test_vllm_requests_take_the_sampling_and_keep_the_lengths(monkeypatch):
    fake = types.ModuleType("vllm")
    fake.SamplingParams = lambda **kw: kw  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", fake)
    assert gpu_bench_vllm._params(5, SAMPLING) == {**SAMPLING, "max_tokens": 5,
                                                   "ignore_eos": True, "detokenize": False}
    assert gpu_bench_vllm._params(5)["temperature"] == 0.0  # greedy by default


def test_the_warm_up_samples_as_the_workload_does():
    wl = {"name": "W1", "prompts": [[1, 2, 3]] * 4, "output_lens": [40] * 4,
          "sampling": SAMPLING}
    assert gpu_bench_sides.warmup(wl, 2)["sampling"] == SAMPLING


@pytest.mark.parametrize("value", ['{"max_tokens": 3}', '[1, 2]', '{"ignore_eos": false}'])
def test_sampling_that_would_change_the_workload_is_refused(monkeypatch, capsys, value):
    monkeypatch.setattr(sys, "argv", ["gpu_engine.py", "--smoke", "--workloads", "W1",
                                      "--sampling", value])
    with pytest.raises(SystemExit):
        gpu_engine.main()
    assert "--sampling takes a JSON object" in capsys.readouterr().err


def test_a_baseline_checkout_without_sampling_is_refused(monkeypatch, capsys, tmp_path):
    """An older checkout's bench runs its own lmkit side: without --sampling support it
    would decode greedily and its row would compare greedy against sampled decoding."""
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "gpu_bench_sides.py").write_text("params = greedy\n")
    monkeypatch.setattr(sys, "argv", ["gpu_engine.py", "--smoke", "--workloads", "W1",
                                      "--baseline-tree", str(tmp_path),
                                      "--sampling", '{"temperature": 0.7}'])
    with pytest.raises(SystemExit):
        gpu_engine.main()
    assert "has no --sampling" in capsys.readouterr().err

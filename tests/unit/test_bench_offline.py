"""``lmkit bench throughput|latency``: paired rounds, and both sides on a tiny model."""

from __future__ import annotations

import json

import pytest
from lmkit.benchmarking import offline
from lmkit.benchmarking.offline import BenchSetup, format_report
from lmkit.benchmarking.workload import Workload

WORKLOAD = Workload("toy", [[5, 6, 7], [8, 9]], [4, 4])
SETUP = BenchSetup("toy-model", "/nonexistent", {}, "float32", "cpu", 1)


def fake_sides(lmkit_times, hf_times, calls):
    """Side runners returning the given elapsed times in turn, logging the call order."""
    lmkit_times, hf_times = iter(lmkit_times), iter(hf_times)

    def run_lmkit():
        calls.append("lmkit")
        return {"elapsed_s": next(lmkit_times), "output_tokens": 8}

    def run_hf():
        calls.append("hf")
        return {"elapsed_s": next(hf_times), "output_tokens": 8}

    return run_lmkit, run_hf


def test_rounds_alternate_and_report_the_median_round():
    calls: list[str] = []
    # ratios per round: 2.0, 4.0, 1.0 -> the median round is the first
    run_lmkit, run_hf = fake_sides([1.0, 1.0, 2.0], [2.0, 4.0, 2.0], calls)
    report = offline._paired("latency", SETUP, WORKLOAD, run_lmkit, run_hf, rounds=3)
    assert calls == ["lmkit", "hf", "hf", "lmkit", "lmkit", "hf"]
    assert report["ratio_per_round"] == [2.0, 4.0, 1.0]
    assert report["ratio_output_tokens_per_s"] == 2.0
    assert report["lmkit"]["elapsed_s"] == 1.0 and report["hf"]["elapsed_s"] == 2.0
    assert len(report["rounds"]) == 3
    text = format_report(report)
    assert "2.00x (median of 3 rounds: 2.00x, 4.00x, 1.00x" in text


def test_one_round_without_a_peer_has_no_ratio():
    calls: list[str] = []
    run_lmkit, run_hf = fake_sides([2.0], [], calls)
    report = offline._paired("throughput", SETUP, WORKLOAD, run_lmkit, None, rounds=1)
    assert calls == ["lmkit"]
    assert report["lmkit"]["output_tokens_per_s"] == 4.0
    assert "hf" not in report and "ratio_output_tokens_per_s" not in report
    assert "rounds" not in report


def test_zero_rounds_is_refused():
    run_lmkit, run_hf = fake_sides([], [], [])
    with pytest.raises(ValueError, match="rounds must be at least 1, got 0"):
        offline._paired("latency", SETUP, WORKLOAD, run_lmkit, run_hf, rounds=0)


@pytest.mark.slow  # about 15 s on 2 CPU cores
def test_latency_bench_runs_both_sides_on_a_tiny_model(tmp_path):
    from lmkit.testing.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "tiny")
    setup = BenchSetup("tiny", str(model_dir), {"dtype": "float32", "device": "cpu"},
                       "float32", "cpu", 1)
    report = offline.latency(setup, WORKLOAD, "hf", rounds=2)
    assert [sorted(r) for r in report["rounds"]] == [
        ["hf", "lmkit", "ratio_output_tokens_per_s"]] * 2
    for side in ("lmkit", "hf"):
        assert report[side]["output_tokens"] == 8 and report[side]["elapsed_s"] > 0
    assert report["lmkit"]["tpot_ms"] > 0
    path = tmp_path / "r.json"
    offline.save_report(report, path)
    assert json.loads(path.read_text())["ratio_output_tokens_per_s"] > 0

"""bench/gpu_engine.py's ``--repeats N``: each side times a workload N times in one
process (later runs on shifted token ids); rows take each side's median run and the
report lists every run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import gpu_bench_sides  # noqa: E402
import gpu_engine  # noqa: E402
from gpu_report import combine, format_table  # noqa: E402

WL = {"name": "W1", "prompts": [[1, 2, 3], [4, 5]], "output_lens": [4, 4]}


def _runs(speeds):
    seen = []

    def run(wl):
        seen.append(wl["prompts"])
        return {"workload": "W1", "output_tokens_per_s": speeds[len(seen) - 1],
                "tpot_ms": 1e3 / speeds[len(seen) - 1]}
    return run, seen


def test_one_run_is_returned_as_it_came():
    run, seen = _runs([100.0])
    assert gpu_bench_sides.repeat_runs(run, WL, 1) == {"workload": "W1",
                                                       "output_tokens_per_s": 100.0,
                                                       "tpot_ms": 10.0}
    assert seen == [WL["prompts"]]


@pytest.mark.parametrize("speeds, median", [([300.0, 100.0, 200.0], 200.0),
                                            ([300.0, 100.0, 200.0, 400.0], 200.0)])
def test_the_median_run_is_kept_with_every_runs_figures(speeds, median):
    run, seen = _runs(speeds)
    result = gpu_bench_sides.repeat_runs(run, WL, len(speeds))
    assert result["output_tokens_per_s"] == median and result["tpot_ms"] == 1e3 / median
    assert result["runs_tok_s"] == speeds
    assert result["runs_tpot_ms"] == [1e3 / s for s in speeds]
    # the first run on the workload's own ids, the later ones shifted (no cache hits)
    assert seen[0] == WL["prompts"]
    assert len({json.dumps(p) for p in seen}) == len(speeds)
    assert seen[1] == gpu_bench_sides.shifted(WL, 13)["prompts"]


def test_rows_and_table_list_the_runs():
    report = {"workloads": ["W1"], "workload_sizes": {"W1": [4, 4]},
              "lmkit": {"m": {"results": [{"workload": "W1", "output_tokens_per_s": 240.0,
                                           "elapsed_s": 1.0, "output_tokens": 8,
                                           "runs_tok_s": [245.0, 240.0, 230.0]}]}},
              "vllm": {"m": {"results": [{"workload": "W1", "output_tokens_per_s": 200.0,
                                          "runs_tok_s": [190.0, 200.0, 210.0]}]}},
              "hf": {}, "lmkit_baseline": {}}
    report["rows"] = rows = combine(report, {"W1": "m"})
    assert rows[0]["ratio_vs_vllm"] == pytest.approx(1.2)
    assert rows[0]["lmkit_runs_tok_s"] == [245.0, 240.0, 230.0]
    assert rows[0]["vllm_runs_tok_s"] == [190.0, 200.0, 210.0]
    assert ("W1 timed runs (tok/s; the table shows each side's median): "
            "lmkit 245 / 240 / 230; vLLM 190 / 200 / 210") in format_table(report)


def test_a_bad_repeat_count_is_refused(capsys):
    with pytest.raises(SystemExit):
        gpu_engine.main(["--repeats", "0"])
    assert "--repeats must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.slow
def test_smoke_run_times_each_workload_twice(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "gpu_engine.py"), "--smoke", "--workloads", "W2",
         "--peer", "none", "--repeats", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(out.read_text())["rows"][0]
    assert len(row["lmkit_runs_tok_s"]) == 2 and row["lmkit_tok_s"] in row["lmkit_runs_tok_s"]
    assert "W2 timed runs (tok/s" in proc.stdout

"""bench/mixed_steps.py on the CPU with a tiny model: arrivals make mixed steps, the rest
decode, every timed step is counted, and bad arguments are refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "mixed_steps.py"


@pytest.mark.slow
def test_smoke_times_one_mixed_step_per_arrival(tmp_path):
    out = tmp_path / "r.json"
    run = subprocess.run([sys.executable, str(BENCH), "--smoke", "--every", "3", "--profile",
                          "1", "--workdir", str(tmp_path / "models"), "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    kinds = report["kinds"]
    assert kinds["mixed"]["steps"] == report["arrivals"] == 3
    assert kinds["decode"]["steps"] == 3 * 2
    assert kinds["mixed"]["p50_ms"] > 0 and set(kinds["mixed"]["allocator"]) == {
        "num_alloc_retries", "num_device_alloc", "num_device_free"}
    assert report["profile"]["host_top"], "the profiled arrival recorded host ops"


def test_bad_arguments_are_refused():
    run = subprocess.run([sys.executable, str(BENCH), "--every", "0"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and "--every and --arrivals must be at least 1" in run.stderr

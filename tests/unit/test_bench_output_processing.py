"""bench/output_processing.py on the CPU: both sides run over the same steps (a
revision's ``OutputProcessor`` loaded from git, the working tree's) and report."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "output_processing.py"


@pytest.mark.parametrize("streaming", [False, True])
def test_runs_both_sides(streaming):
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=BENCH.parent,
                      capture_output=True).returncode:
        pytest.skip("not a git checkout")
    args = [sys.executable, str(BENCH), "--rev", "HEAD", "--batch", "3", "--steps", "5",
            "--rounds", "2"] + (["--streaming"] if streaming else [])
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (line,) = proc.stdout.splitlines()
    assert line.startswith("batch    3, 5 steps: before") and "after" in line


"""bench/scheduler_step.py on the CPU: the working tree's scheduler timed in-process
and both sides (a revision's ``core/`` from git, the working tree's) in a short run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "scheduler_step.py"


def test_runs_both_sides():
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=BENCH.parent,
                      capture_output=True).returncode:
        pytest.skip("not a git checkout")
    proc = subprocess.run([sys.executable, str(BENCH), "--rev", "HEAD", "--batch", "4",
                           "--steps", "8", "--rounds", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (line,) = proc.stdout.splitlines()
    assert line.startswith("batch    4: before") and "after" in line

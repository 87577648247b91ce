"""bench/eagle_train_steps.py on the CPU: a revision's train-eagle (``plugins/`` from
git) and the working tree's, timed on the same data; equal trees train the same
losses."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "eagle_train_steps.py"


@pytest.mark.slow  # a 1-layer SmolLM2-shaped target answers 8 prompts, then 2 short runs
def test_runs_both_sides_on_the_same_data():
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=BENCH.parent,
                      capture_output=True).returncode:
        pytest.skip("not a git checkout")
    proc = subprocess.run([sys.executable, str(BENCH), "--rev", "HEAD", "--device", "cpu",
                           "--layers", "1", "--prompts", "8", "--steps", "2", "--rounds", "1",
                           "--batch-size", "4", "--max-new-tokens", "16"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    timing, losses = proc.stdout.strip().splitlines()[-2:]
    assert timing.startswith("train-eagle steps of 4 (cpu): before") and "after" in timing
    # HEAD's train-eagle is this tree's when nothing is changed: the same losses
    found = re.search(r"step 2 (\S+) / (\S+); largest difference (\S+)", losses)
    assert found is not None, losses
    if not subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "plugins"],
                          cwd=BENCH.parent).returncode:
        assert found[1] == found[2] and float(found[3]) == 0.0

"""bench/sampling.py's ``--rev``: the Triton ``sample`` of a git revision's kernels timed
beside the working tree's (CPU, Triton interpreted), and ``--kernel-only``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "sampling.py"
sys.path.insert(0, str(BENCH.parent))
from sampling import parse_args, strip_rev  # noqa: E402


def test_strip_rev_drops_the_revision_and_the_output():
    argv = ["--smoke", "--rev", "HEAD~1", "--json", "a.json", "--rev=x", "--json=b", "--k", "0"]
    assert strip_rev(argv) == ["--smoke", "--k", "0"]


def test_kernel_only_and_rev_need_triton():
    with pytest.raises(SystemExit):
        parse_args(["--kernel-only", "--no-triton"])
    with pytest.raises(SystemExit):
        parse_args(["--rev", "HEAD", "--no-triton"])
    assert parse_args(["--kernel-only", "--k", "4"]).k == 0


@pytest.mark.slow
def test_rev_times_both_kernels(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(BENCH), "--device", "cpu", "--smoke", "--modes", "top-k+p",
           "--k", "0", "--rev", "HEAD", "--json", str(out)]
    proc = subprocess.run(cmd, env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "rev_us" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["op"], r["mode"], r["batch"]) for r in rows] == [
        ("sample", "top-k+p", 1), ("sample", "top-k+p", 3)]
    assert all(r["triton_us"] > 0 and r["rev_us"] > 0 and r["torch_us"] > 0 for r in rows)

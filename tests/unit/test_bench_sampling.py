"""bench/sampling.py runs on CPU (tiny shapes, Triton interpreted) and writes its table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("triton", [False, True], ids=["torch-only", "with-triton"])
def test_bench_sampling_smoke(tmp_path, triton):
    if triton:
        pytest.importorskip("triton")
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(ROOT / "bench" / "sampling.py"), "--device", "cpu", "--smoke",
           "--modes", "greedy", "top-p", "--json", str(out)]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(cmd + ([] if triton else ["--no-triton"]), env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "torch_us" in proc.stdout and "verify k=4" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["op"], r["mode"], r["batch"]) for r in rows] == [
        (op, mode, batch) for batch in (1, 3) for mode in ("greedy", "top-p")
        for op in ("sample", "verify k=4")]
    assert all(r["torch_us"] > 0 for r in rows)
    assert all(("triton_us" in r) == triton for r in rows)
    # the sampler with the triton sampling kernels (their policy), except greedy verify
    assert all(("wired_us" in r) == (triton and (r["mode"], r["op"]) != ("greedy", "verify k=4"))
               for r in rows)

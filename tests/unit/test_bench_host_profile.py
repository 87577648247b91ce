"""bench/host_profile.py on the CPU (a tiny model): it profiles the asked number of
decode steps, reports the engine's own functions by own and cumulative time, and its
sync finder says there is nothing to find without CUDA. bench/overlap_probe.py refuses
to run without a GPU, saying so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_host_profile_smoke(tmp_path):
    out = tmp_path / "host.json"
    cmd = [sys.executable, str(ROOT / "bench" / "host_profile.py"), "--model", "tiny-qwen3",
           "--requests", "4", "--prompt-len", "12", "--steps", "3", "--sync-steps", "1",
           "--sampling", '{"temperature": 0.7, "repetition_penalty": 1.1}', "--top", "15",
           "--model-root", str(tmp_path / "models"), "--out", str(out)]
    proc = subprocess.run(cmd, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "3 steps profiled" in proc.stdout and "# by cumulative" in proc.stdout
    report = json.loads(out.read_text())
    assert report["step_ms"] > 0
    names = [r["function"] for r in report["cumulative"]]
    assert any("step" in n for n in names) and len(report["tottime"]) == 15
    assert report["syncs"] == {"(no CUDA: nothing to find)": 0}


def test_host_profile_refuses_a_bad_sampling_argument():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "host_profile.py"),
                           "--sampling", "[1, 2]"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 2 and "JSON object" in proc.stderr


def test_overlap_probe_needs_a_gpu():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "overlap_probe.py")],
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode != 0 and "needs a CUDA GPU" in proc.stderr

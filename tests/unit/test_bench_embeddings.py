"""bench/embeddings.py runs end to end on a few texts (both clocks' option) and writes
its JSON: rates, ratios, and lmkit's vectors agreeing with sentence-transformers'."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # loads all-MiniLM-L6-v2 three times
def test_bench_embeddings_smoke_with_cpu_clock(tmp_path, minilm_dir):
    pytest.importorskip("sentence_transformers")
    out = tmp_path / "emb.json"
    cmd = [sys.executable, str(ROOT / "bench" / "embeddings.py"), "--model", str(minilm_dir),
           "--texts", "8", "--batch-size", "4", "--rounds", "1", "--threads", "1",
           "--dtypes", "float32", "--clock", "cpu", "--out", str(out)]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["clock"] == "cpu" and result["texts"] == 8
    assert result["median_texts_per_s"]["lmkit_float32"] > 0
    assert result["min_cosine_vs_sentence_transformers_float32"]["lmkit_float32"] >= 0.9999
    bad = subprocess.run([*cmd[:2], "--clock", "gpu"], capture_output=True, text=True,
                         timeout=60, check=False)
    assert bad.returncode == 2 and "invalid choice: 'gpu'" in bad.stderr

"""bench/mixed_pooling.py runs end to end with tiny random models on the CPU: generation
alone and beside an embedding stream from a second engine in its own process (the
plumbing of the CUDA run), and the random MiniLM-shaped BERT tokenizes word by word."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # two engines in two processes (~15 s on 2 cores)
def test_mixed_pooling_with_a_separate_embedding_engine(tmp_path):
    out = tmp_path / "mixed.json"
    cmd = [sys.executable, str(ROOT / "bench" / "mixed_pooling.py"), "--device", "cpu",
           "--model", "bench:tiny-qwen3", "--embed-model", "random-bert-tiny",
           "--streams", "2", "--tokens", "8", "--rounds", "1", "--threads", "1",
           "--embed-batch", "4", "--workdir", str(tmp_path / "models"), "--out", str(out)]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["embed_model"] == "random-bert-tiny"
    summary = result["summary"]
    assert summary["alone"]["embeddings_per_s"] == 0
    assert summary["mixed"]["embeddings_per_s"] > 0  # the stream ran during generation
    assert all(summary[k]["median_step_ms"] > 0 for k in ("alone", "mixed"))


def test_random_minilm_tokenizes_word_by_word(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from embeddings import make_texts
        from mixed_pooling import write_random_bert
    finally:
        sys.path.pop(0)
    from transformers import AutoTokenizer

    directory = write_random_bert("random-bert-tiny", tmp_path)
    assert write_random_bert("random-bert-tiny", tmp_path) == directory  # reused
    tok = AutoTokenizer.from_pretrained(directory)
    text = make_texts(1)[0]
    ids = tok(text).input_ids
    assert len(ids) == len(text.split()) + 3  # [CLS], one per word, ".", [SEP]
    assert tok.unk_token_id not in ids

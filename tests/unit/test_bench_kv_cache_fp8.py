"""The FP8 KV-cache benchmarks on the CPU: bench/gpu_engine.py's byte accounting with
``--kv-cache-dtype fp8`` (K/V at one byte per value), its command line,
bench/attention_decode.py's ``--kv-cache-dtypes`` check, and bench/kv_cache_quality.py
end to end on the tiny random Llama."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import attention_decode  # noqa: E402
import gpu_bench_models as models  # noqa: E402
import gpu_engine  # noqa: E402
import kv_cache_quality  # noqa: E402


def test_fp8_kv_bytes_per_token_halve():
    config = models.hf_config("llama-3.1-8b")
    bf16, fp8 = models.model_facts(config), models.model_facts(config, kv_cache_dtype="fp8")
    assert bf16["kv_bytes_per_token"] == 32 * 2 * 8 * 128 * 2  # layers x K/V x heads x dims
    assert fp8["kv_bytes_per_token"] * 2 == bf16["kv_bytes_per_token"]
    assert fp8["decode_weight_bytes"] == bf16["decode_weight_bytes"]  # weights untouched
    assert (bf16["kv_cache_dtype"], fp8["kv_cache_dtype"]) == ("auto", "fp8")


def test_command_lines_take_the_kv_cache_dtypes(capsys):
    with pytest.raises(SystemExit):
        gpu_engine.main(["--kv-cache-dtype", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        attention_decode.main(["--kv-cache-dtypes", "auto,int4", "--out", "x.json"])
    assert "--kv-cache-dtypes takes auto and/or fp8, got 'auto,int4'" in capsys.readouterr().err


def test_kv_cache_quality_end_to_end(tmp_path):
    from lmkit.testing.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny")
    out, text = tmp_path / "q.json", tmp_path / "held.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 4)
    assert kv_cache_quality.main(["--model", str(model), "--prompts", "2", "--tokens", "4",
                                  "--attention", "torch", "--text", str(text),
                                  "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["greedy"]["num_sequences"] == 2
    assert report["perplexity"]["scored_tokens"] > 150
    assert report["perplexity"]["fp8"] > 0 and report["kv_cache_scales"] == "auto"
    with pytest.raises(SystemExit):
        kv_cache_quality.main(["--prompts", "0"])

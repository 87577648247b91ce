"""bench/gpu_engine.py's ``--ab-env``: lmkit run once more with environment variables
set (an A/B of a kernel switch such as ``LMKIT_GEMV_FOLD=0``), parsed and reported."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import gpu_engine  # noqa: E402
from gpu_report import format_table  # noqa: E402


def test_parse_env():
    assert gpu_engine.parse_env("") == {}
    assert gpu_engine.parse_env("LMKIT_GEMV_FOLD=0, X = a=b") == {"LMKIT_GEMV_FOLD": "0",
                                                                   "X": "a=b"}
    with pytest.raises(SystemExit, match="expected NAME=VALUE"):
        gpu_engine.parse_env("LMKIT_GEMV_FOLD")


def test_report_names_the_switch():
    report = {"workloads": [], "rows": [], "lmkit_ab": {"llama-3.1-8b": {
        "env": {"LMKIT_GEMV_FOLD": "0"},
        "results": [{"workload": "W2", "output_tokens_per_s": 170.4, "tpot_ms": 5.87}]}}}
    assert "W2 with LMKIT_GEMV_FOLD=0: 170 tok/s, 5.87 ms/token" in format_table(report)
    report["lmkit_ab"]["llama-3.1-8b"] = {"env": {"LMKIT_GEMV_FOLD": "0"},
                                          "error": "exit status 1"}
    assert "lmkit with LMKIT_GEMV_FOLD=0: ERROR exit status 1" in format_table(report)


def test_parse_sets_reads_json_values():
    sets = gpu_engine.parse_sets('attention.options={"decode_tiles": [64, 8, 3]}; '
                                 'max_num_seqs=128;cache.prefix_caching=false;x=abc')
    assert sets == {"attention.options": {"decode_tiles": [64, 8, 3]}, "max_num_seqs": 128,
                    "cache.prefix_caching": False, "x": "abc"}
    assert gpu_engine.parse_sets("") == {}
    with pytest.raises(SystemExit, match="expected PATH=VALUE"):
        gpu_engine.parse_sets("max_num_seqs")


def test_report_names_the_changed_options():
    report = {"workloads": [], "rows": [], "lmkit_ab": {"qwen3-0.6b": {
        "env": {}, "set": {"attention.options": {"decode_tiles": [64, 8, 3]}},
        "results": [{"workload": "W1", "output_tokens_per_s": 24000.4}]}}}
    assert ('W1 with attention.options={"decode_tiles": [64, 8, 3]}: 24000 tok/s'
            in format_table(report))

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

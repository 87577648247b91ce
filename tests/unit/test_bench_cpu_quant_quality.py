"""bench/cpu_quant_quality.py refuses bad arguments before loading anything, and its
long held text is there to be scored."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "cpu_quant_quality.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True,
                          text=True, timeout=120)


def test_a_missing_text_file_is_refused(tmp_path):
    run = _run("--text", str(tmp_path / "absent.txt"))
    assert run.returncode == 2 and "absent.txt" in run.stderr and "No such file" in run.stderr


def test_an_empty_text_file_is_refused(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    run = _run("--text", str(empty))
    assert run.returncode == 2 and "is empty" in run.stderr


def test_zero_prompts_are_refused():
    run = _run("--prompts", "0")
    assert run.returncode == 2 and "--prompts must be at least 1" in run.stderr


def test_the_long_held_text_ships_with_the_bench():
    text = (BENCH.parent / "data" / "held_text_long.txt").read_text(encoding="utf-8")
    assert len(text.split()) > 800

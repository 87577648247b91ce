"""bench/step_phases.py on the CPU: a tiny target with and without a random EAGLE-3 head;
steps told apart by kind, the runner's phases timed per step (the head's catch-up and
draft passes only on the speculative side), and every wrapped attribute restored."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import step_phases  # noqa: E402


def test_step_kinds():
    assert step_phases.step_kind([], False) == "empty"
    assert step_phases.step_kind([1, 1], False) == "decode"
    assert step_phases.step_kind([1, 12], False) == "prefill"
    assert step_phases.step_kind([4, 1], True) == "verify"


@pytest.mark.slow  # two engines on the CPU (~10 s)
def test_phases_per_step_kind_with_and_without_a_head(tmp_path):
    from lmkit.testing.eagle_head import make_tiny_eagle3_head
    from lmkit.testing.tiny_model import make_tiny_model
    from lmkit.worker import model_runner

    target = make_tiny_model(tmp_path / "t")
    head = make_tiny_eagle3_head(tmp_path / "h", target)
    before = (model_runner.ModelRunner.execute_model, model_runner.sample_step,
              "cpu" in vars(torch.Tensor))
    out = tmp_path / "phases.json"
    assert step_phases.main(["--model", str(target), "--speculative-model", str(head),
                             "--device", "cpu", "--dtype", "float32", "--requests", "3",
                             "--output-len", "8", "--ignore-eos", "--max-model-len", "0",
                             "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    plain, spec = report["plain"], report["eagle3"]
    assert plain["prefill"]["steps"] == 3 and plain["decode"]["steps"] == 3 * 7
    assert "propose" not in plain["prefill"]["ms"]
    assert spec["prefill"]["steps"] == 3 and spec["verify"]["steps"] > 0
    for entry in (spec["prefill"], spec["verify"]):  # the head drafted after each step
        ms = entry["ms"]
        assert ms["propose"] > 0 and ms["catch_up"] > 0 and ms["execute"] >= ms["propose"]
    assert (model_runner.ModelRunner.execute_model, model_runner.sample_step,
            "cpu" in vars(torch.Tensor)) == before

"""bench/engine_ab.py on the CPU: two engines of a tiny model, B built with a switch,
both with a shared setting, timed in alternating rounds; the report's rounds, ratio and output check, and the
refusals of an A/B with nothing to compare or a bad count."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import engine_ab  # noqa: E402


@pytest.mark.slow  # two engines on the CPU (~10 s)
def test_an_ab_run_reports_both_sides_in_alternating_rounds(tmp_path, monkeypatch):
    from lmkit.testing.tiny_model import make_tiny_model

    tiny = make_tiny_model(tmp_path / "t")
    seen = []
    real = engine_ab.timed_round

    def spy(llm, prompts, params, batch):
        seen.append(llm)
        return real(llm, prompts, params, batch)

    monkeypatch.setattr(engine_ab, "timed_round", spy)
    out = tmp_path / "ab.json"
    report = engine_ab.main(["--model", str(tiny), "--device", "cpu", "--dtype", "float32",
                             "--b-env", "LMKIT_GLU_EPILOGUE=0", "--b-set",
                             "executor.flat_step_max_tokens=0", "--set",
                             "scheduler.max_num_batched_tokens=96", "--requests", "3",
                             "--output-len", "6", "--rounds", "3", "--batch", "2",
                             "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["b_env"] == {"LMKIT_GLU_EPILOGUE": "0"}
    assert report["b_set"] == {"executor.flat_step_max_tokens": 0}
    assert [len(report["tok_per_s"][s]) for s in "AB"] == [3, 3]
    assert report["identical"] is True  # the switch changes no token
    assert report["b_over_a"] == pytest.approx(report["median"]["B"] / report["median"]["A"])
    a, b = seen[0], seen[1]  # the warm-ups, then rounds A B, B A, A B
    assert a is not b and seen[2:] == [a, b, b, a, a, b]
    # --set reaches both engines, --b-set only B
    assert report["set"] == {"scheduler.max_num_batched_tokens": 96}
    assert a.config.scheduler.max_num_batched_tokens == b.config.scheduler.max_num_batched_tokens == 96
    assert b.config.executor.flat_step_max_tokens == 0 != a.config.executor.flat_step_max_tokens


def test_nothing_to_compare_and_bad_counts_are_refused(capsys):
    with pytest.raises(SystemExit):
        engine_ab.main(["--model", "m"])
    assert "give B something A lacks" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        engine_ab.main(["--model", "m", "--b-env", "X=1", "--rounds", "0"])
    assert "--rounds must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--b-env: expected NAME=VALUE"):
        engine_ab.main(["--model", "m", "--b-env", "X"])

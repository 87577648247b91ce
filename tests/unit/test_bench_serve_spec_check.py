"""bench/serve_spec_check.py: ``lmkit serve`` with an EAGLE-3 head over HTTP through the
OpenAI client, and the ``/metrics`` check. The metrics parsing and every failure the check
reports on made-up input; end to end on the CPU with a tiny model and a random head."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import serve_spec_check  # noqa: E402

EXPOSITION = """\
# HELP lmkit_spec_decode_num_draft_tokens_total drafted tokens
lmkit_spec_decode_num_draft_tokens_total{engine="0"} 30.0
lmkit_spec_decode_num_accepted_tokens_total{engine="0"} 12.0
lmkit_spec_decode_mean_accepted_length{engine="0"} 1.8
lmkit_spec_decode_acceptance_rate_per_position{engine="0",position="0"} 0.6
lmkit_spec_decode_acceptance_rate_per_position{engine="0",position="1"} 0.25
lmkit_engine_stat{stat="num_steps"} 7.0
"""
GOOD = [{"whole": "Paris.", "streamed": "Paris."}]


def test_metrics_are_read_and_a_good_run_passes():
    metrics = serve_spec_check.spec_metrics(EXPOSITION)
    assert metrics == {"lmkit_spec_decode_num_draft_tokens_total": 30.0,
                       "lmkit_spec_decode_num_accepted_tokens_total": 12.0,
                       "lmkit_spec_decode_mean_accepted_length": 1.8,
                       "lmkit_spec_decode_acceptance_rate_per_position": {0: 0.6, 1: 0.25}}
    assert serve_spec_check.failures(GOOD, metrics, k=2) == []


def test_each_failure_is_named():
    metrics = serve_spec_check.spec_metrics(EXPOSITION)
    # a third draft position without its rate
    assert serve_spec_check.failures(GOOD, metrics, k=3) == [
        '/metrics lacks lmkit_spec_decode_acceptance_rate_per_position{position="2"}']
    bad = serve_spec_check.failures(
        [{"whole": "", "streamed": ""}, {"whole": "a", "streamed": "b"}],
        {"lmkit_spec_decode_num_draft_tokens_total": 0.0}, k=1)
    assert bad == [
        "prompt 0: empty answer", "prompt 1: the streamed answer differs from the whole one",
        "/metrics lacks lmkit_spec_decode_num_accepted_tokens_total",
        "/metrics lacks lmkit_spec_decode_mean_accepted_length",
        "no draft token was proposed",
        '/metrics lacks lmkit_spec_decode_acceptance_rate_per_position{position="0"}',
        "the mean accepted length is below 1"]


def test_bad_counts_are_refused(capsys):
    with pytest.raises(SystemExit):
        serve_spec_check.main(["--model", "m", "--prompts", "0"])
    assert "must be at least 1" in capsys.readouterr().err


@pytest.mark.slow  # a server on the CPU (~15 s)
def test_a_tiny_pair_serves_drafts_over_http(tmp_path):
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from lmkit.testing.eagle_head import make_tiny_eagle3_head
    from lmkit.testing.tiny_model import make_tiny_model

    tiny = make_tiny_model(tmp_path / "tiny")
    head = make_tiny_eagle3_head(tmp_path / "head", tiny)
    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "check.json"
    status = serve_spec_check.main([
        "--model", str(tiny), "--speculative-model", str(head), "--device", "cpu",
        "--dtype", "float32", "--attention", "torch", "--api", "completions",
        "--prompts", "2", "--max-tokens", "10", "--port", str(port), "--timeout", "300",
        "--out", str(out)])
    report = json.loads(out.read_text())
    assert status == 0, report["failures"]
    assert "--speculative" in report["command"] and len(report["answers"]) == 2
    assert report["metrics"]["lmkit_spec_decode_num_draft_tokens_total"] > 0
    assert sorted(report["metrics"][serve_spec_check.PER_POSITION]) == ["0", "1", "2"]  # (JSON)

"""bench/serve_peers.py's report: each side's runs by mode (a client-process sweep names
its runs ``... xN``), the lmkit / vLLM ratio, the busiest client's CPU."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import pytest  # noqa: E402
import serve_peers  # noqa: E402


def run(mode, tok_s, cpu):
    ms = {"mean": 1.0, "p50": 2.0, "p99": 3.0}
    return {"mode": mode, "requests_per_s": 10.0, "output_tokens_per_s": tok_s, "failed": 0,
            "ttft_ms": ms, "tpot_ms": ms, "itl_ms": ms, "client_cpu": cpu}


def test_table_pairs_the_sides_per_mode_with_the_clients_cpu():
    sides = {
        "lmkit": {"report": {"runs": [run("rate=inf/s x1", 2000.0, 0.44),
                                      run("rate=inf/s x4", 2200.0, 0.15)]}},
        "vllm": {"report": {"runs": [run("rate=inf/s x1", 1000.0, 0.85),
                                     run("rate=inf/s x4", 1100.0, 0.34)]}},
    }
    lines = serve_peers.format_table(sides).splitlines()
    assert "client CPU" in lines[0]
    x4 = [line for line in lines if "x4" in line]
    assert len(x4) == 3  # lmkit, vllm, ratio
    assert x4[0].split()[-1] == "15%" and x4[1].split()[-1] == "34%"
    assert x4[2].split()[-1] == "2.000"
    errors = serve_peers.format_table({"lmkit": {"error": "boom"}})
    assert "lmkit: ERROR boom" in errors


def test_a_client_process_sweep_is_parsed_and_checked(monkeypatch):
    seen = {}

    def fake_run_side(side, model_dir, workload, rates, port, args, log_dir):
        seen["procs"] = args.client_procs
        return {"side": side, "report": {"runs": []}}

    monkeypatch.setattr(serve_peers, "run_side", fake_run_side)
    monkeypatch.setattr(serve_peers.models, "write_model", lambda name, d: d)
    assert serve_peers.main(["--sides", "lmkit", "--smoke", "--client-procs", "1,4"]) == 0
    assert seen["procs"] == [1, 4]
    with pytest.raises(SystemExit):
        serve_peers.main(["--sides", "lmkit", "--smoke", "--client-procs", "0"])

"""LMKIT_STEP_TRACE: one JSON line per engine step, and the summary by step kind."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from lmkit import LLM, SamplingParams
from lmkit.testing.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def _bench_module():
    spec = importlib.util.spec_from_file_location("step_trace_bench", ROOT / "bench/step_trace.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-trace"))


def test_trace_records_each_step(tiny, tmp_path, monkeypatch):
    trace = tmp_path / "steps.jsonl"
    monkeypatch.setenv("LMKIT_STEP_TRACE", str(trace))
    llm = LLM(str(tiny), device="cpu", dtype="float32", max_model_len=128, num_blocks=64,
              block_size=4)
    prompts = [{"prompt_token_ids": list(range(5, 12))}, {"prompt_token_ids": [7, 8, 9]}]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params)
    llm.shutdown()
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert records[0]["tokens"] == 10 and records[0]["prefill_tokens"] == 10
    assert records[0]["decode_reqs"] == 0 and records[0]["gap_ms"] is None
    decodes = [r for r in records if r["tokens"] and r["prefill_tokens"] == 0]
    assert len(decodes) == 3  # tokens 2..4 of each request, both at once
    assert all(r["reqs"] == 2 and r["decode_reqs"] == 2 for r in decodes)
    assert all(r["execute_ms"] > 0 and r["gap_ms"] >= 0 for r in records[1:])
    times = [r["t"] for r in records]
    assert times == sorted(times)

    summary = _bench_module().summarize(records)
    assert summary["kinds"]["prefill"]["steps"] == 1
    assert summary["kinds"]["decode"]["steps"] == 3
    assert 0 <= summary["busy_gap_share"] <= summary["gap_share"] < 1
    assert records[-1]["finished"] == 2 and sum(r["finished"] for r in records) == 2


def test_no_trace_without_the_variable(tiny, tmp_path, monkeypatch):
    monkeypatch.delenv("LMKIT_STEP_TRACE", raising=False)
    monkeypatch.chdir(tmp_path)
    llm = LLM(str(tiny), device="cpu", dtype="float32", max_model_len=128, num_blocks=64,
              block_size=4)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2))
    llm.shutdown()
    assert list(tmp_path.iterdir()) == []


def test_step_kinds():
    kind = _bench_module().step_kind
    assert kind({"tokens": 0, "prefill_tokens": 0, "decode_reqs": 0}) == "empty"
    assert kind({"tokens": 4, "prefill_tokens": 0, "decode_reqs": 4}) == "decode"
    assert kind({"tokens": 9, "prefill_tokens": 6, "decode_reqs": 3}) == "mixed"
    assert kind({"tokens": 6, "prefill_tokens": 6, "decode_reqs": 0}) == "prefill"
    # two requests verifying three drafts each, one decoding
    assert kind({"tokens": 9, "prefill_tokens": 8, "decode_reqs": 1,
                 "verify_tokens": 8}) == "verify"
    # a prompt chunk beside a verification
    assert kind({"tokens": 20, "prefill_tokens": 20, "decode_reqs": 0,
                 "verify_tokens": 4}) == "prefill"


def test_pid_in_the_path(tmp_path, monkeypatch):
    import os

    from lmkit.engine.step_trace import StepTracePhase

    monkeypatch.setenv("LMKIT_STEP_TRACE", str(tmp_path / "trace-{pid}.jsonl"))
    phase = StepTracePhase.from_env()
    second = StepTracePhase.from_env()  # another engine of this process: its own file
    phase.shutdown()
    second.shutdown()
    assert (tmp_path / f"trace-{os.getpid()}.jsonl").is_file()
    assert (tmp_path / f"trace-{os.getpid()}.jsonl.2").is_file()


def test_verification_steps_are_their_own_kind(tiny, tmp_path, monkeypatch):
    """With speculation, steps verifying drafts record their tokens (``verify_tokens``)
    and the summary counts them as ``verify``, apart from prompt steps."""
    trace = tmp_path / "steps.jsonl"
    monkeypatch.setenv("LMKIT_STEP_TRACE", str(trace))
    llm = LLM(str(tiny), device="cpu", dtype="float32", max_model_len=128, num_blocks=64,
              block_size=4, speculative="ngram", num_speculative_tokens=2)
    prompts = ["abcabcabcabc", "0123401234", "the cat sat on the mat; the cat"]
    llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    drafted = llm.stats()["spec_num_draft_tokens"]
    llm.shutdown()
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    verify = [r for r in records if r["verify_tokens"]]
    assert drafted > 0 and verify
    assert sum(r["tokens"] - r["reqs"] for r in verify) == drafted  # one token each + drafts
    summary = _bench_module().summarize(records)
    assert summary["kinds"]["verify"]["steps"] == len(verify)
    assert summary["kinds"]["prefill"]["steps"] == 1


def test_an_engine_never_shut_down_leaves_its_steps(tiny, tmp_path):
    """A program that exits without shutting its engine down still finds every step in
    the trace (the buffered file is closed at exit)."""
    import os
    import subprocess
    import sys

    trace = tmp_path / "steps.jsonl"
    code = ("from lmkit import LLM, SamplingParams\n"
            f"llm = LLM({str(tiny)!r}, device='cpu', dtype='float32', max_model_len=128, "
            "num_blocks=64, block_size=4)\n"
            "llm.generate([{'prompt_token_ids': [5, 6, 7]}], "
            "SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))\n")
    env = {**os.environ, "LMKIT_STEP_TRACE": str(trace)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(records) == 5 and records[-1]["finished"] == 1

"""bench/spec_decode.py's paired run on the CPU's tiny model: prompt lookup beside plain
decoding in one process, the greedy outputs identical, and the report's fields (pairs,
accepted length, the engines' build times)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import spec_decode  # noqa: E402


def test_paired_side_reports_both_engines(tmp_path):
    from lmkit.benchmarking.workload import Workload
    from lmkit.testing.tiny_model import make_tiny_model

    tiny = make_tiny_model(tmp_path / "tiny")
    opts = dict(device="cpu", dtype="float32", max_model_len=128, num_blocks=64, block_size=4)
    repeat = [40, 41, 42, 43, 44, 45] * 4  # prompt lookup finds these
    workload = Workload("copy", [repeat, repeat[:10]], [12, 8])
    row = spec_decode.paired_side(str(tiny), opts,
                                  {**opts, "speculative": "ngram", "num_speculative_tokens": 3},
                                  workload, threads=1, repeats=2)
    assert row["outputs_identical"] and row["output_tokens"] == 20
    assert len(row["pair_speedups"]) == 2 and row["mean_accepted_length"] >= 1.0
    assert set(row["engine_build_s"]) == {"plain", "spec"}
    assert all(s > 0 for s in row["engine_build_s"].values())
    assert "engine build s" in spec_decode.format_row(
        {**row, "workload": "copy", "batch": 1, "proposer": "ngram",
         "base_tokens_per_s": 1.0, "spec_tokens_per_s": 1.0, "speedup": 1.0})


def test_divergences_name_the_first_difference_and_the_plain_margin(tmp_path):
    """Outputs that differ are reported at their first differing token with the plain
    engine's own top-2 margin there and whether the other side took its runner-up; a
    request whose output is a prefix of the other's has no margin."""
    from lmkit import LLM, SamplingParams
    from lmkit.testing.tiny_model import make_tiny_model

    tiny = make_tiny_model(tmp_path / "tiny")
    prompts = [[40, 41, 42, 43], [7, 8, 9], [5, 6]]
    with LLM(str(tiny), device="cpu", dtype="float32", max_model_len=64,
             num_blocks=64) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                           logprobs=2))
        base = [list(o.outputs[0].token_ids) for o in outs]
        top = outs[0].outputs[0].logprobs[3].top  # request 0, token 3: its top two
        runner_up, margin = top[1][0], top[0][1] - top[1][1]
        spec = [base[0][:3] + [runner_up, 1, 1], base[1], base[2][:4]]
        found = spec_decode.divergences(llm, prompts, base, spec)
    assert [(d["request"], d["at"]) for d in found] == [(0, 3), (2, 4)]
    assert found[0]["spec_took_runner_up"] and abs(found[0]["margin"] - margin) < 1e-6
    assert found[1]["margin"] is None
    note = spec_decode._divergence_note(found)
    assert "2 differ" in note and f"{margin:.3f}" in note and "runner-up taken in 1 of 1" in note
    assert spec_decode._divergence_note([]) == ""


def test_quantization_reaches_both_engines(monkeypatch):
    """``--quantization gguf`` is set on the plain and the speculative engine alike;
    ``none`` (the default) sets nothing, so each engine keeps its configured method."""
    import argparse

    from lmkit.benchmarking.workload import Workload

    seen = []

    def fake_run(side, model_dir, base_opts, spec_opts, wl, threads, repeats, stop_at_eos):
        seen.append((base_opts, spec_opts))
        return {"output_tokens": 4, "plain_s": 1.0, "spec_s": 1.0, "pair_speedups": [1.0],
                "mean_accepted_length": 1.0, "acceptance_rate": 0.0,
                "outputs_identical": True, "graph_verify_steps": 0, "engine_steps": 4}

    monkeypatch.setattr(spec_decode, "run_isolated", fake_run)
    monkeypatch.setattr(spec_decode, "make", lambda *a: Workload("chat", [[1, 2]], [4]))
    for quantization in ("gguf", "none"):
        args = argparse.Namespace(
            batch1_prompts=1, waves=1, chat_output_len=4, seed=0, prompt_texts=None,
            device="cpu", dtype="float32", attention="auto", quantization=quantization,
            max_model_len=None, proposer="ngram", spec_tokens=3, disable_by_batch_size=None,
            adaptive=False, no_catch_up=False, prompt_lookup_max=4, prompt_lookup_min=3,
            speculative_model=None, spec_tree=None, threads=1, repeats=1, stop_at_eos=False)
        spec_decode.run_row(args, "model", "chat", 1, None)
    (gguf_base, gguf_spec), (none_base, none_spec) = seen
    assert gguf_base["quantization"] == gguf_spec["quantization"] == "gguf"
    assert "quantization" not in none_base and "quantization" not in none_spec

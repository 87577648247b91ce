"""bench/spec_vllm.py's parts that run without vLLM: the job (workload token ids, EOS ids
and the model directory vLLM reads), vLLM's speculative counters read off its metrics,
and the report of a plain and an eagle3 side."""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import spec_vllm  # noqa: E402


def test_job_holds_the_chat_rows_and_a_directory_without_the_gguf(tmp_path):
    from lmkit.testing.tiny_model import make_tiny_model

    tiny = make_tiny_model(tmp_path / "tiny")
    (tiny / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    (tiny / "model.gguf").write_bytes(b"GGUF")  # lmkit keeps the GGUF beside its conversion
    head = tmp_path / "head"
    head.mkdir()
    args = Namespace(model=str(tiny), speculative_model=str(head), k=3, batches=[1, 4],
                     batch1_prompts=2, output_len=16, repeats=2, seed=0, gpu_memory=0.5)
    job = spec_vllm.make_job(args, tmp_path / "out")
    assert [len(r["prompts"]) for r in job["rows"]] == [2, 4]
    assert all(n == 16 for r in job["rows"] for n in r["output_lens"])
    assert job["eos"] and job["max_num_seqs"] == 4 and job["k"] == 3
    model_dir = Path(job["model_dir"])
    assert (model_dir / "config.json").is_file() and not (model_dir / "model.gguf").exists()
    assert any(p.suffix == ".safetensors" for p in model_dir.iterdir())


def _metrics(drafts, accepted, per_pos):
    return [SimpleNamespace(name="vllm:spec_decode_num_drafts", value=drafts),
            SimpleNamespace(name="vllm:spec_decode_num_draft_tokens", value=3 * drafts),
            SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=accepted),
            SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=per_pos),
            SimpleNamespace(name="vllm:num_requests_running", value=1)]


def test_counters_and_their_delta():
    llm = SimpleNamespace(get_metrics=lambda: _metrics(10, 12, [6, 4, 2]))
    before = spec_vllm._spec_counters(llm)
    assert before == {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 12,
                      "num_accepted_tokens_per_pos": [6, 4, 2]}
    after = spec_vllm._spec_counters(SimpleNamespace(get_metrics=lambda: _metrics(30, 42,
                                                                                   [21, 14, 7])))
    d = spec_vllm._delta(before, after)
    assert d["num_drafts"] == 20 and d["mean_accepted_length"] == 1 + 30 / 20
    assert d["acceptance_per_position"] == [15 / 20, 10 / 20, 5 / 20]
    assert spec_vllm._delta({}, {}) == {}


def test_report_pairs_the_sides(capsys):
    plain = {"rows": [{"batch": 1, "median_s": 2.0, "output_tokens": 100, "tokens": [[1, 2]]}]}
    spec = {"rows": [{"batch": 1, "median_s": 1.0, "output_tokens": 100, "tokens": [[1, 2]],
                      "spec": {"mean_accepted_length": 2.5,
                               "acceptance_per_position": [0.8, 0.5, 0.2]}}]}
    (row,) = spec_vllm.report({"plain": plain, "eagle3": spec})
    assert row["speedup"] == 2.0 and row["outputs_identical"]
    assert row["plain_tok_s"] == 50.0 and row["eagle3_tok_s"] == 100.0
    assert "speedup 2.00x" in capsys.readouterr().out
    spec["rows"][0]["tokens"] = [[1, 3]]
    assert not spec_vllm.report({"plain": plain, "eagle3": spec})[0]["outputs_identical"]
    assert spec_vllm.report({"plain": plain}) == []

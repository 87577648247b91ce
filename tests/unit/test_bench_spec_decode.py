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

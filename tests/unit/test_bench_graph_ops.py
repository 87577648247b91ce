"""bench/graph_ops.py and bench/gemm_blas.py on the CPU: the op log of a graph capture
(ops counted by name and lmkit call site, views and allocations left out, only the
sizes asked for, only while capturing) and the per-layer sums of the BLAS timings."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gemm_blas  # noqa: E402
import graph_ops  # noqa: E402


def test_capture_log_counts_kernel_ops_by_lmkit_call_site(monkeypatch):
    from lmkit.worker import cuda_graphs
    from lmkit.worker.replay_buffers import ReplayBuffers

    def body(self, bs):  # a stand-in forward: lmkit code issuing copies, views, fills
        buf = ReplayBuffers(4, 2, 1, torch.device("cpu"), 1, False)
        z = torch.zeros(bs, dtype=torch.int64)
        buf.load(bs, z, z, z, z.to(torch.int32), torch.zeros(bs, 2, dtype=torch.int32),
                 torch.zeros(1, 3, bs, dtype=torch.int64))
        return buf.packed.view(3, -1)[0]

    monkeypatch.setattr(cuda_graphs.CudaGraphRunner, "_run_model", body)
    capturing = {"on": True}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["on"])
    log = graph_ops.install({2})

    class Runner:
        chain = 1
        model = type("HeadPass", (), {})()

    run = cuda_graphs.CudaGraphRunner._run_model
    run(Runner(), 2)
    run(Runner(), 4)  # a size not asked for
    capturing["on"] = False
    run(Runner(), 2)  # not capturing
    assert list(log) == ["HeadPass (chain 1) bs=2"]
    sites = log["HeadPass (chain 1) bs=2"]["sites"]
    copies = [s for s in sites if s["op"] == "copy_"]
    # load(): ids, positions, slots, seq_lens, block tables and the chained rows
    assert sum(s["calls"] for s in copies) == 6
    assert all(s["site"].startswith("worker/replay_buffers.py:") for s in copies)
    assert not any(s["op"] in ("view", "slice", "select") for s in sites)
    assert log["HeadPass (chain 1) bs=2"]["ops"] == sum(s["calls"] for s in sites)


def test_gemm_layer_sums_add_a_layers_four_projections():
    rows = [{"shape": f"llama8b.{p}", "m": 256, "cublas": {"ms": ms}, "cublaslt": {"ms": lt}}
            for p, ms, lt in (("qkv", 1.0, 2.0), ("o", 1.0, 1.0), ("gate_up", 2.0, 1.0),
                              ("down", 1.0, 1.0), ("lm_head", 9.0, 9.0))]
    rows.append({"shape": "qwen0.6b.qkv", "m": 256, "cublas": {"ms": 1.0},
                 "cublaslt": {"ms": 1.0}})  # an incomplete layer: no sum
    (entry,) = gemm_blas.layer_sums(rows)
    assert entry == {"model": "llama8b", "m": 256, "cublas_ms": 5.0, "cublaslt_ms": 5.0,
                     "lt_speedup": 1.0}

"""bench/gpu_run_profile.py: where a whole run's GPU time goes, from kernel records."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gpu_bench_models as models  # noqa: E402
import gpu_run_profile as rp  # noqa: E402


def kernel(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_kernel_kinds_by_name():
    assert rp.kind_of("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN") == "gemm"
    assert rp.kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n") == "gemm"
    assert rp.kind_of("_gemv_bf16_kernel") == "gemm"
    assert rp.kind_of("_paged_decode_attention_kernel") == "attention"
    assert rp.kind_of("flash_fwd_splitkv_kernel") == "attention"  # attention before gemm
    assert rp.kind_of("_fused_rms_norm_kernel") == "other"


def test_busy_time_is_the_union_of_gpu_intervals():
    events = [kernel("gemm_a", 0, 10), kernel("attn_b", 5, 10),  # overlap: busy 0-15
              kernel("norm", 20, 5), kernel("copy", 24, 4, cat="gpu_memcpy"),  # 20-28
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100},
              kernel("gemm_a", 40, 10)]
    out = rp.summarize_trace(events, wall_s=100e-6, gemm_flops=2e6)
    assert out["gpu_busy_s"] == pytest.approx(33e-6)
    assert out["gpu_idle_frac"] == pytest.approx(0.67)
    assert out["kernel_s"] == pytest.approx({"gemm": 20e-6, "attention": 10e-6,
                                             "other": 5e-6})
    assert out["kernels"] == 4  # copies count as busy time, not as kernels
    assert out["gemm_tflops"] == pytest.approx(2e6 / 20e-6 / 1e12)
    assert out["top_kernels"][0] == {"name": "gemm_a", "s": pytest.approx(20e-6), "calls": 2}
    assert "gemm_tflops" not in rp.summarize_trace(events, 1.0, gemm_flops=None)


def test_idle_gaps_by_length():
    """The gaps between busy intervals (not the overlaps) land in their buckets."""
    events = [kernel("a", 0, 10), kernel("b", 5, 10),  # overlap: no gap
              kernel("c", 20, 5),  # 5 us after 15
              kernel("d", 75, 5),  # 50 us
              kernel("e", 580, 20),  # 500 us
              kernel("f", 2600, 1)]  # 2 ms
    gaps = rp.summarize_trace(events, wall_s=3e-3)["idle_gaps"]
    assert {k: v["count"] for k, v in gaps["buckets"].items()} == {
        "<10us": 1, "10-100us": 1, "0.1-1ms": 1, ">=1ms": 1}
    assert gaps["buckets"]["0.1-1ms"]["s"] == pytest.approx(500e-6)
    assert gaps["longest_ms"] == pytest.approx([2.0, 0.5, 0.05, 0.005])
    profile = {"wall_s": 3e-3, "gpu_busy_s": 1e-3, "gpu_idle_frac": 0.6, "kernels": 6,
               "kernel_s": {"gemm": 0.0, "attention": 0.0, "other": 1e-3}, "idle_gaps": gaps}
    report = {"lmkit": {"unprofiled": {"results": []},
                        "m": {"run_profiles": {"W1": profile, "W3": profile}}}}
    text = rp.format_profiles(report)
    assert text.count("idle gaps: <10us 1x 0ms") == 2  # under each workload's line
    assert rp.format_profiles({"lmkit": {"unprofiled": {"results": []}}}) == ""


def test_gemm_flops_of_a_dense_run():
    facts = models.model_facts(models.hf_config("tiny-llama"))
    # 2 layers x (q, k, v, o, gate, up, down) of hidden 64, kv 2 x 16, intermediate 128
    per_layer = 64 * 64 + 2 * (64 * 32) + 64 * 64 + 3 * (64 * 128)
    assert facts["linear_params"] == 2 * per_layer
    assert facts["lm_head_params"] == 1024 * 64
    result = {"prompt_tokens": 100, "output_tokens": 20}
    assert rp.gemm_flops(facts, result, num_requests=4) == 2.0 * (
        2 * per_layer * (100 + 20 - 4) + 1024 * 64 * 20)
    assert rp.gemm_flops({**facts, "moe": {}}, result, 4) is None


def test_profile_run_on_the_cpu_records_the_run():
    import torch

    def run():
        a = torch.randn(64, 64)
        for _ in range(3):
            a = a @ a
        return {"elapsed_s": 0.01, "prompt_tokens": 1, "output_tokens": 1}

    out = rp.profile_run(run, None, 1)
    assert out["result"]["elapsed_s"] == 0.01 and out["wall_s"] == 0.01
    assert out["gpu_busy_s"] >= 0 and set(out["kernel_s"]) == {"gemm", "attention", "other"}
    text = rp.format_profiles({"lmkit": {"m": {"run_profiles": {"W1": out}}}})
    assert "W1" in text and "lmkit" in text and "TFLOP/s" in text
    assert rp.format_profiles({"lmkit": {}}) == ""

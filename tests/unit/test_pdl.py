"""Programmatic dependent launch (:mod:`lmkit_kernels.pdl`): when it is on, what the
launches pass, and that every decode-step kernel compiles for sm_90 with the grid
dependency instructions exactly when it is on (no GPU needed: Triton's bundled ptxas)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from lmkit_kernels import pdl

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from offline_sm90 import bundled_tool, run_offline  # noqa: E402

KERNELS = {"small_m_linear", "gemv_fold", "paged_decode", "reduce_splits", "rotary_qk",
           "rms_norm", "silu_and_mul", "reshape_and_cache", "rotary_cos_sin",
           "chunk_argmax", "rows_argmax"}
PREFETCHING = {"small_m_linear", "gemv_fold", "paged_decode"}


def test_off_on_the_cpu_and_in_the_interpreter(monkeypatch):
    monkeypatch.delenv(pdl.ENV, raising=False)
    assert not pdl.pdl_enabled(torch.device("cpu"))
    assert pdl.pdl_launch_args(torch.device("cpu")) == {"USE_PDL": False}
    weight = torch.zeros(4, 256, dtype=torch.bfloat16)
    assert pdl.prefetch_args(weight, 512) == {"PF_LINE": 64, "PF_LINES": 0}


def test_on_for_hopper_unless_switched_off(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(pdl, "_HAS_GDC", True)
    monkeypatch.setattr(pdl, "_device_supports", lambda index: index == 0)
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert pdl.pdl_launch_args(cuda0) == {"USE_PDL": True, "launch_pdl": True}
    assert pdl.pdl_launch_args(cuda1) == {"USE_PDL": False}  # an older GPU
    assert pdl.prefetch_enabled(cuda0)
    monkeypatch.setenv(pdl.PREFETCH_ENV, "0")
    assert not pdl.prefetch_enabled(cuda0) and pdl.pdl_enabled(cuda0)
    monkeypatch.setenv(pdl.ENV, "0")
    assert pdl.pdl_launch_args(cuda0) == {"USE_PDL": False}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(pdl.ENV, "1")
    assert not pdl.pdl_enabled(cuda0)


def test_prefetch_lines_follow_the_weight_dtype(monkeypatch):
    monkeypatch.setattr(pdl, "pdl_enabled", lambda device: True)
    assert pdl.prefetch_args(torch.empty(4, 4096, dtype=torch.bfloat16), 512) == {
        "PF_LINE": 64, "PF_LINES": 8}
    assert pdl.prefetch_args(torch.empty(4, 4096, dtype=torch.float8_e4m3fn), 1024) == {
        "PF_LINE": 128, "PF_LINES": 8}
    assert pdl.prefetch_args(torch.empty(4, 32, dtype=torch.float32), 16) == {
        "PF_LINE": 32, "PF_LINES": 1}  # a slice shorter than a line: its one line
    monkeypatch.setenv(pdl.PREFETCH_ENV, "4")  # four slices
    assert pdl.prefetch_args(torch.empty(4, 4096, dtype=torch.bfloat16), 512) == {
        "PF_LINE": 64, "PF_LINES": 32}


def test_decode_prefetches_its_first_tile(monkeypatch):
    """Decode attention prefetches a K/V row's 128-byte lines for the first tile of its
    slice; none where prefetching is off."""
    from lmkit_kernels import paged_attention as pa

    cache = torch.empty(2, 16, 8, 128, dtype=torch.bfloat16)  # [blocks, slots, heads, d]
    monkeypatch.setattr(pa, "prefetch_enabled", lambda device: True)
    assert pa._kv_prefetch(cache, 128) == {"KV_LINE": 64, "KV_LINES": 2}
    monkeypatch.setattr(pa, "prefetch_enabled", lambda device: False)
    assert pa._kv_prefetch(cache, 128) == {"KV_LINE": 64, "KV_LINES": 0}


def test_a_bad_prefetch_depth_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(pdl, "pdl_enabled", lambda device: True)
    monkeypatch.setenv(pdl.PREFETCH_ENV, "3")
    with pytest.raises(ValueError, match="LMKIT_PDL_PREFETCH='3': expected 0"):
        pdl.prefetch_enabled(torch.device("cuda", 0))


@pytest.mark.parametrize("value", ["2", "maybe"])
def test_a_bad_switch_value_is_refused_by_name(monkeypatch, value):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(pdl, "_HAS_GDC", True)
    monkeypatch.setenv(pdl.ENV, value)
    with pytest.raises(ValueError, match=f"LMKIT_PDL={value!r}: expected 1"):
        pdl.pdl_enabled(torch.device("cuda", 0))


@pytest.mark.slow
@pytest.mark.skipif(bundled_tool("ptxas") is None,
                    reason="Triton's bundled ptxas is not installed")
def test_every_decode_step_kernel_waits_exactly_when_launched_with_pdl():
    results = run_offline("offline_pdl_sm90.py")
    assert {(r["kernel"], r["pdl"]) for r in results} == {
        (k, on) for k in KERNELS for on in (True, False)}
    for r in results:
        if r["pdl"]:
            assert r["wait"] >= 1 and r["launch_dependents"] >= 1 and r["launch_pdl"], r
            assert (r["prefetch"] >= 1) == (r["kernel"] in PREFETCHING), r
        else:  # off: the kernels are exactly what they were (no grid dependency at all)
            assert r["wait"] == r["launch_dependents"] == r["prefetch"] == 0, r
            assert not r["launch_pdl"], r

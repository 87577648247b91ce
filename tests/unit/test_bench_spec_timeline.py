"""bench/spec_timeline.py on the CPU: which CUDA runtime calls count as the host waiting
for the device, and how a side names its proposer and switches."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import spec_timeline  # noqa: E402


def _call(name, dur, cat="cuda_runtime"):
    return {"ph": "X", "cat": cat, "name": name, "ts": 0.0, "dur": dur}


def test_blocking_calls_counted():
    events = [_call("cudaEventSynchronize", 300.0), _call("cudaEventSynchronize", 100.0),
              _call("cudaMemcpyAsync", 20.0),  # pinned, asynchronous: not a wait
              _call("cudaMemcpyAsync", 80.0),  # long: from pageable memory, it waited
              _call("cudaLaunchKernel", 500.0),  # not a wait
              _call("cudaStreamSynchronize", 50.0, cat="kernel")]  # not a runtime call
    got = spec_timeline.blocked(events)
    assert got == {"cudaEventSynchronize": {"s": pytest.approx(400e-6), "calls": 2},
                   "cudaMemcpyAsync": {"s": pytest.approx(80e-6), "calls": 1}}


def test_sides_parse_and_refuse():
    assert spec_timeline.parse_side("plain") == ("plain", {})
    assert spec_timeline.parse_side("eagle3:LMKIT_SPEC_DEVICE_STEP=0,LMKIT_PDL=1") == (
        "eagle3", {"LMKIT_SPEC_DEVICE_STEP": "0", "LMKIT_PDL": "1"})
    with pytest.raises(SystemExit, match="NAME=VALUE"):
        spec_timeline.parse_side("eagle3:LMKIT_SPEC_DEVICE_STEP")
    with pytest.raises(SystemExit, match="name a proposer"):
        spec_timeline.parse_side(":LMKIT_PDL=0")

"""Where a whole benchmark run's GPU time goes (``bench/gpu_engine.py --profile-run``).

The workload runs once more (token ids shifted: no prefix-cache hits from the timed
run) under the torch profiler with CUDA activity only (no host-side tracing, so the
run's own host work is not slowed by it), on lmkit's side and vLLM's alike. From the
kernel records: the run's wall time, the time the GPU was busy (the union of kernel,
copy and fill intervals) and idle -- with the idle gaps between busy intervals by size,
so a few long stalls tell apart from many short ones --, the kernel time by kind (matrix products,
attention, everything else, by kernel name), and for a dense model the rate its
products reached: ``2 x (linear-layer parameters) x (tokens computed)`` plus the LM
head at every output token, over the product kernels' time. Kernel names are kept
(time and calls per name) so that the kinds can be checked and re-cut afterwards.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

GEMM = re.compile(r"gemm|gemv|nvjet|cutlass|xmma|cublas|matmul|_mm_|sm90_|splitk"
                  r"|aten::(mm|addmm|bmm|linear)$", re.I)
ATTENTION = re.compile(r"attn|attention|flash|paged|unified|fmha|mla_", re.I)
GPU_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")
#: idle gaps by length: (label, upper bound in us)
GAP_BUCKETS = (("<10us", 10.0), ("10-100us", 100.0), ("0.1-1ms", 1000.0),
               (">=1ms", float("inf")))


def kind_of(name: str) -> str:
    """``gemm``, ``attention`` or ``other`` for a kernel name (attention first: some
    attention kernels are built on GEMM templates)."""
    if ATTENTION.search(name):
        return "attention"
    if GEMM.search(name):
        return "gemm"
    return "other"


def summarize_trace(events: list[dict[str, Any]], wall_s: float,
                    gemm_flops: float | None = None, top: int = 40,
                    busy_cats: tuple[str, ...] = GPU_EVENTS, kernel_cat: str = "kernel"
                    ) -> dict[str, Any]:
    """The GPU's time over a run from chrome-trace ``events`` (``ts``/``dur`` in us):
    busy is the union of the ``busy_cats`` records, kernels the ``kernel_cat`` ones."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("ph") == "X" and e.get("cat") in busy_cats)
    busy = 0.0
    end = float("-inf")
    gaps: list[float] = []
    for a, b in spans:  # union of intervals
        if a > end:
            if end > float("-inf"):
                gaps.append(a - end)
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    by_name: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == kernel_cat:
            slot = by_name.setdefault(e.get("name", "?"), [0.0, 0])
            slot[0] += e["dur"]
            slot[1] += 1
    kinds = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    for name, (us, _) in by_name.items():
        kinds[kind_of(name)] += us
    out: dict[str, Any] = {
        "wall_s": wall_s, "gpu_busy_s": busy / 1e6,
        "gpu_idle_frac": max(0.0, 1.0 - busy / 1e6 / wall_s) if wall_s else None,
        "idle_gaps": gap_histogram(gaps),
        "kernel_s": {k: v / 1e6 for k, v in kinds.items()},
        "kernels": sum(c for _, c in by_name.values()),
        "top_kernels": [{"name": n[:160], "s": us / 1e6, "calls": c} for n, (us, c) in
                        sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]]}
    if gemm_flops is not None and kinds["gemm"] > 0:
        out["gemm_tflops"] = gemm_flops / (kinds["gemm"] / 1e6) / 1e12
    return out


def gap_histogram(gaps_us: list[float]) -> dict[str, Any]:
    """Idle gaps (us) by :data:`GAP_BUCKETS`: count and seconds per bucket, and the
    five longest gaps in ms."""
    buckets = {label: {"count": 0, "s": 0.0} for label, _ in GAP_BUCKETS}
    for gap in gaps_us:
        label = next(lb for lb, bound in GAP_BUCKETS if gap < bound)
        buckets[label]["count"] += 1
        buckets[label]["s"] += gap / 1e6
    return {"buckets": buckets, "longest_ms": [g / 1e3 for g in sorted(gaps_us)[-5:][::-1]]}


def gemm_flops(facts: dict[str, Any], result: dict[str, Any], num_requests: int
               ) -> float | None:
    """Matrix-product FLOPs of a run of a dense model: every computed token through the
    linear layers (prompt tokens, and each output token but the last), and the LM head
    at every output token. None for MoE models (routing decides the products)."""
    if "moe" in facts or "linear_params" not in facts:
        return None
    computed = result["prompt_tokens"] + result["output_tokens"] - num_requests
    return 2.0 * (facts["linear_params"] * computed
                  + facts["lm_head_params"] * result["output_tokens"])


def profile_run(run: Callable[[], dict[str, Any]], facts: dict[str, Any] | None,
                num_requests: int) -> dict[str, Any]:
    """Call ``run`` (one workload run returning the benchmark's result dict) under the
    profiler; the run's result and :func:`summarize_trace` of it. Without CUDA (smoke
    runs) the records are torch's CPU operators, nested ones counted in each."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        result = run()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    flops = gemm_flops(facts, result, num_requests) if facts else None
    cats = {} if cuda else {"busy_cats": ("cpu_op",), "kernel_cat": "cpu_op"}
    return {"result": result, **summarize_trace(events, result["elapsed_s"], flops, **cats)}


def format_profiles(report: dict[str, Any]) -> str:
    """One line per side and workload profiled with ``--profile-run`` ('' if none)."""
    lines = []
    for side in ("lmkit", "vllm"):
        for model in (report.get(side) or {}).values():
            for name, p in (model.get("run_profiles") or {}).items():
                k = p["kernel_s"]
                tf = f"{p['gemm_tflops']:.0f}" if p.get("gemm_tflops") else "-"
                lines.append(f"{name:>4} {side:>6} {p['wall_s']:8.3f} {p['gpu_busy_s']:8.3f} "
                             f"{p['gpu_idle_frac']:6.1%} {k['gemm']:7.3f} {k['attention']:7.3f} "
                             f"{k['other']:7.3f} {tf:>7} {p['kernels']:>9}")
                gaps = p.get("idle_gaps")
                if gaps:
                    cut = "  ".join(f"{lb} {v['count']}x {v['s'] * 1e3:.0f}ms"
                                    for lb, v in gaps["buckets"].items())
                    lines.append(f"{'':>11} idle gaps: {cut}; longest "
                                 + ", ".join(f"{g:.1f}" for g in gaps["longest_ms"]) + " ms")
    if not lines:
        return ""
    head = (f"{'wl':>4} {'side':>6} {'wall s':>8} {'busy s':>8} {'idle':>6} {'gemm s':>7} "
            f"{'attn s':>7} {'other s':>7} {'TFLOP/s':>7} {'kernels':>9}")
    return "\n".join(["whole runs under the profiler (gpu_run_profile.py):", head, *lines])

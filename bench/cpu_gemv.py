"""CPU decode projections against the memory bandwidth: lmkit's C row-GEMV kernel and
oneDNN in both weight layouts, on every float32 projection of a model's decode step.

A decode step reads each projection's weight once (SmolLM2-135M: 30 layers of fused
QKV, output, fused gate-up and down, and the tied LM head; 538 MB in float32), far
more than the L3 cache holds, so the step is bound by memory reads. This times one
pass over all of them, back to back as the model runs them, for ``M`` input rows, in
rounds that alternate the variants (the machines this runs on drift), and reports the
median round's time and the weight bytes read per second, beside a plain streaming
read (``sum`` over a tensor of the same size) measured in the same run. Every build of
the kernel this CPU runs is timed (AVX-512F, AVX2); to compare the AVX2 build with
oneDNN on equal terms on an AVX-512 machine, cap oneDNN with ``ONEDNN_MAX_CPU_ISA=AVX2``::

    python bench/cpu_gemv.py --rows 1,2,4,8 --threads 2 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from lmkit_kernels.cpu.row_gemv import MAX_ROWS, row_gemv_unavailable_reason, row_gemv_variants

SHAPES = {  # model: [(out, in) per projection, in step order], layer count, LM head
    "smollm2-135m": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30, (49152, 576)),
    "qwen3-0.6b": ([(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)], 28,
                   (151936, 1024)),
}


def _median_seconds(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--rows", default="1,2,4,8", help="comma-separated input row counts")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as is)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=5, help="timed passes per round")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    layer, num_layers, head = SHAPES[args.model]
    shapes = layer * num_layers + [head]
    row_major = [torch.randn(n, k) for n, k in shapes]  # [out, in] memory
    col_major = [torch.randn(k, n).t() for n, k in shapes]  # [out, in] view of [in, out]
    weight_bytes = sum(n * k * 4 for n, k in shapes)
    stream = torch.randn(weight_bytes // 4)
    onednn = torch.ops.mkldnn._linear_pointwise.default
    kernels = row_gemv_variants()
    if not kernels:
        print(f"C row-GEMV kernel not available here ({row_gemv_unavailable_reason()}); "
              "timing oneDNN only")

    results = {"model": args.model, "threads": torch.get_num_threads(),
               "weight_mb": weight_bytes / 1e6, "rows": {}}
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k) for _, k in shapes}
        variants = {
            "onednn [in,out]": lambda xs=xs: [onednn(xs[w.shape[1]], w, None, "none", [], "")
                                              for w in col_major],
            "onednn [out,in]": lambda xs=xs: [onednn(xs[w.shape[1]], w, None, "none", [], "")
                                              for w in row_major],
            "stream read": stream.sum,
        }
        for isa, kernel in kernels.items() if m <= MAX_ROWS else ():
            variants[f"row_gemv {isa}"] = lambda xs=xs, kernel=kernel: [
                kernel(xs[w.shape[1]], w, None) for w in row_major]
        rounds: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                fn()  # warm
                rounds[name].append(_median_seconds(fn, args.calls))
        row = {}
        for name, secs in rounds.items():
            s = statistics.median(secs)
            row[name] = {"ms": 1e3 * s, "gb_per_s": weight_bytes / s / 1e9}
            print(f"M={m:<3} {name:<18} {1e3 * s:7.2f} ms  {weight_bytes / s / 1e9:5.1f} GB/s"
                  f"  (rounds {min(secs) * 1e3:.1f}-{max(secs) * 1e3:.1f} ms)")
        results["rows"][m] = row
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

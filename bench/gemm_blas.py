"""Projections at decode and prefill sizes through cuBLAS and cuBLASLt, per shape.

``F.linear`` on CUDA goes through the BLAS library torch prefers
(``torch.backends.cuda.preferred_blas_library``: ``cublas`` unless
``TORCH_BLAS_PREFER_CUBLASLT=1``). The two pick their kernels by different heuristics, so
the same product can take different times. This times every Llama-3.1-8B and
Qwen3-0.6B projection (fused QKV, output, fused gate-up, down, LM head) at each ``M``
with each library, back to back in a CUDA graph over enough copies of the weight that the L2 cache does
not hold them, and reports milliseconds per call, TFLOP/s and the per-layer sums (the
four projections of one layer; the LM head apart)::

    python bench/gemm_blas.py --rows 64,128,256,2048,16384 --out gemm_blas.json

Outputs are compared between the libraries (the largest absolute difference is
reported; both are bf16 GEMMs with float32 accumulation).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

SHAPES = {  # name: (N, K)
    "llama8b.qkv": (6144, 4096), "llama8b.o": (4096, 4096), "llama8b.gate_up": (28672, 4096),
    "llama8b.down": (4096, 14336), "llama8b.lm_head": (128256, 4096),
    "qwen0.6b.qkv": (4096, 1024), "qwen0.6b.o": (1024, 2048), "qwen0.6b.gate_up": (6144, 1024),
    "qwen0.6b.down": (1024, 3072), "qwen0.6b.lm_head": (151936, 1024),
}
LIBRARIES = ("cublas", "cublaslt")
L2_BYTES = 64 * 2**20
LAYER = ("qkv", "o", "gate_up", "down")


def time_calls(x: torch.Tensor, weights: list[torch.Tensor], calls: int, rounds: int) -> float:
    """Median seconds of one ``F.linear`` over ``rounds`` replays of a CUDA graph of
    ``calls`` calls cycling through ``weights`` (a graph, so that the host's launch time
    is not what is measured)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up: the library picks and loads its kernel
        for w in weights:
            F.linear(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            F.linear(x, weights[i % len(weights)])
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    times.sort()
    return times[len(times) // 2]


def run(rows: list[int], shapes: list[str], rounds: int) -> list[dict]:
    """One result per shape and row count: seconds, TFLOP/s per library, and the largest
    difference between the libraries' outputs."""
    results = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in shapes:
        n, k = SHAPES[name]
        w_bytes = n * k * 2
        copies = max(1, -(-2 * L2_BYTES // w_bytes))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
                   for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            flops = 2.0 * m * n * k
            calls = max(3, min(50, int(2e12 / flops)))
            row: dict = {"shape": name, "m": m, "n": n, "k": k}
            outs = {}
            for lib in LIBRARIES:
                torch.backends.cuda.preferred_blas_library(lib)
                s = time_calls(x, weights, calls, rounds)
                row[lib] = {"ms": s * 1e3, "tflops": flops / s / 1e12}
                outs[lib] = F.linear(x, weights[0]).float()
            row["max_abs_diff"] = (outs["cublas"] - outs["cublaslt"]).abs().max().item()
            row["lt_speedup"] = row["cublas"]["ms"] / row["cublaslt"]["ms"]
            results.append(row)
            print(f"{name:18s} M={m:6d}  cublas {row['cublas']['ms']:8.4f} ms "
                  f"({row['cublas']['tflops']:6.1f} TF/s)  cublaslt {row['cublaslt']['ms']:8.4f} ms "
                  f"({row['cublaslt']['tflops']:6.1f} TF/s)  lt x{row['lt_speedup']:.3f}  "
                  f"diff {row['max_abs_diff']:.3g}", flush=True)
        del weights
        torch.cuda.empty_cache()
    torch.backends.cuda.preferred_blas_library("cublas")
    return results


def layer_sums(results: list[dict]) -> list[dict]:
    """Milliseconds of one layer's four projections per model, row count and library."""
    sums = []
    for model in sorted({r["shape"].split(".")[0] for r in results}):
        for m in sorted({r["m"] for r in results}):
            parts = [r for r in results if r["m"] == m and r["shape"].split(".")[0] == model
                     and r["shape"].split(".")[1] in LAYER]
            if len(parts) != len(LAYER):
                continue
            entry = {"model": model, "m": m}
            for lib in LIBRARIES:
                entry[f"{lib}_ms"] = sum(p[lib]["ms"] for p in parts)
            entry["lt_speedup"] = entry["cublas_ms"] / entry["cublaslt_ms"]
            sums.append(entry)
            print(f"layer {model:9s} M={m:6d}  cublas {entry['cublas_ms']:.4f} ms  "
                  f"cublaslt {entry['cublaslt_ms']:.4f} ms  lt x{entry['lt_speedup']:.3f}")
    return sums


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="64,128,256,2048,16384",
                    help="comma-separated row counts (tokens per step)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shape names")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", help="write the JSON report here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gemm_blas.py needs a CUDA device")
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; known: {', '.join(SHAPES)}")
    rows = [int(r) for r in args.rows.split(",")]
    results = run(rows, shapes, args.rounds)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "results": results, "layers": layer_sums(results)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

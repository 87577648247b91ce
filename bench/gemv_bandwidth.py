"""Decode projections at small batch against the memory bandwidth: cuBLAS (``F.linear``)
and lmkit's weight-streaming Triton kernel (:mod:`lmkit_kernels.gemv`), per shape.

Every Llama-3.1-8B and Qwen3-0.6B projection (fused QKV, output, fused gate-up, down,
LM head) at ``M`` rows is timed inside a CUDA graph of back-to-back calls over several
copies of the weight (more bytes than the L2 cache holds), as the engine replays a
decode step. Reports bytes read (the weight, plus x and the output) per second and the
fraction of the copy bandwidth measured in the same run. With ``--fp8`` the weights are
FP8 e4m3 with per-channel scales (:mod:`lmkit_kernels.fp8`): the Triton kernel runs with
``weight_scale`` and ``torch._scaled_mm`` (per-token FP8 activations) takes cuBLAS's
place; bytes count 1 per weight plus the scales; at one row the one-row FP8 kernel
(:mod:`lmkit_kernels.fp8_gemv`) is timed beside the tiled one over :data:`ROW_TILES`,
each launch plain and pipelined (``pipeline``: the next K slice's loads issued before
the current slice's products), with the per-layer sum of Llama-8B's four projections
per launch at the end::

    python bench/gemv_bandwidth.py --out gemv.json
    python bench/gemv_bandwidth.py --fp8 --rows 1,4,16 --out gemv_fp8.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from lmkit_kernels.gemv import small_m_linear

SHAPES = {  # name: (N, K)
    "llama8b.qkv": (6144, 4096), "llama8b.o": (4096, 4096), "llama8b.gate_up": (28672, 4096),
    "llama8b.down": (4096, 14336), "llama8b.lm_head": (128256, 4096),
    "qwen0.6b.qkv": (4096, 1024), "qwen0.6b.o": (1024, 2048), "qwen0.6b.gate_up": (6144, 1024),
    "qwen0.6b.down": (1024, 3072), "qwen0.6b.lm_head": (151936, 1024),
}
CONFIGS = [  # (block_n, block_k, num_warps, num_stages)
    (16, 512, 4, 4), (16, 1024, 4, 3), (16, 256, 4, 6), (32, 512, 4, 4), (32, 256, 8, 4),
    (64, 256, 8, 3), (32, 1024, 4, 3), (64, 512, 8, 3),
]
#: more candidates for FP8 weights (half the bytes per tile: longer K slices, more warps)
FP8_CONFIGS = [
    (16, 1024, 8, 4), (16, 2048, 4, 2), (16, 2048, 8, 3), (32, 1024, 8, 4), (32, 2048, 8, 2),
    (32, 512, 8, 6), (64, 1024, 8, 3), (16, 512, 8, 6),
]
#: launches of the one-row FP8 kernel (block_n, block_k, num_warps), at one row
ROW_TILES = [(8, 512, 4), (16, 256, 4), (16, 512, 4), (16, 1024, 4), (16, 512, 8),
             (32, 256, 4), (32, 512, 8), (8, 1024, 4)]
L2_BYTES = 60 * 2**20
PIPELINED = ",pipelined"  # the suffix of a pipelined one-row launch's key


def row_config_key(tiles: tuple[int, int, int], pipeline: bool) -> str:
    """The JSON key of a one-row launch: ``block_n,block_k,warps`` (+ ``,pipelined``)."""
    return ",".join(map(str, tiles)) + (PIPELINED if pipeline else "")


def layer_sums(rows: list[dict], model: str = "llama8b") -> dict[str, float]:
    """Seconds per layer of ``model``'s four projections (QKV, output, gate-up, down)
    at one row, per one-row launch timed for all four (the LM head is not per layer)."""
    per_shape = [r.get("row_configs", {}) for r in rows
                 if r["M"] == 1 and r.get("name", "").startswith(model + ".")
                 and not r["name"].endswith(".lm_head")]
    if len(per_shape) != 4:
        return {}
    keys = set.intersection(*(set(c) for c in per_shape))
    return {key: sum(c[key] for c in per_shape) for key in sorted(keys)}


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth, bytes read + written per second, from eagerly
    launched copies (:func:`gpu_engine.copy_bandwidth`, what the engine benchmarks
    report). Copies captured in a CUDA graph become memcpy nodes, which an H200 ran at
    2.7 TB/s against 4.26 for the copy kernel (session 38): the fractions this module,
    ``decode_chain.py`` and ``gemv_fold.py`` printed on H200s before then were against
    that lower figure."""
    from gpu_engine import copy_bandwidth as eager_copy_bandwidth

    bandwidth = eager_copy_bandwidth()
    if bandwidth is None:
        raise SystemExit("the copy bandwidth needs a CUDA GPU")
    return bandwidth


def _time(fn, calls: int = 20, reps: int = 5) -> float:
    """Seconds per call of ``fn``, replayed from a CUDA graph of ``calls`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (calls * reps)


def bench_shape(n: int, k: int, m: int, fp8: bool = False) -> dict:
    from lmkit_kernels.fp8 import fp8_linear_ref, quantize_per_channel, scaled_mm_linear

    weight_bytes = n * k + 4 * n if fp8 else n * k * 2
    copies = max(2, -(-L2_BYTES // weight_bytes) + 1)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    # fp8: (weight, per-channel scale); bf16: (weight, None)
    pairs = [quantize_per_channel(w) if fp8 else (w, None) for w in ws]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    nbytes = weight_bytes + m * (n + k) * 2
    i = [0]

    def nxt() -> tuple[torch.Tensor, torch.Tensor | None]:
        i[0] = (i[0] + 1) % copies
        return pairs[i[0]]

    def peer() -> torch.Tensor:
        w, s = nxt()
        return F.linear(x, w) if s is None else scaled_mm_linear(x, w, s.view(1, -1))

    def triton(bn: int, bk: int, warps: int, stages: int,
               pair: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
        w, s = pair or nxt()
        return small_m_linear(x, w, block_n=bn, block_k=bk, num_warps=warps,
                              num_stages=stages, weight_scale=s)

    row = {"N": n, "K": k, "M": m, "bytes": nbytes, "fp8": fp8}
    row["cublas_s"] = _time(peer, calls=copies * 4)
    w0, s0 = pairs[0]
    ref = (F.linear(x, w0) if s0 is None else fp8_linear_ref(x, w0, s0)).float()
    best = None
    for cfg in CONFIGS + (FP8_CONFIGS if fp8 else []):
        bn, bk, warps, stages = cfg
        try:
            out = triton(*cfg, pair=pairs[0])
            err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
            t = _time(lambda cfg=cfg: triton(*cfg), calls=copies * 4)
        except Exception as e:  # a config that does not compile/fit: skip it
            row.setdefault("failed", []).append(f"{cfg}: {type(e).__name__}")
            continue
        if err > 2e-2:
            row.setdefault("wrong", []).append(f"{cfg}: rel err {err:.3g}")
            continue
        row.setdefault("configs", {})[",".join(map(str, cfg))] = t
        if best is None or t < best[0]:
            best = (t, cfg)
    if fp8 and m == 1:  # the one-row kernel (lmkit_kernels.fp8_gemv) beside the tiled one
        from lmkit_kernels.fp8_gemv import fp8_row_linear

        for tiles, pipeline in ((t, p) for t in ROW_TILES for p in (False, True)):
            def row_kernel(tiles=tiles, pipeline=pipeline, pair=None):
                w, s = pair or nxt()
                return fp8_row_linear(x, w, s, block_n=tiles[0], block_k=tiles[1],
                                      num_warps=tiles[2], pipeline=pipeline)
            key = row_config_key(tiles, pipeline)
            err = (row_kernel(pair=pairs[0]).float() - ref).abs().max().item() / ref.abs().max().item()
            if err > 2e-2:
                row.setdefault("wrong", []).append(f"row {key}: rel err {err:.3g}")
                continue
            row.setdefault("row_configs", {})[key] = _time(row_kernel, calls=copies * 4)
        for pipeline, suffix in ((False, ""), (True, "_pipelined")):
            timed = {key: t for key, t in row.get("row_configs", {}).items()
                     if key.endswith(PIPELINED) is pipeline}
            if timed:
                key = min(timed, key=timed.get)
                row["row" + suffix + "_s"], row["row" + suffix + "_config"] = timed[key], key
    if best:
        row["triton_s"], row["triton_config"] = best
    ws.clear()
    pairs.clear()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--fp8", action="store_true",
                    help="FP8 weights (Triton with weight_scale; _scaled_mm as the peer)")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name(0)}: copy bandwidth {bw / 1e12:.3f} TB/s")
    rows = []
    for m in (int(r) for r in args.rows.split(",")):
        for name, (n, k) in SHAPES.items():
            r = bench_shape(n, k, m, args.fp8)
            r["name"] = name
            rows.append(r)
            cub = r["bytes"] / r["cublas_s"] / bw
            tri = r["bytes"] / r["triton_s"] / bw if "triton_s" in r else float("nan")
            peer = "_scaled_mm" if args.fp8 else "cuBLAS"
            print(f"M={m:2d} {name:18s} {peer} {1e6 * r['cublas_s']:8.1f} us ({cub:5.1%})  "
                  f"triton {1e6 * r.get('triton_s', float('nan')):8.1f} us ({tri:5.1%}) "
                  f"{r.get('triton_config')} {r.get('failed', '')} {r.get('wrong', '')}",
                  flush=True)
            for suffix, what in (("", "one-row kernel"), ("_pipelined", "  pipelined")):
                if f"row{suffix}_s" in r:
                    t = r[f"row{suffix}_s"]
                    print(f"     {'':18s} {what:14s} {1e6 * t:8.1f} us "
                          f"({r['bytes'] / t / bw:5.1%}) ({r[f'row{suffix}_config']})",
                          flush=True)
    sums = layer_sums(rows)
    if sums:
        print("llama8b, one layer's four projections at one row, per one-row launch "
              "(block_n,block_k,warps):")
        for tiles in dict.fromkeys(key.removesuffix(PIPELINED) for key in sums):
            plain, piped = sums.get(tiles), sums.get(tiles + PIPELINED)
            print(f"  {tiles:12s} plain " + (f"{1e6 * plain:7.1f} us" if plain else "   n/a")
                  + "  pipelined " + (f"{1e6 * piped:7.1f} us" if piped else "   n/a"),
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"copy_bandwidth": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""Folded small-batch projections against the separate kernels they replace, on CUDA.

For each decode projection that takes a fold (Llama-3.1-8B and Qwen3-0.6B: QKV and
gate-up after the RMSNorm with residual add, down after SiLU-and-multiply) at ``M``
rows, times the unfused pair (``rms_norm`` / ``silu_and_mul``, then ``small_m_linear``
with the model's tiles, :func:`lmkit_plugins.models.fused_ops.small_m_tiles`) and the
folded kernel (:class:`lmkit_plugins.models.fused_ops.GemvFold`), each inside a CUDA
graph of back-to-back calls over enough weight copies to miss L2 (as a decode step
replays them; :mod:`gemv_bandwidth`). A and B alternate over ``--rounds`` rounds; the
report gives medians, the spread, the weight bandwidth as a fraction of the copy
bandwidth, and the saving per decode step over all layers. ``--sweep`` also times the
folded kernel at other launch parameters (the fold's prologue and in-loop transform
may favour other tiles than ``small_m_linear``'s)::

    python bench/gemv_fold.py --rows 1,4,8 --out gemv_fold.json
    python bench/gemv_fold.py --rows 1 --sweep
    python bench/gemv_fold.py --rows 2,4 --shapes smollm2,qwen0.6b --fold-env LMKIT_PDL=0

(``--shapes``: only the shapes whose names start so; ``--fold-env NAME=VALUE``: the
folded kernel also timed with each variable set, alternating with the others -- for a
switch its launcher reads at each launch.)

With ``--fp8`` (one row only) the weights are FP8 e4m3 with per-channel scales and the
pair is ``rms_norm`` / ``silu_and_mul`` then the one-row FP8 kernel
(:func:`lmkit_kernels.fp8_gemv.fp8_row_linear`) against its folds
(:mod:`lmkit_kernels.fp8_gemv_fold`), both at the FP8 method's default one-row tiles
(``--row-tiles`` for others) and each also pipelined (``pipeline``), all alternating;
``--fold-block-n`` also times the folds at other rows per program (the FP8 option
``gemv_row_fold_block_n``; the same result)::

    python bench/gemv_fold.py --fp8 --rows 1 --fold-block-n 16,32 --out gemv_fold_fp8.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv_bandwidth import L2_BYTES, _time, copy_bandwidth  # noqa: E402
from gpu_args import parse_env  # noqa: E402
from lmkit_kernels.activation import silu_and_mul  # noqa: E402
from lmkit_kernels.gemv import small_m_linear  # noqa: E402
from lmkit_kernels.gemv_fold import norm_small_m_linear, silu_mul_small_m_linear  # noqa: E402
from lmkit_kernels.norm import rms_norm  # noqa: E402
from lmkit_plugins.models.fused_ops import GemvFold, small_m_tiles  # noqa: E402

#: name: (fold, N, K, layers); the norm folds carry a residual, as in every layer but
#: the first
SHAPES = {
    "llama8b.qkv": ("norm", 6144, 4096, 32), "llama8b.gate_up": ("norm", 28672, 4096, 32),
    "llama8b.down": ("silu", 4096, 14336, 32),
    "qwen0.6b.qkv": ("norm", 4096, 1024, 28), "qwen0.6b.gate_up": ("norm", 6144, 1024, 28),
    "qwen0.6b.down": ("silu", 1024, 3072, 28),
    "smollm2.qkv": ("norm", 960, 576, 30), "smollm2.gate_up": ("norm", 3072, 576, 30),
    "smollm2.down": ("silu", 576, 1536, 30),
}
SWEEP = [  # (block_n, num_warps, num_stages); block_k stays 512 (it sets the sum order)
    (16, 4, 4), (32, 4, 4), (32, 4, 3), (32, 4, 2), (64, 4, 3), (32, 8, 3), (64, 8, 3),
]


def bench_shape(fold: str, n: int, k: int, m: int, rounds: int, sweep: bool = False,
                envs: tuple[str, ...] = ()) -> dict:
    """Seconds per call, unfused and folded, over ``rounds`` alternating rounds; each
    ``NAME=VALUE`` of ``envs`` also times the folded kernel with that variable set
    (``folded[NAME=VALUE]``)."""
    copies = max(2, -(-L2_BYTES // (n * k * 2)) + 1)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    width = 2 * k if fold == "silu" else k
    x = torch.randn(m, width, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    norm_weight = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    tiles = small_m_tiles(n)
    folded = GemvFold()
    i = [0]

    def nxt() -> torch.Tensor:
        i[0] = (i[0] + 1) % copies
        return ws[i[0]]

    if fold == "silu":
        def unfused():
            return small_m_linear(silu_and_mul(x), nxt(), **tiles)

        def fused():
            return folded.silu_mul_linear(x, nxt(), None)
    else:
        def unfused():
            normed, _ = rms_norm(x, norm_weight, 1e-5, residual)
            return small_m_linear(normed, nxt(), **tiles)

        def fused():
            return folded.norm_linear(x, residual, norm_weight, 1e-5, nxt(), None)[0]

    fns = {"unfused": unfused, "folded": fused}
    for env in envs:
        fns[f"folded[{env}]"] = _with_env(env, fused)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(_time(fn, calls=copies * 4))
    result: dict = {name: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t)}
                    for name, t in times.items()}
    for bn, warps, stages in SWEEP if sweep else ():
        kw = {"block_n": bn, "block_k": 512, "num_warps": warps, "num_stages": stages}
        if fold == "silu":
            def fn(kw=kw):
                return silu_mul_small_m_linear(x, nxt(), **kw)
        else:
            def fn(kw=kw):
                return norm_small_m_linear(x, residual, norm_weight, 1e-5, nxt(), **kw)[0]
        try:
            t = statistics.median(_time(fn, calls=copies * 4) for _ in range(rounds))
        except Exception as e:  # a config that does not compile or fit: skip it
            t = f"{type(e).__name__}"
        result.setdefault("sweep", []).append({**kw, "median_s": t})
    ws.clear()
    torch.cuda.empty_cache()
    return result


def _with_env(env: str, fn):
    """``fn`` run with the environment variables of ``env`` (``NAME=VALUE[,...]``) set (the
    kernels' launchers read their switches at each launch)."""
    values = parse_env(env, "--fold-env")

    def run():
        saved = {name: os.environ.get(name) for name in values}
        os.environ.update(values)
        try:
            return fn()
        finally:
            for name, old in saved.items():
                if old is None:
                    os.environ.pop(name)
                else:
                    os.environ[name] = old
    return run


def bench_fp8_shape(fold: str, n: int, k: int, rounds: int, tiles: tuple[int, ...],
                    fold_block_ns: tuple[int, ...] = ()) -> dict:
    """Seconds per call at one row with FP8 weights, over ``rounds`` alternating rounds:
    the separate kernels then the one-row kernel (``unfused``), its fold (``folded``),
    both pipelined (``*_pipelined``), and the folds at each of ``fold_block_ns`` rows per
    program (``folded_bn<N>``, ``folded_bn<N>_pipelined``)."""
    from lmkit_kernels.fp8 import quantize_per_channel
    from lmkit_kernels.fp8_gemv import fp8_row_linear
    from lmkit_kernels.fp8_gemv_fold import norm_fp8_row_linear, silu_mul_fp8_row_linear

    copies = max(2, -(-L2_BYTES // (n * k)) + 1)
    ws = [quantize_per_channel(torch.randn(n, k, device="cuda") * 0.02) for _ in range(copies)]
    x = torch.randn(1, 2 * k if fold == "silu" else k, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    norm_weight = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    i = [0]

    def nxt() -> tuple[torch.Tensor, torch.Tensor]:
        i[0] = (i[0] + 1) % copies
        return ws[i[0]]

    def variant(folded: bool, pipeline: bool, block_n: int = tiles[0]):
        launch = {"block_n": block_n, "block_k": tiles[1], "num_warps": tiles[2]}
        if fold == "silu" and folded:
            return lambda: silu_mul_fp8_row_linear(x, *nxt(), pipeline=pipeline, **launch)
        if fold == "silu":
            return lambda: fp8_row_linear(silu_and_mul(x), *nxt(), pipeline=pipeline, **launch)
        if folded:
            return lambda: norm_fp8_row_linear(x, residual, norm_weight, 1e-5, *nxt(),
                                               pipeline=pipeline, **launch)[0]
        return lambda: fp8_row_linear(rms_norm(x, norm_weight, 1e-5, residual)[0], *nxt(),
                                      pipeline=pipeline, **launch)

    fns = {"unfused": variant(False, False), "folded": variant(True, False),
           "unfused_pipelined": variant(False, True), "folded_pipelined": variant(True, True)}
    for bn in fold_block_ns:
        fns[f"folded_bn{bn}"] = variant(True, False, bn)
        fns[f"folded_bn{bn}_pipelined"] = variant(True, True, bn)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(_time(fn, calls=copies * 4))
    ws.clear()
    torch.cuda.empty_cache()
    return {name: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t)}
            for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sweep", action="store_true", help="also time other launch parameters")
    ap.add_argument("--fp8", action="store_true",
                    help="FP8 weights: the one-row FP8 kernel and its folds (--rows 1)")
    ap.add_argument("--row-tiles", default=None,
                    help="with --fp8: block_n,block_k,warps of the one-row kernel "
                    "(default: the FP8 method's)")
    ap.add_argument("--fold-block-n", default="",
                    help="with --fp8: also time the folds at these rows per program "
                    "(comma-separated powers of two)")
    ap.add_argument("--fold-env", nargs="*", default=[], metavar="NAME=VALUE[,...]",
                    help="also time the folded kernel with each of these environments")
    ap.add_argument("--shapes", default="",
                    help="comma-separated prefixes of the shapes to time (default: all)")
    args = ap.parse_args()
    for env in args.fold_env:
        parse_env(env, "--fold-env")  # refused here, with the reason, not mid-run
    if args.fp8 and (args.rows != "1" or args.sweep):
        ap.error(f"--fp8 times the one-row FP8 kernel: use --rows 1 without --sweep (got "
                 f"--rows {args.rows}{' --sweep' if args.sweep else ''})")
    from lmkit_kernels.fp8_gemv import ROW_TILES

    tiles = (tuple(int(v) for v in args.row_tiles.split(",")) if args.row_tiles
             else ROW_TILES)
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name(0)}: copy bandwidth {bw / 1e12:.3f} TB/s")
    rows = []
    for m in (int(r) for r in args.rows.split(",")):
        saved: dict[str, float] = {}
        for name, (fold, n, k, layers) in SHAPES.items():
            if args.shapes and not any(name.startswith(p) for p in args.shapes.split(",")):
                continue
            if args.fp8:
                r = bench_fp8_shape(fold, n, k, args.rounds, tiles, tuple(
                    int(v) for v in args.fold_block_n.split(",") if v))
            else:
                r = bench_shape(fold, n, k, m, args.rounds, args.sweep, tuple(args.fold_env))
            r.update(name=name, M=m, N=n, K=k, fp8=args.fp8)
            rows.append(r)
            u, f = r["unfused"]["median_s"], r["folded"]["median_s"]
            model = name.split(".")[0]
            saved[model] = saved.get(model, 0.0) + (u - f) * layers
            print(f"M={m:2d} {name:17s} unfused {1e6 * u:7.1f} us "
                  f"[{1e6 * r['unfused']['min_s']:.1f}-{1e6 * r['unfused']['max_s']:.1f}]  "
                  f"folded {1e6 * f:7.1f} us [{1e6 * r['folded']['min_s']:.1f}-"
                  f"{1e6 * r['folded']['max_s']:.1f}]  weight read at "
                  f"{n * k * (1 if args.fp8 else 2) / f / bw:5.1%} of copy bw (folded)",
                  flush=True)
            if "folded_pipelined" in r:
                up, fp = r["unfused_pipelined"], r["folded_pipelined"]
                print(f"     {'pipelined':17s} unfused {1e6 * up['median_s']:7.1f} us "
                      f"[{1e6 * up['min_s']:.1f}-{1e6 * up['max_s']:.1f}]  folded "
                      f"{1e6 * fp['median_s']:7.1f} us [{1e6 * fp['min_s']:.1f}-"
                      f"{1e6 * fp['max_s']:.1f}]", flush=True)
            for key in (key for key in r if key.startswith(("folded_bn", "folded["))):
                t = r[key]
                print(f"     {key:17s} {1e6 * t['median_s']:7.1f} us [{1e6 * t['min_s']:.1f}-"
                      f"{1e6 * t['max_s']:.1f}]", flush=True)
            for c in r.get("sweep", []):
                t = c["median_s"]
                print(f"    folded bn={c['block_n']} warps={c['num_warps']} stages="
                      f"{c['num_stages']}: " + (f"{1e6 * t:7.1f} us" if isinstance(t, float)
                                                else t), flush=True)
        for model, s in saved.items():
            print(f"M={m:2d} {model}: {1e3 * s:.3f} ms saved per decode step (all layers)")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"copy_bandwidth": bw, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()

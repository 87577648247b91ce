"""Benchmark K: decode attention alone against the device's memory bandwidth.

64 sequences x 4096 cached tokens with Llama-3.1-8B's attention heads (32 query heads,
8 KV heads, head size 128, bf16) by default. For each available attention backend
(torch, triton, flashinfer, flash_attn) it plans one decode step and times ``run()`` (the new
token's K/V write plus attention) with CUDA events over many iterations, then reports
the bytes one call must move (K and V of every cached token, plus q and the output),
the achieved GB/s, and that as a fraction of the copy bandwidth measured in the same
run (a large device-to-device copy; bytes read + written over time). Backends that
declare ``cuda_graphs`` are also timed replaying a CUDA graph of 32 calls, as the engine
runs decode, which leaves out the per-kernel launch cost that dominates small batches::

    python bench/attention_decode.py --out k.json
    python bench/attention_decode.py --backends triton --sweep-splits --out k.json
    python bench/attention_decode.py --num-seqs 1 --context 384 --out w2_attn.json  # W2-like
    python bench/attention_decode.py --num-seqs 256 --num-heads 16 --context-range 200,2048 \
        --backends triton --sweep-splits --out w1_attn.json  # W1-like, mixed lengths

``--context-range LO,HI`` draws each sequence's context uniformly from LO..HI (fixed
seed) instead of ``--context`` for all, as a batch of requests at different points of
their generation has. ``--sweep-decode-tiles 64/4/3,128/4/2`` also times triton with
each decode tile configuration (``BLOCK_N/num_warps/num_stages``; option
``decode_tiles``). ``--kv-cache-dtypes auto,fp8`` times every run over the model-dtype
cache and over a float8 e4m3 one (backends claiming ``fp8_kv_cache``; its bytes counted
at one per value)::

    python bench/attention_decode.py --num-seqs 256 --num-heads 16 --context-range 200,2048 \
        --backends triton --kv-cache-dtypes auto,fp8 --out w1_fp8.json

The triton backend is timed twice: merging its context slices inside the decode kernel
(the default) and with the merge as a second launch (``decode_merge_in_kernel=False``).
flash_attn is also timed on a cache of 128-token blocks (FlashAttention-4 loads such
pages, one key tile each, with TMA; other block sizes row by row), and its rows name
the FlashAttention generation that ran.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys

import torch
from lmkit.api import AttentionMetadata, PluginHost
from lmkit_kernels.random_batch import make_paged_batch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def time_cuda(fn, *, warmup: int, iters: int) -> float:
    """Mean seconds per call of ``fn`` on the current stream (CUDA events)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def copy_bandwidth(num_bytes: int, *, warmup: int, iters: int) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * num_bytes / time_cuda(lambda: dst.copy_(src), warmup=warmup, iters=iters)


def bench_backend(name: str, batch, args, options: dict | None = None,
                  block_size: int | None = None, kv_dtype: str = "auto") -> dict:
    """Time one backend's decode ``run()`` on ``batch`` (built with ``block_size``, default
    ``args.block_size``; ``kv_dtype`` ``fp8``: over the batch's cache in float8 e4m3);
    returns a result row (or the skip reason)."""
    block_size = block_size or args.block_size
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    spec = host.registry.get("attention", name).spec
    reasons = spec.unavailable_reasons()
    if kv_dtype == "fp8" and "fp8_kv_cache" not in spec.caps.features:
        reasons = [*reasons, "no fp8_kv_cache"]
    if reasons:
        return {"backend": name, "kv_cache_dtype": kv_dtype, "skipped": "; ".join(reasons)}
    cls = spec.load()
    dtype = DTYPES[args.dtype]
    fp8 = kv_dtype == "fp8"
    backend = cls(num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                  head_size=args.head_size, scale=args.head_size ** -0.5, dtype=dtype,
                  device=torch.device("cuda"), block_size=block_size,
                  options=spec.validate_options(options or {}),
                  kv_cache_dtype=torch.float8_e4m3fn if fp8 else None)
    cache = batch.kv_cache.clamp(-448, 448).to(torch.float8_e4m3fn) if fp8 else batch.kv_cache
    md = AttentionMetadata(**batch.metadata_kwargs(
        max_query_len=1, num_decodes=batch.num_reqs))
    backend.plan(md)
    seconds = time_cuda(lambda: backend.run(0, batch.q, batch.k, batch.v, cache),
                        warmup=args.warmup, iters=args.iters)
    kv_bytes = (2 * int(batch.seq_lens_cpu.sum()) * args.num_kv_heads * args.head_size
                * cache.element_size())
    qo_bytes = 2 * batch.q[: batch.num_tokens].numel() * batch.q.element_size()
    total = kv_bytes + qo_bytes
    row = {"backend": name, "kv_cache_dtype": kv_dtype, "options": options or {},
           "block_size": block_size,
           "bytes": total, "eager_us_per_call": seconds * 1e6,
           "eager_gb_per_s": total / seconds / 1e9}
    if hasattr(backend, "generation"):  # flash_attn: which FlashAttention ran
        row["generation"] = backend.generation
    if "cuda_graphs" in spec.caps.features and args.graph_layers > 0:
        md.cuda_graph = True
        seconds = graph_seconds_per_call(backend, md, batch, cache, args)
        row.update(graph_us_per_call=seconds * 1e6, graph_gb_per_s=total / seconds / 1e9)
    return row


def graph_seconds_per_call(backend, md, batch, cache, args) -> float:
    """Seconds per ``run()`` over ``cache`` replayed from a CUDA graph of
    ``args.graph_layers`` calls (as the engine runs decode: one graph per step, no
    per-kernel launch cost)."""
    backend.plan(md)
    call = lambda: backend.run(0, batch.q, batch.k, batch.v, cache)  # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(args.graph_layers):
            call()
    iters = max(3, args.iters // args.graph_layers)
    return time_cuda(graph.replay, warmup=2, iters=iters) / args.graph_layers


def context_lengths(args) -> list[int]:
    """Each sequence's cached tokens (the new one included): ``--context`` for all, or
    drawn from ``--context-range LO,HI`` (seed 0)."""
    if not args.context_range:
        return [args.context] * args.num_seqs
    lo, _, hi = args.context_range.partition(",")
    if not (lo.strip().isdigit() and hi.strip().isdigit()) or not 1 <= int(lo) <= int(hi):
        raise SystemExit(f"--context-range: expected LO,HI with 1 <= LO <= HI, got "
                         f"{args.context_range!r}")
    gen = torch.Generator().manual_seed(0)
    return torch.randint(int(lo), int(hi) + 1, (args.num_seqs,), generator=gen).tolist()


def parse_tiles(text: str) -> list[list[int]]:
    """``"64/4/3,128/4/2"`` -> ``[[64, 4, 3], [128, 4, 2]]``."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        fields = part.split("/")
        if len(fields) != 3 or not all(f.isdigit() for f in fields):
            raise SystemExit(f"--sweep-decode-tiles: expected BLOCK_N/warps/stages, got {part!r}")
        out.append([int(f) for f in fields])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096,
                        help="cached tokens per sequence, the new one included")
    parser.add_argument("--context-range", default="",
                        help="LO,HI: each sequence's context drawn uniformly from LO..HI")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--backends", default="torch,triton,flashinfer,flash_attn")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--copy-gib", type=float, default=2.0, help="size of the copy test")
    parser.add_argument("--graph-layers", type=int, default=32,
                        help="also time backends that support CUDA graphs by replaying a "
                        "graph of this many calls (0: eager only)")
    parser.add_argument("--sweep-splits", action="store_true",
                        help="also time triton with decode_num_splits 1, 2, 4, 8, 16")
    parser.add_argument("--sweep-decode-tiles", default="",
                        help="also time triton with these decode tiles, BLOCK_N/warps/stages "
                        "comma-separated (e.g. 64/4/3,128/4/2)")
    parser.add_argument("--kv-cache-dtypes", default="auto",
                        help="comma-separated: auto (the model dtype) and/or fp8 (float8 "
                        "e4m3 cache, backends claiming fp8_kv_cache), each timed in turn")
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    args = parser.parse_args(argv)
    contexts = context_lengths(args)
    kv_dtypes = [d.strip() for d in args.kv_cache_dtypes.split(",") if d.strip()]
    if not kv_dtypes or set(kv_dtypes) - {"auto", "fp8"}:
        parser.error(f"--kv-cache-dtypes takes auto and/or fp8, got {args.kv_cache_dtypes!r}")
    if not torch.cuda.is_available():
        print("attention_decode needs a CUDA device", file=sys.stderr)
        return 2

    def make_batch(block_size: int):
        return make_paged_batch([(c - 1, 1) for c in contexts],
                                num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                                head_size=args.head_size, block_size=block_size,
                                dtype=DTYPES[args.dtype], device="cuda")

    batches = {args.block_size: make_batch(args.block_size)}
    bandwidth = copy_bandwidth(int(args.copy_gib * 2 ** 30), warmup=args.warmup,
                               iters=max(20, args.iters // 5))
    runs = [(name.strip(), None, args.block_size)
            for name in args.backends.split(",") if name.strip()]
    names = [name for name, _, _ in runs]
    if "triton" in names:  # the slice merge as a second launch
        runs.append(("triton", {"decode_merge_in_kernel": False}, args.block_size))
    if "flash_attn" in names and args.block_size != 128:  # FA4's TMA page path
        runs.append(("flash_attn", None, 128))
    if args.sweep_splits:
        runs += [("triton", {"decode_num_splits": s}, args.block_size) for s in (1, 2, 4, 8, 16)]
    runs += [("triton", {"decode_tiles": tiles}, args.block_size)
             for tiles in parse_tiles(args.sweep_decode_tiles)]
    results = []
    for (name, options, block_size), kv_dtype in itertools.product(runs, kv_dtypes):
        if block_size not in batches:
            batches[block_size] = make_batch(block_size)
        row = bench_backend(name, batches[block_size], args, options, block_size, kv_dtype)
        for mode in ("eager", "graph"):
            if f"{mode}_gb_per_s" in row:
                row[f"{mode}_fraction_of_copy_bw"] = row[f"{mode}_gb_per_s"] * 1e9 / bandwidth
        results.append(row)

    device = torch.cuda.get_device_name()
    span = args.context_range.replace(",", "-") if args.context_range else args.context
    print(f"decode attention: {args.num_seqs} seqs x {span} tokens, heads "
          f"{args.num_heads}/{args.num_kv_heads}x{args.head_size}, {args.dtype}, "
          f"block {args.block_size}, on {device}")
    print(f"copy bandwidth (read+write): {bandwidth / 1e9:.0f} GB/s")
    print(f"{'backend':<28}{'MB moved':>9}  {'eager us':>9}{'GB/s':>6}{'of bw':>7}  "
          f"{'graph us':>9}{'GB/s':>6}{'of bw':>7}")
    for row in results:
        label = row["backend"] + "".join(f" {k}={v}" for k, v in (row.get("options") or {}).items())
        if row.get("kv_cache_dtype", "auto") != "auto":
            label += f" kv={row['kv_cache_dtype']}"
        if row.get("generation"):
            label += f" {row['generation']}"
        if row.get("block_size", args.block_size) != args.block_size:
            label += f" block={row['block_size']}"
        if "skipped" in row:
            print(f"{label:<28}  skipped: {row['skipped']}")
            continue
        line = f"{label:<28}{row['bytes'] / 1e6:>9.1f}"
        for mode in ("eager", "graph"):
            if f"{mode}_us_per_call" in row:
                line += (f"  {row[f'{mode}_us_per_call']:>9.1f}{row[f'{mode}_gb_per_s']:>6.0f}"
                         f"{row[f'{mode}_fraction_of_copy_bw']:>7.1%}")
        print(line)
    report = {"benchmark": "K: decode attention", "device": device,
              "torch": torch.__version__, "python": platform.python_version(),
              "config": {k: v for k, v in vars(args).items() if k != "out"},
              "copy_bandwidth_bytes_per_s": bandwidth, "results": results}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

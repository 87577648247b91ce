"""MLA decode attention against the device's memory bandwidth (mla_triton, mla_flashinfer).

DeepSeek-V2-Lite's attention shape by default (16 query heads, kv_lora_rank 512, rope
64, nope 128, v 128, bf16, block 16). For each (sequences x context) shape and each
available MLA backend it plans one decode step and times, with CUDA events:

* ``kernel``: the attention over the latent cache alone (the backend's
  ``attend_latent``: lmkit's split-K Triton kernel plus its merge, or FlashInfer's MLA
  wrapper), replayed from a CUDA graph of ``--graph-calls`` calls so that launch cost
  is left out; its bytes are the latent cache it must read (``sum(seq_lens) *
  (kv_lora_rank + rope) * 2``), and GB/s as a fraction of the copy bandwidth measured in
  the same run (a large device-to-device copy, bytes read + written over time);
* ``layer``: a whole ``run_mla`` eager (cache write, the two per-head matmuls around
  the attention), in microseconds.

One command, a table at the end (and JSON with ``--out``)::

    python bench/mla_decode.py
    python bench/mla_decode.py --shapes 64x4096 --sweep-splits --out mla.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
from lmkit.api import AttentionMetadata, PluginHost
from lmkit_kernels.mla_attention import absorb_query
from lmkit_kernels.mla_batch import make_mla_batch
from lmkit_kernels.mla_ref import split_kv_b

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_decode import DTYPES, copy_bandwidth, time_cuda  # noqa: E402

DEFAULT_SHAPES = "1x4096,16x4096,64x1024,64x4096,128x4096,32x16384"


def graph_time(fn, calls: int, *, warmup: int, iters: int) -> float:
    """Seconds per call of ``fn``, replaying a CUDA graph of ``calls`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return time_cuda(graph.replay, warmup=warmup, iters=iters) / calls


def bench_one(name: str, options: dict | None, num_seqs: int, context: int, args) -> dict:
    """Time one backend on one shape; a row of the table."""
    row: dict = {"backend": name, "options": options, "num_seqs": num_seqs,
                 "context": context}
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    spec = host.registry.get("attention", name).spec
    reasons = spec.unavailable_reasons()
    if reasons:
        row["skipped"] = "; ".join(reasons)
        return row
    dtype = DTYPES[args.dtype]
    dims = dict(num_heads=args.num_heads, kv_lora_rank=args.kv_lora_rank,
                qk_nope_head_dim=args.nope, qk_rope_head_dim=args.rope, v_head_dim=args.v)
    batch = make_mla_batch([(context - 1, 1)] * num_seqs, **dims, block_size=args.block_size,
                           dtype=dtype, device="cuda")
    try:
        backend = spec.load()(
            num_kv_heads=1, head_size=args.kv_lora_rank + args.rope, scale=batch.scale,
            dtype=dtype, device=torch.device("cuda"), block_size=args.block_size,
            options=spec.options(**options) if options else None, **dims)
    except (ImportError, ValueError) as exc:
        row["skipped"] = str(exc)
        return row
    backend.plan(AttentionMetadata(**batch.layout.metadata_kwargs()))
    plan = backend._plan
    w_uk, _ = split_kv_b(batch.w_kv_b, args.num_heads, args.nope)
    q_lat = absorb_query(batch.q_nope, w_uk).transpose(0, 1)
    cache = batch.kv_cache

    def kernel():
        backend.attend_latent(plan, q_lat, batch.q_pe, cache)

    def layer():
        backend.run_mla(0, batch.q_nope, batch.q_pe, batch.kv_c, batch.k_pe, cache,
                        batch.w_kv_b)

    seconds = graph_time(kernel, args.graph_calls, warmup=args.warmup, iters=args.iters)
    row["num_splits"] = plan.num_splits
    row["bytes"] = num_seqs * context * (args.kv_lora_rank + args.rope) * cache.element_size()
    row["kernel_us"] = seconds * 1e6
    row["kernel_gb_per_s"] = row["bytes"] / seconds / 1e9
    row["layer_eager_us"] = time_cuda(layer, warmup=args.warmup, iters=args.iters) * 1e6
    return row


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES,
                        help="comma-separated SEQSxCONTEXT, e.g. 64x4096")
    parser.add_argument("--num-heads", type=int, default=16)
    parser.add_argument("--kv-lora-rank", type=int, default=512)
    parser.add_argument("--rope", type=int, default=64)
    parser.add_argument("--nope", type=int, default=128)
    parser.add_argument("--v", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--backends", default="mla_triton,mla_flashinfer")
    parser.add_argument("--sweep-splits", action="store_true",
                        help="also time mla_triton with decode_num_splits 1, 2, 4, 8, 16")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--graph-calls", type=int, default=20)
    parser.add_argument("--copy-gib", type=float, default=2.0, help="size of the copy test")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("mla_decode needs a CUDA device", file=sys.stderr)
        return 2
    bandwidth = copy_bandwidth(int(args.copy_gib * 2 ** 30), warmup=args.warmup,
                               iters=max(20, args.iters))
    shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes.split(",")]
    runs: list[tuple[str, dict | None]] = [(n.strip(), None) for n in args.backends.split(",")
                                           if n.strip()]
    if args.sweep_splits and "mla_triton" in args.backends:
        runs += [("mla_triton", {"decode_num_splits": s}) for s in (1, 2, 4, 8, 16)]
    results = []
    for num_seqs, context in shapes:
        for name, options in runs:
            row = bench_one(name, options, num_seqs, context, args)
            if "kernel_gb_per_s" in row:
                row["fraction_of_copy_bw"] = row["kernel_gb_per_s"] * 1e9 / bandwidth
            results.append(row)
            torch.cuda.empty_cache()

    device = torch.cuda.get_device_name()
    print(f"MLA decode: heads {args.num_heads}, kv_lora_rank {args.kv_lora_rank}, rope "
          f"{args.rope}, {args.dtype}, block {args.block_size}, on {device}")
    print(f"copy bandwidth (read+write): {bandwidth / 1e9:.0f} GB/s")
    print(f"{'backend':<32}{'seqs x ctx':>12}{'splits':>7}{'MB read':>9}{'kernel us':>11}"
          f"{'GB/s':>7}{'of bw':>7}{'layer us':>10}")
    for row in results:
        label = row["backend"] + "".join(f" {k}={v}" for k, v in (row["options"] or {}).items())
        shape = f"{row['num_seqs']}x{row['context']}"
        if "skipped" in row:
            print(f"{label:<32}{shape:>12}  skipped: {row['skipped']}")
            continue
        print(f"{label:<32}{shape:>12}{row['num_splits']:>7}{row['bytes'] / 1e6:>9.1f}"
              f"{row['kernel_us']:>11.1f}{row['kernel_gb_per_s']:>7.0f}"
              f"{row['fraction_of_copy_bw']:>7.1%}{row['layer_eager_us']:>10.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "MLA decode attention", "device": device,
                       "torch": torch.__version__, "python": platform.python_version(),
                       "config": {k: v for k, v in vars(args).items() if k != "out"},
                       "copy_bandwidth_bytes_per_s": bandwidth, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

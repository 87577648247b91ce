"""MLA decode attention over the latent cache against the device's memory bandwidth.

DeepSeek's attention shapes (kv_lora_rank 512, rope 64, nope 128, v 128; bf16, block
16) with the query heads of DeepSeek-V2-Lite (16, also V2/V3 on 8 GPUs) and of
DeepSeek-V2/V3 on one (128), for every batch size x context length of the grid (1..256
sequences, 1K..8K tokens each, the new one included). Per shape and implementation it
plans one decode step and times, with CUDA events:

* ``us``: the attention over the latent cache alone (``q_lat = q_nope @ W_UK`` given),
  replayed from a CUDA graph of ``--graph-calls`` calls so that launch cost is left
  out: ``mla_triton`` (lmkit's split-K Triton kernel and its merge), ``mla_flashinfer``
  (FlashInfer's ``BatchMLAPagedAttentionWrapper``, skipped with the reason when
  FlashInfer is not importable) and ``torch`` (the same absorbed attention in plain
  torch: the contexts' latent blocks gathered, two batched matmuls, a float32 softmax);
* ``GB/s``: the bytes a call must move -- the latent cache it reads (``sum(seq_lens) *
  576 * 2``) plus ``q_lat``/``q_pe`` read and the latent output written -- over that
  time, and as a fraction of the copy bandwidth measured in the same run (a large
  device-to-device copy, bytes read + written over time);
* ``err``: the largest absolute difference from the float32 reference
  (``lmkit_kernels.mla_ref.mla_latent_attention_ref``);
* ``layer us``: a whole ``run_mla`` of the backend, eager (cache write and the two
  per-head matmuls around the attention included).

One command on a CUDA machine; a table at the end, JSON with ``--json PATH`` (``-``:
stdout)::

    python bench/mla_decode.py --json mla_decode.json
    python bench/mla_decode.py --models v3 --batch-sizes 64 --contexts 4096 --sweep-splits
    python bench/mla_decode.py --models v3 --contexts 4096 --sweep-head-tiles
    python bench/mla_decode.py --models v3 --batch-sizes 1,64,256 --contexts 4096 \
        --backends mla_triton --sweep-geometry

Without a CUDA device it exits with status 2 and says so.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import sys
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_decode import DTYPES, copy_bandwidth, time_cuda  # noqa: E402

#: query heads per model (on one GPU); the other MLA dimensions are DeepSeek's
MODELS = {"v2-lite": 16, "v2": 128, "v3": 128}
DIMS = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
BACKENDS = ("mla_triton", "mla_flashinfer", "torch")
#: --sweep-geometry: (head tile, BLOCK_N, warps, stages) of the decode kernel; the first is
#: session 9's 16-head tiling, (64, 32, 8, 2) the default above 16 heads
GEOMETRIES = ((16, 32, 4, 2), (32, 32, 4, 2), (32, 32, 8, 2), (64, 32, 8, 2), (64, 16, 8, 2),
              (64, 64, 8, 2), (64, 32, 8, 3), (64, 32, 16, 2), (128, 16, 16, 2))


def torch_latent_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                        scale: float) -> torch.Tensor:
    """Absorbed MLA decode (one new token per request) in plain torch, no host sync.

    Gathers each request's first ``max_seq_len`` latent entries through ``block_tables``,
    ``scores = scale * [q_lat | q_pe] . [c_kv | k_pe]`` (one batched matmul in the input
    dtype), masks positions past ``seq_lens``, a float32 softmax, then ``probs @ c_kv``.

    :param q_lat: ``[num_reqs, num_heads, kv_lora_rank]``; ``q_pe``: ``[.., rope]``
    :param kv_cache: ``[num_blocks, block_size, kv_lora_rank + rope]``
    :return: ``[num_reqs, num_heads, kv_lora_rank]`` in ``q_lat``'s dtype
    """
    num_reqs, rank = q_lat.shape[0], q_lat.shape[-1]
    block_size = kv_cache.shape[1]
    num_pages = -(-max_seq_len // block_size)
    latent = kv_cache[block_tables[:, :num_pages].long()].view(
        num_reqs, num_pages * block_size, -1)[:, :max_seq_len]
    q = torch.cat((q_lat, q_pe), dim=-1)
    scores = torch.bmm(q, latent.transpose(1, 2)).float() * scale  # [reqs, heads, keys]
    past = torch.arange(max_seq_len, device=q.device)[None, :] >= seq_lens[:, None]
    scores.masked_fill_(past[:, None, :], -math.inf)
    return torch.bmm(scores.softmax(-1).to(q.dtype), latent[..., :rank])


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
    seconds = time_cuda(graph.replay, warmup=warmup, iters=iters) / calls
    del graph
    return seconds


@functools.cache
def _registry():
    from lmkit.api import PluginHost

    return PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}).registry


def make_backend(name: str, options: dict | None, heads: int, batch, args):
    """``(backend, None)`` built and planned for ``batch``'s decode step (as a CUDA-graph
    step), or ``(None, why not)``."""
    from lmkit.api import AttentionMetadata

    spec = _registry().get("attention", name).spec
    reasons = spec.unavailable_reasons()
    if reasons:
        return None, "; ".join(reasons)
    try:
        backend = spec.load()(
            num_heads=heads, num_kv_heads=1, head_size=DIMS["kv_lora_rank"] +
            DIMS["qk_rope_head_dim"], scale=batch.scale, dtype=DTYPES[args.dtype],
            device=torch.device("cuda"), block_size=args.block_size,
            options=spec.validate_options(options or {}), **DIMS)
    except (ImportError, ValueError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    backend.plan(AttentionMetadata(**batch.layout.metadata_kwargs(cuda_graph=True)))
    return backend, None


def bench_shape(model: str, num_seqs: int, context: int, runs, bandwidth: float, args
                ) -> list[dict]:
    """Time every run (backend name, options) on one shape; rows of the table."""
    from lmkit_kernels.mla_attention import absorb_query
    from lmkit_kernels.mla_batch import make_mla_batch
    from lmkit_kernels.mla_ref import mla_cache_write_ref, mla_latent_attention_ref, split_kv_b

    heads = MODELS[model]
    batch = make_mla_batch([(context - 1, 1)] * num_seqs, num_heads=heads, **DIMS,
                           block_size=args.block_size, dtype=DTYPES[args.dtype], device="cuda")
    lay, cache = batch.layout, batch.kv_cache
    # the new tokens' entries written first, as every run_mla (the layer timing) writes them
    mla_cache_write_ref(batch.kv_c, batch.k_pe, cache, lay.slot_mapping)
    w_uk, _ = split_kv_b(batch.w_kv_b, heads, DIMS["qk_nope_head_dim"])
    # [seqs, heads, rank], contiguous (FlashInfer's wrapper would copy it otherwise)
    q_lat = absorb_query(batch.q_nope, w_uk).transpose(0, 1).contiguous()
    ref = mla_latent_attention_ref(q_lat, batch.q_pe, cache, lay.query_start_loc,
                                   lay.seq_lens, lay.block_tables, batch.scale).float()
    elem = cache.element_size()
    # the latent cache read, the query read and the latent output written
    nbytes = (num_seqs * context * cache.shape[-1] + q_lat.numel() + batch.q_pe.numel()
              + q_lat.numel()) * elem
    rows = []
    for name, options in runs:
        row: dict = {"model": model, "num_heads": heads, "num_seqs": num_seqs,
                     "context": context, "backend": name, "options": options or {},
                     "bytes": nbytes}
        rows.append(row)
        try:
            if name == "torch":
                time_torch(row, q_lat, batch, context, ref, bandwidth, args)
            elif name == "mla_decode":
                try:
                    time_kernel(row, q_lat, batch, heads, ref, bandwidth, args)
                except Exception as exc:  # noqa: BLE001 -- a sweep row that cannot compile
                    row["skipped"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            else:
                time_backend(row, q_lat, batch, heads, ref, bandwidth, args)
        except torch.cuda.OutOfMemoryError as exc:  # the torch path at the largest shapes
            row["skipped"] = f"out of GPU memory: {str(exc).splitlines()[0]}"
        except OutOfResources as exc:  # a tiling (--sweep-head-tiles) this GPU cannot fit
            row["skipped"] = f"Triton: {str(exc).splitlines()[0]}"
        torch.cuda.empty_cache()
    return rows


def _time_attention(row: dict, attend, ref: torch.Tensor, bandwidth: float, args) -> None:
    """Fill ``row`` with ``attend``'s error against ``ref`` and its graph-replayed time."""
    row["max_abs_err"] = (attend().float() - ref).abs().max().item()
    seconds = graph_time(attend, args.graph_calls, warmup=args.warmup, iters=args.iters)
    row["us"] = seconds * 1e6
    row["gb_per_s"] = row["bytes"] / seconds / 1e9
    row["fraction_of_copy_bw"] = row["bytes"] / seconds / bandwidth


def time_torch(row: dict, q_lat: torch.Tensor, batch, context: int, ref: torch.Tensor,
               bandwidth: float, args) -> None:
    """The plain-torch absorbed decode (:func:`torch_latent_decode`) on ``batch``."""
    lay = batch.layout
    _time_attention(row, lambda: torch_latent_decode(
        q_lat, batch.q_pe, batch.kv_cache, lay.block_tables, lay.seq_lens, context,
        batch.scale), ref, bandwidth, args)


def time_kernel(row: dict, q_lat: torch.Tensor, batch, heads: int, ref: torch.Tensor,
                bandwidth: float, args) -> None:
    """``mla_decode`` with the tiling ``row["options"]`` and the split count
    ``mla_triton`` would choose for its head tile."""
    from lmkit_kernels.mla_attention import DecodeGeometry, decode_num_splits, mla_decode

    geo = DecodeGeometry(**row["options"])
    lay = batch.layout
    splits = decode_num_splits(lay.num_reqs, heads, 1, q_lat.device, q_lat.dtype,
                               head_tile=geo.head_tile)
    row["num_splits"], row["head_tile"] = splits, geo.head_tile
    _time_attention(row, lambda: mla_decode(
        q_lat, batch.q_pe, batch.kv_cache, lay.query_start_loc, lay.seq_lens,
        lay.block_tables, max_query_len=1, scale=batch.scale, num_splits=splits,
        geometry=geo), ref, bandwidth, args)


def time_backend(row: dict, q_lat: torch.Tensor, batch, heads: int, ref: torch.Tensor,
                 bandwidth: float, args) -> None:
    """The backend ``row["backend"]``'s latent attention, then its whole ``run_mla``."""
    backend, why = make_backend(row["backend"], row["options"], heads, batch, args)
    if backend is None:
        row["skipped"] = why
        return
    plan = backend._plan
    row["num_splits"] = plan.num_splits
    if row["backend"] == "mla_triton":  # the decode tiling (lmkit_kernels.mla_attention)
        from lmkit_kernels.mla_attention import decode_head_tile

        row["head_tile"] = (row["options"] or {}).get("decode_head_tile") or decode_head_tile(
            heads, 1, DTYPES[args.dtype])
    cache = batch.kv_cache
    _time_attention(row, lambda: backend.attend_latent(plan, q_lat, batch.q_pe, cache), ref,
                    bandwidth, args)
    row["layer_eager_us"] = 1e6 * time_cuda(
        lambda: backend.run_mla(0, batch.q_nope, batch.q_pe, batch.kv_c, batch.k_pe, cache,
                                batch.w_kv_b),
        warmup=args.warmup, iters=args.iters)


def print_table(results: list[dict], bandwidth: float, args, device: str) -> None:
    """The results as a text table on stdout."""
    print(f"MLA decode over the latent cache: kv_lora_rank 512, rope 64, {args.dtype}, "
          f"block {args.block_size}, on {device}")
    print(f"copy bandwidth (read+write): {bandwidth / 1e9:.0f} GB/s")
    print(f"{'model':<8}{'heads':>6}{'seqs x ctx':>12}  {'implementation':<33}{'splits':>7}{'tile':>5}"
          f"{'MB':>8}{'us':>10}{'GB/s':>7}{'of bw':>7}{'err':>9}{'layer us':>10}")
    for row in results:
        label = row["backend"] + "".join(f" {k}={v}" for k, v in row["options"].items())
        if row["backend"] == "mla_decode":  # heads x keys, warps, stages
            label = "mla_decode {head_tile}x{block_n} w{num_warps} s{num_stages}".format(
                **row["options"])
        head = (f"{row['model']:<8}{row['num_heads']:>6}"
                f"{row['num_seqs']:>6}x{row['context']:<5}  {label:<33}")
        if "skipped" in row:
            print(f"{head}skipped: {row['skipped']}")
            continue
        layer = f"{row['layer_eager_us']:>10.1f}" if "layer_eager_us" in row else f"{'-':>10}"
        print(f"{head}{row.get('num_splits', '-'):>7}{row.get('head_tile', '-'):>5}"
              f"{row['bytes'] / 1e6:>8.1f}"
              f"{row['us']:>10.1f}{row['gb_per_s']:>7.0f}{row['fraction_of_copy_bw']:>7.1%}"
              f"{row['max_abs_err']:>9.1e}{layer}")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="v2-lite,v3",
                        help=f"comma-separated, of {', '.join(MODELS)} (query heads: "
                        f"{', '.join(f'{m} {h}' for m, h in MODELS.items())})")
    parser.add_argument("--batch-sizes", type=_ints, default=[1, 4, 16, 64, 256])
    parser.add_argument("--contexts", type=_ints, default=[1024, 2048, 4096, 8192],
                        help="tokens per sequence, the new one included")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help="comma-separated, of " + ", ".join(BACKENDS))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--sweep-splits", action="store_true",
                        help="also time mla_triton with decode_num_splits 1, 2, 4, ..., 64")
    parser.add_argument("--sweep-geometry", action="store_true",
                        help="also time lmkit_kernels.mla_attention.mla_decode itself with "
                        "each tiling of GEOMETRIES (head tile, keys per tile, warps, stages)")
    parser.add_argument("--sweep-head-tiles", action="store_true",
                        help="also time mla_triton with decode_head_tile 16, 32, 64 (16 at "
                        "128 heads: the session-9 tiling, eight reads of the latent cache)")
    parser.add_argument("--warmup", type=int, default=3, help="graph replays before timing")
    parser.add_argument("--iters", type=int, default=10, help="graph replays timed")
    parser.add_argument("--graph-calls", type=int, default=20, help="calls per CUDA graph")
    parser.add_argument("--copy-gib", type=float, default=2.0, help="size of the copy test")
    parser.add_argument("--json", "--out", dest="json", metavar="PATH",
                        help="also write the results as JSON here ('-': stdout, no table)")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for kind, given, allowed in (("model", models, MODELS), ("backend", backends, BACKENDS)):
        unknown = [x for x in given if x not in allowed]
        if unknown:
            parser.error(f"unknown {kind} {', '.join(unknown)}; choose from "
                         f"{', '.join(allowed)}")
    if min(args.batch_sizes + args.contexts, default=0) < 1:
        parser.error("--batch-sizes and --contexts must be positive integers")
    args.models, args.backends = models, backends
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit code (2 without a CUDA device)."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/mla_decode.py needs a CUDA device (torch.cuda.is_available() is False): "
              "run it on a GPU machine", file=sys.stderr)
        return 2
    bandwidth = copy_bandwidth(int(args.copy_gib * 2 ** 30), warmup=5, iters=20)
    runs: list[tuple[str, dict | None]] = [(name, None) for name in args.backends]
    if args.sweep_splits and "mla_triton" in args.backends:
        runs += [("mla_triton", {"decode_num_splits": s}) for s in (1, 2, 4, 8, 16, 32, 64)]
    if args.sweep_geometry:
        runs += [("mla_decode", dict(zip(("head_tile", "block_n", "num_warps", "num_stages"),
                                         g, strict=True))) for g in GEOMETRIES]
    if args.sweep_head_tiles and "mla_triton" in args.backends:
        runs += [("mla_triton", {"decode_head_tile": t}) for t in (16, 32, 64)]
    results = []
    for model in args.models:
        for num_seqs in args.batch_sizes:
            for context in args.contexts:
                results += bench_shape(model, num_seqs, context, runs, bandwidth, args)
                print(f"done {model} {num_seqs}x{context}", file=sys.stderr, flush=True)
    device = torch.cuda.get_device_name()
    report = {"benchmark": "MLA decode attention", "device": device,
              "torch": torch.__version__, "python": platform.python_version(),
              "config": {k: v for k, v in vars(args).items() if k != "json"},
              "copy_bandwidth_bytes_per_s": bandwidth, "results": results}
    if args.json == "-":
        json.dump(report, sys.stdout, indent=2)
        return 0
    print_table(results, bandwidth, args, device)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

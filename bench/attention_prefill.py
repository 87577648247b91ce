"""Prefill attention alone: lmkit's Triton kernel against torch SDPA and FlashInfer.

The default batch is W1's prefill: Qwen3-0.6B's attention heads (16 query heads on 8
KV heads, head size 128, bf16) over fresh prompts of uniform random length in
[100, 1024] filling a 16384-token step; ``--preset llama8b`` takes Llama-3.1-8B's heads
(32/8), ``--lengths 4096:4096`` one long prompt, ``--context`` a cached prefix before
every prompt. Each contender is timed with CUDA events over the whole batch and
reported in causal TFLOP/s (``4 * head_size * num_heads`` per visible query-key pair):

* ``triton``: :func:`lmkit_kernels.paged_attention.paged_attention` on the paged cache
  (the default tiles, then ``--sweep-tiles`` alternatives);
* ``triton-backend`` / ``flashinfer-backend``: the attention backends' ``run()`` with
  the K/V already in the cache (``kv_written=True``), as the model calls them;
* ``sdpa``: torch's ``scaled_dot_product_attention`` (flash) per request on contiguous
  tensors with K/V already repeated for GQA -- a lower bound on what a dense,
  unpaged kernel costs, launches included.

Every contender's output is checked against SDPA's before it is timed::

    python bench/attention_prefill.py --out prefill.json
    python bench/attention_prefill.py --preset llama8b --sweep-tiles --out prefill8b.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch
import torch.nn.functional as F
from attention_decode import time_cuda
from lmkit.api import AttentionMetadata, PluginHost
from lmkit_kernels.cache_write import reshape_and_cache
from lmkit_kernels.checks import next_power_of_2
from lmkit_kernels.paged_attention import paged_attention, prefill_config
from lmkit_kernels.random_batch import make_paged_batch

PRESETS = {"qwen3-0.6b": (16, 8, 128), "llama8b": (32, 8, 128)}
SWEEP = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3),
         (128, 128, 8, 2), (64, 128, 4, 2), (128, 64, 4, 3)]


def prompt_lengths(args) -> list[int]:
    """Uniform random lengths in ``args.lengths`` until ``args.num_tokens`` are used."""
    low, high = (int(x) for x in args.lengths.split(":"))
    gen = torch.Generator().manual_seed(args.seed)
    lengths, total = [], 0
    while True:
        n = int(torch.randint(low, high + 1, (1,), generator=gen))
        if lengths and total + n > args.num_tokens:
            return lengths
        lengths.append(n)
        total += n


def causal_flops(lengths: list[int], context: int, num_heads: int, head_size: int) -> int:
    """Multiply-adds x 2 of QK^T and PV over each query's visible keys."""
    pairs = sum(n * context + n * (n + 1) // 2 for n in lengths)
    return 4 * num_heads * head_size * pairs


def metadata(batch) -> AttentionMetadata:
    return AttentionMetadata(**batch.metadata_kwargs())


def sdpa_reference(batch, lengths, context, group):
    """(callable, output): per-request flash SDPA over dense copies of q/k/v."""
    d = batch.q.shape[2]
    bs = batch.kv_cache.shape[2]
    starts = batch.query_start_loc_cpu.tolist()
    dense = []
    for r, n in enumerate(lengths):
        seq = context + n
        blocks = batch.block_tables[r, :-(-seq // bs)].long()
        k = batch.kv_cache[0, blocks].reshape(-1, batch.kv_cache.shape[3], d)[:seq]
        v = batch.kv_cache[1, blocks].reshape(-1, batch.kv_cache.shape[3], d)[:seq]
        q = batch.q[starts[r]:starts[r + 1]]
        dense.append((q.transpose(0, 1)[None].contiguous(),
                      k.repeat_interleave(group, 1).transpose(0, 1)[None].contiguous(),
                      v.repeat_interleave(group, 1).transpose(0, 1)[None].contiguous()))
    out = torch.empty_like(batch.q)

    def run():
        for (q, k, v), a, b in zip(dense, starts, starts[1:], strict=False):
            if context:  # bottom-right causal: query i sees keys <= context + i
                mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool,
                                  device=q.device).tril(context)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            else:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out[a:b] = o[0].transpose(0, 1)
        return out

    return run, run().clone()


def backend_runner(name, batch, args):
    """(callable, None) for an attention backend's run() with K/V already cached, or
    (None, reason) when it is not available here."""
    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    spec = host.registry.get("attention", name).spec
    reasons = spec.unavailable_reasons()
    if reasons:
        return None, "; ".join(reasons)
    backend = spec.load()(num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                          head_size=args.head_size, scale=args.head_size ** -0.5,
                          dtype=torch.bfloat16, device=torch.device("cuda"),
                          block_size=args.block_size)
    backend.plan(metadata(batch))
    return (lambda: backend.run(0, batch.q, batch.k, batch.v, batch.kv_cache,
                                kv_written=True)), None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-0.6b")
    parser.add_argument("--lengths", default="100:1024", help="prompt lengths, low:high")
    parser.add_argument("--num-tokens", type=int, default=16384, help="tokens in the step")
    parser.add_argument("--context", type=int, default=0, help="cached prefix per prompt")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--sweep-tiles", action="store_true",
                        help=f"also time the kernel with the tiles {SWEEP}")
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_prefill needs a CUDA device", file=sys.stderr)
        return 2
    args.num_heads, args.num_kv_heads, args.head_size = PRESETS[args.preset]
    group = args.num_heads // args.num_kv_heads
    lengths = prompt_lengths(args)
    batch = make_paged_batch([(args.context, n) for n in lengths], num_heads=args.num_heads,
                             num_kv_heads=args.num_kv_heads, head_size=args.head_size,
                             block_size=args.block_size, dtype=torch.bfloat16, device="cuda",
                             seed=args.seed)
    reshape_and_cache(batch.k, batch.v, batch.kv_cache, batch.slot_mapping)
    flops = causal_flops(lengths, args.context, args.num_heads, args.head_size)
    sdpa, expected = sdpa_reference(batch, lengths, args.context, group)
    attend = dict(max_query_len=batch.max_query_len, scale=args.head_size ** -0.5)
    kernel_args = (batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens,
                   batch.block_tables)
    default = prefill_config(max(16, next_power_of_2(args.head_size)), torch.bfloat16,
                             batch.q.device,
                             batch.max_query_len * next_power_of_2(group))
    runs = [("triton " + "x".join(map(str, default)), lambda: paged_attention(
        *kernel_args, **attend))]
    for tiles in SWEEP if args.sweep_tiles else []:
        runs.append(("triton " + "x".join(map(str, tiles)), lambda t=tiles: paged_attention(
            *kernel_args, **attend, prefill_tiles=t)))
    results = []
    for name in ("triton", "flashinfer"):
        fn, reason = backend_runner(name, batch, args)
        if fn is None:
            results.append({"name": f"{name}-backend", "skipped": reason})
        else:
            runs.append((f"{name}-backend", fn))
    runs.append(("sdpa (dense, per request)", sdpa))
    for name, fn in runs:
        try:
            err = (fn()[: batch.num_tokens].float() - expected.float()).abs().max().item()
            seconds = time_cuda(fn, warmup=args.warmup, iters=args.iters)
        except Exception as e:  # a tile config that does not fit: report, go on
            results.append({"name": name, "skipped": f"{type(e).__name__}: {e}"[:200]})
            continue
        results.append({"name": name, "ms": seconds * 1e3, "tflops": flops / seconds / 1e12,
                        "max_abs_err_vs_sdpa": err})

    device = torch.cuda.get_device_name()
    print(f"prefill attention: {len(lengths)} prompts, {sum(lengths)} tokens "
          f"(lengths {args.lengths}, cached prefix {args.context}), heads "
          f"{args.num_heads}/{args.num_kv_heads}x{args.head_size}, bf16, block "
          f"{args.block_size}, on {device}; {flops / 1e12:.3f} TFLOP per call")
    print(f"{'contender':<30}{'ms':>9}{'TFLOP/s':>9}{'max err':>9}")
    for row in results:
        if "skipped" in row:
            print(f"{row['name']:<30}  skipped: {row['skipped']}")
        else:
            print(f"{row['name']:<30}{row['ms']:>9.3f}{row['tflops']:>9.1f}"
                  f"{row['max_abs_err_vs_sdpa']:>9.4f}")
    report = {"benchmark": "prefill attention", "device": device,
              "torch": torch.__version__, "python": platform.python_version(),
              "config": {k: v for k, v in vars(args).items() if k != "out"},
              "num_prompts": len(lengths), "num_tokens": sum(lengths), "flops": flops,
              "results": results}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

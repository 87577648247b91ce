"""Benchmark: KV offload tier hits against recomputing long shared prefixes.

The device KV pool is sized to hold one long prefix (plus a little), so every new
prefix pushes the previous one out: to the offload tier when one is on, into oblivion
when not. Two sides run, each in its own process:

* ``recompute``: no offload; TTFT of a prompt whose long prefix is not cached;
* ``offload``: a tier (``cpu`` by default); TTFT of misses (fresh prefixes, stores
  included) and of tier hits (a prefix pushed out earlier, loaded back), checked as
  hits through the engine's ``offload_*`` stats. Then throughput of a batch of
  requests as the fraction of them whose prefix is in the tier rises.

TTFT is the wall time of one request with ``max_tokens=1``; the engine steps it took
are recorded too (a hit from host memory takes one step: its load and its suffix run
in the same step). The hit TTFT is also put against the copy floor: the prefix's KV
bytes over the host-to-device bandwidth measured in the same run (a page-locked copy
on CUDA, a memcpy on CPU).

    # CPU: SmolLM2-135M, 2k-token prefixes
    python bench/offload.py --out offload-cpu.json
    # H100: a random Llama-3.1-8B-shaped model built here, 8k-token prefixes
    python bench/offload.py --model llama-3.1-8b-random --out offload-h100.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from lmkit.benchmarking.measure import run_isolated

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=16384,
                initializer_range=0.02, tie_word_embeddings=False)


def build_random_llama(directory: Path) -> Path:
    """Write a random-weight Llama-3.1-8B-shaped model (bf16) and a byte tokenizer."""
    if (directory / ".complete").exists():
        return directory
    import torch
    from lmkit.testing.tiny_model import NUM_BYTE_TOKENS, make_byte_tokenizer
    from transformers import AutoModelForCausalLM, LlamaConfig

    directory.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**LLAMA_8B, eos_token_id=NUM_BYTE_TOKENS, bos_token_id=None)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    with torch.device(device):  # initialising 8B parameters is fast on the GPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to("cpu").save_pretrained(directory)
    del model
    make_byte_tokenizer().save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": NUM_BYTE_TOKENS}))
    (directory / ".complete").write_text("ok")
    print(f"built {directory} in {time.perf_counter() - t0:.0f} s", flush=True)
    return directory


def kv_bytes_per_token(model_dir: str, dtype_bytes: int) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head * dtype_bytes


def copy_bandwidth(num_bytes: int, cuda: bool) -> float:
    """Host-to-device bytes/s (page-locked source on CUDA; memcpy on CPU)."""
    import torch

    src = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(num_bytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
    best = float("inf")
    for _ in range(5):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return num_bytes / best


class Prompts:
    """Fresh random prefixes (bytes, so any tokenizer decodes them) with unique suffixes."""

    def __init__(self, prefix_len: int, suffix_len: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.prefix_len, self.suffix_len = prefix_len, suffix_len

    def prefix(self) -> list[int]:
        return [self.rng.randrange(256) for _ in range(self.prefix_len)]

    def prompt(self, prefix: list[int]) -> list[int]:
        return prefix + [self.rng.randrange(256) for _ in range(self.suffix_len)]


def ttft(llm: Any, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token of ``prompt`` alone, and its cached prompt tokens."""
    from lmkit import SamplingParams

    t0 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    return time.perf_counter() - t0, out[0].num_cached_tokens


def side(args: argparse.Namespace, offload: str) -> dict[str, Any]:
    """One engine: TTFT of misses (and of tier hits), then throughput vs hit rate."""
    from lmkit import LLM

    opts: dict[str, Any] = dict(dtype=args.dtype, block_size=args.block_size,
                                num_blocks=args.num_blocks, max_model_len=args.max_model_len,
                                max_num_batched_tokens=args.max_num_batched_tokens)
    if offload != "none":
        opts.update(offload=offload, **{"offload.options": {"size_gb": args.tier_gb},
                                        "offload.store_policy": args.store_policy})
    llm = LLM(args.model_path, **opts)
    prompts = Prompts(args.prefix_len, args.suffix_len, seed=1)
    result: dict[str, Any] = {"side": offload}
    try:
        for _ in range(2):  # warm-up: kernels, allocator, one eviction (and one tier hit)
            warm = prompts.prefix()
            ttft(llm, prompts.prompt(warm))
            ttft(llm, prompts.prompt(prompts.prefix()))
            ttft(llm, prompts.prompt(warm))
        misses, hits, hit_steps, previous = [], [], [], prompts.prefix()
        ttft(llm, prompts.prompt(previous))
        for _ in range(args.reps):
            fresh = prompts.prefix()
            misses.append(ttft(llm, prompts.prompt(fresh))[0])  # pushes `previous` out
            if offload != "none":
                before = llm.stats()
                seconds, cached = ttft(llm, prompts.prompt(previous))
                after = llm.stats()
                loaded = after["offload_loaded_blocks"] - before["offload_loaded_blocks"]
                assert cached >= args.prefix_len - args.block_size and loaded > 0, \
                    f"expected a tier hit: {cached} cached tokens, {loaded} blocks loaded"
                hits.append(seconds)
                hit_steps.append(after["num_steps"] - before["num_steps"])
            previous = fresh
        result.update(ttft_miss_s=misses, ttft_hit_s=hits, hit_steps=hit_steps)
        if offload != "none" and args.batch:
            result["throughput"] = [throughput(llm, prompts, args, rate) for rate in args.hit_rates]
        result["stats"] = {k: v for k, v in llm.stats().items() if k.startswith("offload_")}
    finally:
        llm.shutdown()
    return result


def throughput(llm: Any, prompts: Prompts, args: argparse.Namespace, hit_rate: float
               ) -> dict[str, Any]:
    """A batch where ``hit_rate`` of the requests' prefixes were pushed out to the tier."""
    from lmkit import SamplingParams

    num_hits = round(hit_rate * args.batch)
    warm = [prompts.prefix() for _ in range(num_hits)]
    for prefix in warm:
        ttft(llm, prompts.prompt(prefix))
    ttft(llm, prompts.prompt(prompts.prefix()))  # pushes the last warm prefix out too
    batch = [prompts.prompt(p) for p in warm]
    batch += [prompts.prompt(prompts.prefix()) for _ in range(args.batch - num_hits)]
    random.Random(7).shuffle(batch)
    before = llm.stats()["offload_hit_tokens"]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(batch, params)
    seconds = time.perf_counter() - t0
    hit_tokens = llm.stats()["offload_hit_tokens"] - before
    return {"hit_rate": hit_rate, "seconds": seconds, "requests_per_s": len(batch) / seconds,
            "output_tokens_per_s": len(batch) * args.output_len / seconds,
            "tier_hit_tokens": hit_tokens,
            "measured_hit_rate": hit_tokens / (len(batch) * args.prefix_len)}


def _build(directory: Path) -> dict[str, Any]:
    return {"path": str(build_random_llama(directory))}


def main(argv: list[str] | None = None) -> int:
    import torch

    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="model alias or path, or 'llama-3.1-8b-random' (built in --model-dir)")
    p.add_argument("--model-dir", default="/tmp/lmkit-bench/llama-3.1-8b-random")
    p.add_argument("--prefix-len", type=int, default=8192 if cuda else 2048)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=5 if cuda else 2)
    p.add_argument("--batch", type=int, default=8 if cuda else 4,
                   help="requests per throughput batch (0: skip)")
    p.add_argument("--hit-rates", type=lambda s: [float(x) for x in s.split(",")],
                   default=[0.0, 0.25, 0.5, 0.75, 1.0] if cuda else [0.0, 0.5, 1.0])
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--tier", default="cpu")
    p.add_argument("--store-policy", default="write_through", choices=("write_through", "on_evict"),
                   help="when blocks are stored to the tier")
    p.add_argument("--tier-gb", type=float, default=None, help="default: the batch + 3 prefixes")
    p.add_argument("--dtype", default="bfloat16" if cuda else "float32")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192 if cuda else 2048)
    p.add_argument("--no-baseline", action="store_true", help="skip the recompute side")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)

    if args.model == "llama-3.1-8b-random":  # built in a child: it leaves no GPU memory here
        args.model_path = run_isolated(_build, Path(args.model_dir))["path"]
    else:
        from lmkit.loading.cache import default_cache_dir
        from lmkit.loading.resolve import resolve_model
        from lmkit.plugin_host.manager import PluginHost

        args.model_path = str(resolve_model(args.model, PluginHost.load(), default_cache_dir()))
    dtype_bytes = 2 if args.dtype in ("bfloat16", "float16") else 4
    prefix_bytes = args.prefix_len * kv_bytes_per_token(args.model_path, dtype_bytes)
    args.tier_gb = args.tier_gb or (args.batch + 3) * prefix_bytes * 1.1 / 2**30
    args.max_model_len = args.prefix_len + args.suffix_len + args.output_len + args.block_size
    # the pool holds one prompt and a little more: a second prefix pushes the first out
    args.num_blocks = -(-args.max_model_len // args.block_size) + 8
    sides = [] if args.no_baseline else [run_isolated(side, args, "none")]
    sides.append(run_isolated(side, args, args.tier))
    bandwidth = copy_bandwidth(min(prefix_bytes, 2**30), cuda)
    report = summarize(args, sides, prefix_bytes, bandwidth, cuda)
    print(json.dumps(report["summary"], indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2, default=str))
    return 0


def summarize(args: argparse.Namespace, sides: list[dict[str, Any]], prefix_bytes: int,
              bandwidth: float, cuda: bool) -> dict[str, Any]:
    import torch

    tier = sides[-1]
    hit = statistics.median(tier["ttft_hit_s"])
    miss = statistics.median(tier["ttft_miss_s"])
    summary: dict[str, Any] = {
        "model": args.model, "prefix_tokens": args.prefix_len, "tier": args.tier,
        "prefix_kv_mib": prefix_bytes / 2**20,
        "ttft_tier_hit_ms": hit * 1e3, "ttft_miss_with_tier_ms": miss * 1e3,
        "ttft_tier_hit_min_ms": min(tier["ttft_hit_s"]) * 1e3,
        "engine_steps_per_hit": statistics.median(tier["hit_steps"]),
        "speedup_vs_miss_same_engine": miss / hit,
        "h2d_bandwidth_gb_s": bandwidth / 1e9,
        "copy_floor_ms": prefix_bytes / bandwidth * 1e3,
        "hit_ttft_over_copy_floor": hit / (prefix_bytes / bandwidth),
    }
    if len(sides) == 2:
        recompute = statistics.median(sides[0]["ttft_miss_s"])
        summary.update(ttft_recompute_ms=recompute * 1e3, speedup_vs_recompute=recompute / hit)
    for row in tier.get("throughput", []):
        summary[f"req_per_s_at_hit_rate_{row['hit_rate']:.2f}"] = row["requests_per_s"]
    machine = {"python": sys.version.split()[0], "torch": torch.__version__,
               "platform": platform.platform(),
               "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu"}
    return {"summary": summary, "sides": sides, "machine": machine,
            "args": {k: v for k, v in vars(args).items() if k != "out"}}


if __name__ == "__main__":
    sys.exit(main())

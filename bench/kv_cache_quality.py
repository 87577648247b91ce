"""What an FP8 KV cache costs in quality: the same model and weights with
``kv_cache_dtype`` ``auto`` (the model's dtype) and ``fp8`` (float8 e4m3, scales 1.0).

Reports the greedy agreement of N prompts x T tokens (tokens before the first
divergence, positionwise agreement) and the perplexity of a held text (teacher forcing:
prompt log-probabilities, so every layer's attention reads the quantized cache) on both
caches, and the relative change. Defaults: the default model (SmolLM2-135M-Instruct)
with its weights dequantized (``--quantization none``), on the CPU in float32::

    python bench/kv_cache_quality.py --out kv_quality.json
    python bench/kv_cache_quality.py --kv-cache-scales none --out kv_quality_unit.json
    python bench/kv_cache_quality.py --device cuda --dtype bfloat16 --attention triton \\
        --text bench/data/held_text_long.txt --out kv_quality_gpu.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cpu_quant_quality import HELD_TEXT, PROMPT_STEMS, agreement, run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model directory, GGUF file or alias "
                    "(default: the default model)")
    ap.add_argument("--quantization", default="none", help="the weights' method (both runs)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--kv-cache-scales", default="auto", choices=("auto", "calibrate", "none"),
                    help="the FP8 run's cache.kv_cache_scales (auto: the checkpoint's, else "
                    "measured at load; none: 1.0)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--text", type=Path, default=None,
                    help="score this text file instead of the built-in paragraph")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.tokens < 1:
        ap.error("--prompts and --tokens must be at least 1")
    held = HELD_TEXT
    if args.text is not None:
        try:
            held = args.text.read_text(encoding="utf-8").strip()
        except OSError as e:
            ap.error(f"--text {args.text}: {e.strerror}")
        if not held:
            ap.error(f"--text {args.text} is empty")
    prompts = (PROMPT_STEMS * (args.prompts // len(PROMPT_STEMS) + 1))[:args.prompts]
    engine = dict(device=args.device, dtype=args.dtype, attention=args.attention,
                  **({"model": args.model} if args.model else {}))
    scales = {"cache.kv_cache_scales": args.kv_cache_scales}
    runs = {kv: run(args.quantization, prompts, args.tokens, held, kv_cache_dtype=kv,
                    **engine, **(scales if kv == "fp8" else {}))
            for kv in ("auto", "fp8")}
    base, fp8 = runs["auto"], runs["fp8"]
    report = {"model": args.model or "default", "quantization": args.quantization,
              "device": args.device, "dtype": args.dtype, "attention": args.attention,
              "kv_cache_scales": args.kv_cache_scales,
              "prompts": args.prompts, "tokens": args.tokens,
              "text": str(args.text) if args.text else "built-in",
              "greedy": agreement(fp8["tokens"], base["tokens"]),
              "perplexity": {"auto": base["perplexity"], "fp8": fp8["perplexity"],
                             "relative": fp8["perplexity"] / base["perplexity"] - 1,
                             "scored_tokens": base["scored_tokens"]}}
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

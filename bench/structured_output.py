"""Structured output (JSON schemas through the ``xgrammar`` backend) against free decoding,
side by side on the same engine and the same workload.

One engine serves both sides, so they see the same machine and the same load. A first
constrained pass (untimed: it compiles the grammars, whose cold compile times are
reported) fixes each request's output length; then, for ``--rounds`` rounds, the two
sides alternate:

* ``constrained``: every request carries a JSON schema (greedy);
* ``free``: the same prompts without a schema, greedy, EOS ignored, each request
  generating exactly as many tokens as its constrained twin did.

So both sides produce the same number of tokens in the same batches, and the
difference is the cost of constraining: filling the bitmask rows, applying them to the
logits, advancing the grammars. Reported: output tokens/s of both sides (best round)
and their ratio (and the median ratio of back-to-back rounds, less sensitive to load on a
shared machine); then, from one instrumented constrained pass, the per-token mask cost
(fill + apply + advance, per constrained token: p50 and p99 over steps), its parts, and
the share of that pass's time spent on masks.
Every constrained output is checked against its schema (``jsonschema``)::

    python bench/structured_output.py --device cpu --dtype float32 --threads 2
    python bench/structured_output.py --device cuda --dtype bfloat16 --num-prompts 256
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

S = {"type": "string", "minLength": 1, "maxLength": 12}


def obj(props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


SCHEMAS = {
    "person": obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "book": obj({"title": S, "year": {"type": "integer", "minimum": 1500, "maximum": 2025},
                 "genre": {"enum": ["fiction", "science", "history", "poetry"]}}),
    "address": obj({"name": S, "address": obj({"street": S, "zip": {
        "type": "string", "pattern": "^[0-9]{5}$"}})}),
    "tags": obj({"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}}),
    "order": obj({"items": {"type": "array", "minItems": 1, "maxItems": 2, "items": obj(
        {"name": S, "qty": {"type": "integer", "minimum": 1, "maximum": 9}})}}),
    "weather": obj({"sky": {"enum": ["sunny", "cloudy", "rainy"]},
                    "wind_kmh": {"type": "integer", "minimum": 0, "maximum": 200},
                    "celsius": {"type": "number", "minimum": -50, "maximum": 60}}),
    "event": obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
                  "title": S, "online": {"type": "boolean"}}),
    "matrix": obj({"rows": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer"}}}}),
}


class MaskTimer:
    """Wraps the engine's fill / advance and the runner's bitmask application (row
    reordering, host-to-device copy, kernel) with timers (uniproc executor)."""

    def __init__(self, llm: Any, cuda: bool) -> None:
        from lmkit.structured.manager import StructuredOutputManager

        (self.manager,) = [p for p in llm.engine.phases.phases
                           if isinstance(p, StructuredOutputManager)]
        self.cuda = cuda
        self.steps: list[dict[str, float]] = []
        import lmkit.worker.model_runner as model_runner

        self.model_runner = model_runner
        self._orig = (self.manager.fill_bitmask, self.manager.advance,
                      model_runner.apply_grammar_bitmask)

    def _sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def install(self) -> None:
        fill, advance, apply = self._orig

        def timed_fill(so: Any) -> None:
            t0 = time.perf_counter()
            fill(so)
            rows = 0 if so.grammar_bitmask is None else int(so.grammar_bitmask.shape[0])
            self.steps.append({"fill_s": time.perf_counter() - t0, "rows": rows,
                               "apply_s": 0.0, "advance_s": 0.0})

        def timed_apply(*args: Any) -> None:  # rows to the sampler's order, copy, kernel
            self._sync()
            t0 = time.perf_counter()
            apply(*args)
            self._sync()
            self.steps[-1]["apply_s"] += time.perf_counter() - t0

        def timed_advance(outputs: Any) -> None:
            t0 = time.perf_counter()
            advance(outputs)
            self.steps[-1]["advance_s"] += time.perf_counter() - t0

        self.manager.fill_bitmask, self.manager.advance = timed_fill, timed_advance
        self.model_runner.apply_grammar_bitmask = timed_apply

    def uninstall(self) -> None:
        fill, advance, apply = self._orig
        self.manager.fill_bitmask, self.manager.advance = fill, advance
        self.model_runner.apply_grammar_bitmask = apply

    def summary(self) -> dict[str, float]:
        """Per constrained token (one bitmask row): p50 / p99 over steps, microseconds."""
        steps = [s for s in self.steps if s["rows"]]

        def pct(values: list[float], q: float) -> float:
            values = sorted(values)
            return values[min(len(values) - 1, int(q * len(values)))] * 1e6

        out: dict[str, float] = {"num_steps": len(steps)}
        for part in ("fill", "apply", "advance", "total"):
            per = [(s["fill_s"] + s["apply_s"] + s["advance_s"] if part == "total"
                    else s[f"{part}_s"]) / s["rows"] for s in steps]
            out[f"{part}_us_per_token_p50"] = pct(per, 0.5)
            out[f"{part}_us_per_token_p99"] = pct(per, 0.99)
        return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import jsonschema
    import torch
    from lmkit import LLM, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.num_prompts,
              max_model_len=args.max_model_len)
    names = [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(args.num_prompts)]
    convs = [[{"role": "user", "content": f"Reply with a JSON object describing a {n} "
                                          f"(example {i})."}] for i, n in enumerate(names)]

    def constrained() -> list[Any]:
        return [SamplingParams(temperature=0, max_tokens=args.max_tokens,
                               structured_outputs={"json": SCHEMAS[n]}) for n in names]

    t0 = time.perf_counter()
    first = llm.chat(convs, constrained())
    cold_s = time.perf_counter() - t0
    lengths = [len(o.outputs[0].token_ids) for o in first]
    invalid = 0
    for name, out in zip(names, first, strict=True):
        try:
            jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS[name])
        except (ValueError, jsonschema.ValidationError):
            invalid += 1
    free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    sides: dict[str, list[float]] = {"constrained": [], "free": []}
    for _ in range(args.rounds):
        for side in ("free", "constrained"):
            t0 = time.perf_counter()
            outs = llm.chat(convs, constrained() if side == "constrained" else free)
            elapsed = time.perf_counter() - t0
            produced = sum(len(o.outputs[0].token_ids) for o in outs)
            sides[side].append(produced / elapsed)
    timer = MaskTimer(llm, cuda=args.device == "cuda")
    timer.install()
    t0 = time.perf_counter()
    llm.chat(convs, constrained())
    instrumented_s = time.perf_counter() - t0
    timer.uninstall()
    mask_s = sum(st["fill_s"] + st["apply_s"] + st["advance_s"] for st in timer.steps)
    stats = llm.stats()
    llm.shutdown()
    best = {k: max(v) for k, v in sides.items()}
    return {
        "device": args.device, "dtype": args.dtype, "threads": args.threads,
        "machine": platform.processor() or platform.machine(),
        "num_prompts": args.num_prompts, "output_tokens": sum(lengths),
        "mean_output_len": statistics.mean(lengths), "invalid_outputs": invalid,
        "cold_first_pass_s": cold_s,
        "free_tokens_per_s": best["free"], "constrained_tokens_per_s": best["constrained"],
        "constrained_over_free": best["constrained"] / best["free"],
        # each round's two sides ran back to back: their ratio is the least load-sensitive
        "median_round_ratio": statistics.median(
            c / f for c, f in zip(sides["constrained"], sides["free"], strict=True)),
        # share of a constrained pass spent on masks (same run, so load cancels out)
        "mask_share_of_time": mask_s / instrumented_s,
        "rounds": sides, "mask_cost": timer.summary(),
        "grammar_cache": {k: v for k, v in stats.items() if k.startswith("grammar_cache")},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--num-prompts", type=int, default=32, help="requests, all in one batch")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    result = run(args)
    m = result["mask_cost"]
    print(f"{args.device} {args.dtype}, {args.num_prompts} requests, "
          f"{result['output_tokens']} output tokens (mean {result['mean_output_len']:.1f}), "
          f"invalid outputs: {result['invalid_outputs']}")
    print(f"  free        {result['free_tokens_per_s']:9.1f} tok/s")
    print(f"  constrained {result['constrained_tokens_per_s']:9.1f} tok/s   "
          f"ratio {result['constrained_over_free']:.3f} (best rounds), "
          f"{result['median_round_ratio']:.3f} (median of paired rounds)")
    print(f"  masks take {100 * result['mask_share_of_time']:.1f}% of a constrained pass")
    print(f"  mask cost per constrained token: p50 {m['total_us_per_token_p50']:.1f} us, "
          f"p99 {m['total_us_per_token_p99']:.1f} us  (fill p50 "
          f"{m['fill_us_per_token_p50']:.1f}, apply p50 {m['apply_us_per_token_p50']:.1f}, "
          f"advance p50 {m['advance_us_per_token_p50']:.1f})")
    print(f"  cold first pass (compiles {len(SCHEMAS)} schemas): "
          f"{result['cold_first_pass_s']:.2f} s")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    if result["invalid_outputs"]:
        sys.exit(1)


if __name__ == "__main__":
    main()

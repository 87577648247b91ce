"""Chained draft passes on and off (``LMKIT_DRAFT_CHAIN``; ``--switch`` names another
of the engine's on/off switches: an environment variable such as ``LMKIT_SPEC_LOOKAHEAD``,
or a boolean setting such as ``speculative.catch_up_when_off``), in one process, on a random
SmolLM2-135M-shaped target with a random EAGLE-3 head (its drafts are almost never
accepted, so every speculative step has the same shape: this measures what a step
costs, not what it gains). Engines for plain decoding and for each ``k`` with the
``k - 1`` draft passes replayed as one chained CUDA graph or one graph per pass run the
same greedy requests in interleaved rounds; medians of ms per output token::

    python bench/draft_chain.py --ks 3 5 --batches 1 8 --rounds 3
    python bench/draft_chain.py --switch LMKIT_SPEC_LOOKAHEAD --ks 3 --batches 1 8 32
    python bench/draft_chain.py --switch speculative.catch_up_when_off \
        --set speculative.disable_by_batch_size=16 --ks 3 --batches 1 8 32
    python bench/draft_chain.py --switch LMKIT_DECODE_MID_SPLITS=1/0 --ks 3 --batches 1

(``NAME=ON/OFF``: an environment variable's two values; the plain engine gets neither.)

Needs CUDA and triton attention (the chain needs a backend that keeps a captured
decode plan valid as positions move: ``supports_in_place_decode_metadata``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", type=int, nargs="+", default=[3, 5], help="draft tokens per step")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--attention", default="triton")
    ap.add_argument("--switch", default="LMKIT_DRAFT_CHAIN",
                    help="compared on and off for each k: an environment variable (1 / 0, "
                    "or NAME=ON/OFF for two other values; read when each engine starts) or "
                    "a boolean setting's dotted path")
    ap.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                    help="a setting of every speculating engine (value read as JSON)")
    args = ap.parse_args()
    from gpu_args import parse_sets

    settings = parse_sets(";".join(args.set), "--set")

    from lmkit import LLM, SamplingParams
    from spec_pair import random_prompts, synthetic_pair

    target, head = synthetic_pair(Path(tempfile.mkdtemp(prefix="draft-chain-")))
    batch = max(args.batches)
    prompts = random_prompts(batch)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    sides: dict[str, dict] = {"plain": {}}
    labels = (("chained", "per-pass") if args.switch == "LMKIT_DRAFT_CHAIN" else ("on", "off"))
    switch, _, values = args.switch.partition("=")
    on_off = tuple(values.split("/", 1)) if values else ("1", "0")
    if len(on_off) != 2 or not all(on_off):
        raise SystemExit(f"--switch {args.switch!r}: expected NAME or NAME=ON/OFF")
    for k in args.ks:
        for value, label in zip(on_off, labels, strict=True):
            sides[f"k{k}-{label}"] = {"k": k, "value": value}
    engines = {}
    for name, side in sides.items():
        kw: dict = {}
        if side:
            kw = dict(speculative="eagle3", speculative_model=str(head),
                      num_speculative_tokens=side["k"], **settings)
            if "." in switch:  # a setting
                kw[switch] = side["value"] == "1"
            else:
                os.environ[switch] = side["value"]  # read when the engine starts
        engines[name] = LLM(str(target), device="cuda", attention=args.attention,
                            dtype="bfloat16", max_num_seqs=batch, max_model_len=2048,
                            gpu_memory_utilization=0.8 / len(sides), **kw)
        engines[name].generate(prompts[:2], params)  # warm-up
    times: dict[tuple[str, int], list[float]] = {(n, b): [] for n in sides for b in args.batches}
    for r in range(args.rounds):
        for b in args.batches:
            for name in (list(sides) if r % 2 else list(reversed(list(sides)))):
                start = time.perf_counter()
                if b == 1:  # one request at a time
                    for prompt in prompts[:4]:
                        engines[name].generate([prompt], params)
                    tokens = 4 * args.output_len
                else:
                    engines[name].generate(prompts[:b], params)
                    tokens = b * args.output_len
                times[(name, b)].append((time.perf_counter() - start) / tokens * 1e3)
    for b in args.batches:
        plain = statistics.median(times[("plain", b)])
        for name in sides:
            ms = statistics.median(times[(name, b)])
            rounds = ", ".join(f"{t:.3f}" for t in times[(name, b)])
            print(f"batch {b:3d}  {name:14s} {ms:7.3f} ms/token  x plain {plain / ms:5.2f}  "
                  f"(rounds {rounds})", flush=True)
    for llm in engines.values():  # (closes their step traces, LMKIT_STEP_TRACE)
        llm.shutdown()


if __name__ == "__main__":
    main()

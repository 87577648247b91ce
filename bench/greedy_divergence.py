"""Where greedy outputs with speculative decoding first differ from those without, and
how close the two tokens were there.

Greedy speculative decoding is lossless in exact arithmetic: the target verifies each
draft with its own argmax. In floating point, a verification step (``1 + k`` tokens per
request) and a decode step (one token) run different GEMM and attention kernels, whose
sums round differently, so a position where the target's two best tokens are nearly
tied can flip. This tool tells such a flip from a bug: it runs the prompts without
speculation, then with it (for each ``--max-num-seqs``), and for each prompt whose
tokens differ, asks the plain engine for the logprobs at the first differing position
(prompt + the common prefix, one greedy token). A flip shows a gap between the two
tokens' logprobs at the scale of the dtype's rounding (float32: about 1e-6 to 1e-4 in
logprob), a bug a gap of whole units::

    python bench/greedy_divergence.py --model smollm2.gguf --device cuda \\
        --dtype float32 --attention triton --spec ngram --max-num-seqs 1 64 --out d.json

The prompts are ``tests/gpu/test_spec_decode_gpu.py``'s: the copy passages of
:func:`lmkit.benchmarking.workload.copy_passages` as "repeat this" chats, and two
open questions.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

NUM_LOGPROBS = 20


def chat_prompts(llm: Any) -> list[list[int]]:
    """The GPU parity test's prompts, tokenized through ``llm``'s chat template."""
    from lmkit.benchmarking.workload import copy_passages

    def chat(text: str) -> list[int]:
        ids: list[int] = llm.input_processor.tokenize(None, [{"role": "user",
                                                               "content": text}])[1]
        return ids

    return [chat(f"Repeat the following text exactly:\n\n{p}") for p in copy_passages()] + [
        chat("Why is the sky blue?"), chat("Write a haiku about the ocean.")]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (a length counts), or ``None``."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def gap_at(llm: Any, context: list[int], want: int, got: int) -> dict[str, Any]:
    """The plain engine's view of the position after ``context``: its greedy token, the
    logprobs of ``want`` (the plain run's token) and ``got`` (the speculative run's),
    and the gap between its two best tokens."""
    from lmkit import SamplingParams

    (out,) = llm.generate([context], SamplingParams(temperature=0.0, max_tokens=1,
                                                    logprobs=NUM_LOGPROBS))
    lp = out.outputs[0].logprobs[0]
    top = dict(lp.iter_top())
    top.setdefault(lp.token_id, lp.logprob)
    best = sorted(top.values(), reverse=True)
    return {"greedy": lp.token_id, "want": want, "got": got,
            "logprob_want": top.get(want), "logprob_got": top.get(got),
            "gap_want_got": (None if want not in top or got not in top
                             else top[want] - top[got]),
            "top2_gap": best[0] - best[1] if len(best) > 1 else None}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every prompt's first difference for each ``--max-num-seqs``; see the docstring."""
    from lmkit import SamplingParams
    from lmkit.frontend.llm import LLM

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    common: dict[str, Any] = dict(device=args.device, dtype=args.dtype)
    if args.attention:
        common["attention"] = args.attention
    with LLM(args.model, **common) as llm:
        prompts = chat_prompts(llm)[:args.count]
        base = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    spec: dict[str, Any] = dict(speculative=args.spec,
                                num_speculative_tokens=args.num_spec_tokens)
    if args.spec_model:
        spec["speculative_model"] = args.spec_model
    runs: dict[int, list[list[int]]] = {}
    for seqs in args.max_num_seqs:
        with LLM(args.model, max_num_seqs=seqs, **spec, **common) as llm:
            runs[seqs] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    report: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "out"},
                              "num_prompts": len(prompts), "runs": []}
    with LLM(args.model, **common) as llm:
        for seqs, got in runs.items():
            diffs = []
            for i, (want_ids, got_ids) in enumerate(zip(base, got, strict=True)):
                at = first_difference(want_ids, got_ids)
                if at is None or at >= min(len(want_ids), len(got_ids)):
                    if at is not None:
                        diffs.append({"prompt": i, "position": at, "lengths_differ": True})
                    continue
                diffs.append({"prompt": i, "position": at, **gap_at(
                    llm, prompts[i] + want_ids[:at], want_ids[at], got_ids[at])})
            report["runs"].append({"max_num_seqs": seqs, "identical": not diffs,
                                   "differences": diffs})
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="GGUF file or model directory")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--attention", default=None, help="attention backend (default: auto)")
    ap.add_argument("--spec", default="ngram", help="speculative proposer")
    ap.add_argument("--spec-model", default=None, help="draft head (eagle, eagle3)")
    ap.add_argument("--num-spec-tokens", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--count", type=int, default=None, help="first N prompts only")
    ap.add_argument("--out", type=Path, default=None, help="write the report as JSON")
    args = ap.parse_args(argv)
    report = run(args)
    for r in report["runs"]:
        print(f"max_num_seqs {r['max_num_seqs']}: "
              + ("identical" if r["identical"] else f"{len(r['differences'])} differ"))
        for d in r["differences"]:
            print("  " + json.dumps(d))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()

"""What drafting from the context (ngram, prompt lookup) beside an EAGLE-3 head would
accept, before one is built: per served step, the head's chain of ``k`` drafts, the
ngram proposer's ``k`` drafts, or a hybrid that takes ngram's where its lookup matches
and the head's elsewhere, and the oracle (the better of the two each step: a bound for
any rule choosing between them).

The head's acceptance comes from :mod:`eagle_tree_sim` (the true token's rank at each
draft position, the head fed what it drafts); ngram's is its drafts
(:func:`lmkit_plugins.spec.ngram.find_drafts`, suffixes of ``--min-n`` to ``--max-n``
tokens) against the target's greedy answer. Each step accepts the drafts up to the
first wrong one plus the target's own token, and the next starts after them::

    python bench/spec_hybrid_sim.py --model smol.gguf --speculative-model HEAD \\
        [--prompts bench|FILE.jsonl] [--count 40] [--k 3] [--out sim.json]

Session 29 (CPU, float32, session 25's head, the 40 chat prompts of ``lmkit bench``):
the chain of 3 alone 1.836 tokens per step; the hybrid 1.747 (suffixes of 1-4 tokens:
ngram matches at 43% of the steps and its drafts are worse), 1.908 (2-4) and 1.896
(3-4); the oracle 1.983 at best. Drafting from the context adds at most 8% here.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from lmkit_plugins.spec.tree_fit import answer_data

POLICIES = ("eagle", "ngram", "hybrid", "oracle")


def leading_zeros(ranks: Sequence[int]) -> int:
    """Drafts accepted from a row of true ranks: the head's argmax until the first miss."""
    n = 0
    for r in ranks:
        if r != 0:
            break
        n += 1
    return n


def ngram_accepted(sequence: Sequence[int], known: int, k: int, min_n: int, max_n: int
                   ) -> tuple[int, bool]:
    """(drafts of ngram accepted, whether its lookup matched) at a step that knows
    ``sequence[:known]`` and must produce ``sequence[known:]``."""
    from lmkit_plugins.spec.ngram import find_drafts

    hist = np.asarray(sequence[:known], dtype=np.int64)[None]
    drafts, counts = find_drafts(hist, np.array([known]), k, min_n, max_n)
    truth = sequence[known:known + k]
    accepted = 0
    for j in range(int(counts[0])):
        if j >= len(truth) or int(drafts[0, j]) != truth[j]:
            break
        accepted += 1
    return accepted, bool(counts[0])


def served(paths: Sequence[Sequence[Sequence[int]]], sequences: Sequence[Sequence[int]],
           firsts: Sequence[int], policy: str, k: int, min_n: int, max_n: int
           ) -> dict[str, float]:
    """Tokens per step and the share of steps where ngram's lookup matched, for one of
    :data:`POLICIES`, walking every answer as serving would."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}: choose from {', '.join(POLICIES)}")
    tokens = steps = matched = 0
    for rows, seq, first in zip(paths, sequences, firsts, strict=True):
        s = 0
        while s < len(rows):
            head = leading_zeros(rows[s][:k])
            ngram, hit = ngram_accepted(seq, first + s + 2, k, min_n, max_n)
            accepted = {"eagle": head, "ngram": ngram, "oracle": max(head, ngram),
                        "hybrid": ngram if hit else head}[policy]
            matched += hit
            tokens += accepted + 1
            steps += 1
            s += accepted + 1
    return {"tokens_per_step": tokens / steps if steps else float("nan"),
            "ngram_matched": matched / steps if steps else float("nan")}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the target (GGUF file or directory)")
    ap.add_argument("--speculative-model", required=True, type=Path, help="the EAGLE-3 head")
    ap.add_argument("--prompts", default="bench", help="bench, or a JSONL prompt file")
    ap.add_argument("--count", type=int, default=40, help="prompts answered (at most)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3, help="drafts per step")
    ap.add_argument("--ngram-sizes", default="1-4,2-4,3-4",
                    help="suffix lengths min-max the ngram lookup tries, comma-separated")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    try:
        sizes = [tuple(int(x) for x in part.split("-")) for part in args.ngram_sizes.split(",")]
        if any(len(t) != 2 or not 1 <= t[0] <= t[1] for t in sizes):
            raise ValueError
    except ValueError:
        ap.error(f"--ngram-sizes {args.ngram_sizes!r}: give MIN-MAX pairs with "
                 "1 <= MIN <= MAX, e.g. 1-4,2-4")
    for name in ("count", "k", "max_new_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    from lmkit_plugins.spec.train_eagle import load_eval_prompts

    prompts = load_eval_prompts(args.prompts)[:args.count]
    paths, seqs, firsts = answer_data(args.model, args.speculative_model, prompts,
                                      args.max_new_tokens, args.k, args.device)
    rows = [p.tolist() for p in paths]
    report: dict[str, Any] = {"model": args.model, "head": str(args.speculative_model),
                              "k": args.k, "answers": len(rows), "runs": []}
    chain = served(rows, seqs, firsts, "eagle", args.k, 1, 1)
    report["runs"].append({"policy": "eagle", **chain})
    print(f"eagle chain of {args.k}: {chain['tokens_per_step']:.3f} tokens/step")
    for lo, hi in sizes:
        for policy in ("ngram", "hybrid", "oracle"):
            r = served(rows, seqs, firsts, policy, args.k, lo, hi)
            report["runs"].append({"policy": policy, "ngram_sizes": [lo, hi], **r})
            print(f"{policy:6s} suffixes {lo}-{hi}: {r['tokens_per_step']:.3f} tokens/step "
                  f"(ngram matched {r['ngram_matched']:.0%} of steps)")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()

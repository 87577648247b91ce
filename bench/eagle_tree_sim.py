"""What static draft trees would accept with an EAGLE-3 head, before one is built.

A chain of ``k`` drafts is accepted up to its first wrong draft. A *tree* verifies
several candidates per position: its nodes are *rank paths*, ``(r1, r2, ...)`` meaning
"the head's ``r1``-th most likely token, then, fed that token, its ``r2``-th most likely
one, ...", and a step accepts the longest prefix of the true rank path that is a node.
A chain of ``k`` is the tree ``{(0,), (0, 0), ..., (0,) * k}``.

For every position of the target's greedy answers this script takes the true token's
rank in the head's draft-vocabulary logits at each depth, the head fed the true tokens
and its own outputs (``TrainableEagle3.unrolled``, as drafting runs it; tokens outside
the draft vocabulary are never accepted). Trees of ``N`` nodes are built from half of
the answers (the ``N`` most frequent true rank prefixes: the best static tree of ``N``
nodes for that half) and scored on the other half by the served walk (each step starts
where the last one stopped, as :func:`lmkit_plugins.spec.eagle_eval.served_walk`
counts), beside chains of 1 to ``--depth`` drafts::

    python bench/eagle_tree_sim.py --model smol.gguf --speculative-model HEAD \\
        [--prompts bench|FILE.jsonl] [--count 40] [--nodes 4,8,16,32,64] [--out sim.json]

(``--prompts bench``: the chat prompts of ``lmkit bench``, the default.) It measures
the head, not the engine: what a tree costs per step (``N`` verified rows per request,
the tree's attention mask, the accepted path's KV moved into place) is not modelled.
CPU or CUDA (``--device``), float32 on the CPU.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lmkit_plugins.spec.tree_fit import (
    answer_paths,
    best_tree,
    chain,
    prefix_counts,
    served_tokens,
)


def coverage(paths: Sequence[torch.Tensor], ranks: Sequence[int]) -> dict[str, float]:
    """The fraction of rows whose first draft's true rank is below each of ``ranks``."""
    first = torch.cat([p[:, 0] for p in paths]) if paths else torch.zeros(0)
    return {f"top{r}": float((first < r).float().mean()) if first.numel() else float("nan")
            for r in ranks}


def simulate(paths: Sequence[torch.Tensor], nodes: Sequence[int], depth: int, max_rank: int,
             seed: int = 0) -> dict[str, Any]:
    """Split ``paths`` (one ``[m, depth]`` per answer) in two halves (seeded), build the
    trees on the first and score chains and trees on both."""
    order = list(range(len(paths)))
    random.Random(seed).shuffle(order)
    fit, held = [paths[i] for i in order[::2]], [paths[i] for i in order[1::2]]
    counts = prefix_counts(fit, max_rank)
    rows: list[dict[str, Any]] = []
    for k in range(1, depth + 1):
        rows.append({"kind": "chain", "nodes": k, "depth": k,
                     "held": served_tokens(held, chain(k))["tokens_per_step"],
                     "fit": served_tokens(fit, chain(k))["tokens_per_step"]})
    for n in nodes:
        tree = best_tree(counts, n)
        rows.append({"kind": "tree", "nodes": len(tree),
                     "depth": max((len(p) for p in tree), default=0),
                     "held": served_tokens(held, tree)["tokens_per_step"],
                     "fit": served_tokens(fit, tree)["tokens_per_step"],
                     "top_nodes": [list(p) for p in sorted(tree, key=lambda p: -counts[p])][:12],
                     # the whole tree, for speculative.tree (--spec-tree) when it fits
                     "tree": [list(p) for p in sorted(tree, key=lambda p: (len(p), p))]})
    return {"answers": len(paths), "held_rows": sum(p.shape[0] for p in held),
            "first_draft": coverage(held, (1, 2, 3, 5)), "rows": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the target (GGUF file or directory)")
    ap.add_argument("--speculative-model", required=True, type=Path, help="the EAGLE-3 head")
    ap.add_argument("--prompts", default="bench", help="bench, or a JSONL prompt file")
    ap.add_argument("--count", type=int, default=40, help="prompts answered (at most)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=6, help="deepest draft simulated")
    ap.add_argument("--max-rank", type=int, default=8, help="ranks a tree node may hold")
    ap.add_argument("--nodes", default="4,8,16,32,64", help="tree sizes, comma-separated")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    try:
        nodes = [int(x) for x in args.nodes.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--nodes {args.nodes!r}: give comma-separated integers, e.g. 4,8,16")
    for name, value in (("--count", args.count), ("--depth", args.depth),
                        ("--max-rank", args.max_rank), *(("--nodes", n) for n in nodes)):
        if value < 1:
            ap.error(f"{name} must be at least 1, got {value}")
    from lmkit_plugins.spec.train_eagle import load_eval_prompts

    prompts = load_eval_prompts(args.prompts)[:args.count]
    start = time.perf_counter()
    paths = answer_paths(args.model, args.speculative_model, prompts, args.max_new_tokens,
                         args.depth, args.device)
    report = {"model": args.model, "head": str(args.speculative_model), "prompts": args.prompts,
              "seconds": time.perf_counter() - start,
              **simulate(paths, nodes, args.depth, args.max_rank, args.seed)}
    cov = report["first_draft"]
    print(f"{report['answers']} answers ({report['held_rows']} scored rows); first draft "
          f"in the head's top 1/2/3/5: " + " / ".join(f"{v:.3f}" for v in cov.values()))
    for row in report["rows"]:
        print(f"  {row['kind']:5s} {row['nodes']:3d} nodes (depth {row['depth']}): "
              f"{row['held']:.3f} tokens/step (fit half {row['fit']:.3f})")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()

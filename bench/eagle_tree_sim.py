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
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

#: the rank recorded where the true token cannot be drafted (outside the draft
#: vocabulary, or past the answer's end): above every rank a tree can hold
MISS = 1 << 20

RankPath = tuple[int, ...]


def rank_paths(steps: Sequence[torch.Tensor], truth: torch.Tensor) -> torch.Tensor:
    """``[m, depth]`` int64: row ``s``, column ``j`` is the rank of the true token in the
    logits of draft ``j`` of the chain after row ``s`` (0: the head's argmax; ties with
    a lower id count as above, as ``argmax`` takes the first), :data:`MISS` where it
    cannot be drafted. ``steps``: ``head.unrolled``'s logits, step ``j`` covering rows
    ``j .. m - 1`` (``[m - j, draft vocab]``); ``truth [m]``: the draft id of the token
    each row must predict, ``-1`` outside the draft vocabulary."""
    m = truth.shape[0]
    out = torch.full((m, len(steps)), MISS, dtype=torch.int64, device=truth.device)
    for j, logits in enumerate(steps):
        want = truth[j:]
        n = min(logits.shape[0], want.shape[0])
        lg, w = logits[:n].float(), want[:n]
        at = lg.gather(1, w.clamp(min=0)[:, None])
        ids = torch.arange(lg.shape[1], device=lg.device)
        above = (lg > at) | ((lg == at) & (ids[None, :] < w.clamp(min=0)[:, None]))
        out[:n, j] = torch.where(w >= 0, above.sum(1), torch.full_like(w, MISS))
    return out


def prefix_counts(paths: Iterable[torch.Tensor], max_rank: int) -> Counter[RankPath]:
    """How often each rank prefix of ranks below ``max_rank`` is the start of a true
    rank path, over every row of ``paths`` (each ``[m, depth]``)."""
    counts: Counter[RankPath] = Counter()
    for rows in paths:
        for row in rows.tolist():
            prefix: RankPath = ()
            for r in row:
                if r >= max_rank:
                    break
                prefix += (r,)
                counts[prefix] += 1
    return counts


def best_tree(counts: Counter[RankPath], n: int) -> set[RankPath]:
    """The ``n`` most frequent prefixes (ties: shorter, then smaller ranks first). A
    prefix is at least as frequent as any path it starts, so the set is a tree (every
    node's parent is in it)."""
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], len(kv[0]), kv[0]))
    return {p for p, _ in ordered[:n]}


def chain(k: int) -> set[RankPath]:
    """The tree of a chain of ``k`` drafts."""
    return {(0,) * i for i in range(1, k + 1)}


def served_tokens(paths: Iterable[torch.Tensor], tree: set[RankPath]) -> dict[str, float]:
    """Tokens per verification when every step verifies ``tree``: a step at row ``s``
    accepts the longest prefix of row ``s``'s true rank path in the tree, plus the
    target's own token, and the next step starts after them."""
    tokens = steps = 0
    for rows in paths:
        table, s = rows.tolist(), 0
        while s < len(table):
            accepted, prefix = 0, ()
            for r in table[s]:
                prefix += (r,)
                if prefix not in tree:
                    break
                accepted += 1
            tokens += accepted + 1
            steps += 1
            s += accepted + 1
    return {"tokens_per_step": tokens / steps if steps else float("nan"), "steps": steps}


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


def load_head(path: Path, hf_config: Any) -> tuple[Any, torch.Tensor]:
    """An EAGLE-3 head checkpoint (``config.json`` and ``model.safetensors``, as
    ``lmkit spec train-eagle`` writes them) as a ``TrainableEagle3`` and its draft
    vocabulary (target ids, ascending)."""
    from lmkit_plugins.spec.eagle_trainable import TrainableEagle3
    from safetensors.torch import load_file

    config = json.loads((path / "config.json").read_text())
    taps = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not taps:
        raise SystemExit(f"{path}: not an EAGLE-3 head (no eagle_aux_hidden_state_layer_ids)")
    tensors = load_file(str(path / "model.safetensors"))
    d2t = tensors.pop("d2t", None)
    tensors.pop("t2d", None)
    size = int(config.get("draft_vocab_size") or hf_config.vocab_size)
    ids = d2t + torch.arange(len(d2t)) if d2t is not None else torch.arange(size)
    head = TrainableEagle3(hf_config, len(taps), len(ids))
    missing, unexpected = head.load_state_dict(tensors, strict=False)
    if unexpected or any(not m.startswith("rotary.") for m in missing):
        raise SystemExit(f"{path}: weights do not fit the head (missing {missing}, "
                         f"unexpected {unexpected})")
    return head.eval(), ids


def answer_paths(model: str, head_dir: Path, prompts: list[str], max_new_tokens: int,
                 depth: int, device: str) -> list[torch.Tensor]:
    """The true rank paths of the target's greedy answers to ``prompts`` (rows from each
    answer's first drafted position)."""
    return answer_data(model, head_dir, prompts, max_new_tokens, depth, device)[0]


@torch.no_grad()
def answer_data(model: str, head_dir: Path, prompts: list[str], max_new_tokens: int,
                depth: int, device: str
                ) -> tuple[list[torch.Tensor], list[list[int]], list[int]]:
    """:func:`answer_paths`, with each answer's whole sequence (prompt and answer token
    ids) and its first drafted row: row ``s`` of a path drafts the tokens from
    ``sequence[first + s + 2]`` on, knowing ``sequence[:first + s + 2]``."""
    from lmkit.api import load_hf_config
    from lmkit_plugins.spec.eagle_batches import StepBatcher
    from lmkit_plugins.spec.eagle_features import TargetFeatures
    from lmkit_plugins.spec.train_eagle import answer_rows, generate_data

    model_dir, sequences, lens = generate_data(model, prompts, max_new_tokens, device)
    seqs, firsts = answer_rows({"sequences": sequences, "prompt_lens": lens}, False)
    hf_config = load_hf_config(model_dir)
    head, ids = load_head(head_dir, hf_config)
    taps = json.loads((head_dir / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    target = TargetFeatures(model_dir, list(taps), device, dtype)
    head.to(device)
    batcher = StepBatcher(target, target.lm_head_rows(ids).to(device), device)
    to_draft = torch.full((hf_config.vocab_size,), -1, dtype=torch.int64)
    to_draft[ids] = torch.arange(len(ids))
    paths = []
    for seq, first in zip(seqs, firsts, strict=True):
        b = batcher([seq], target([seq]), [first])
        truth = to_draft[torch.tensor(seq[2:])].to(device)
        steps = head.unrolled(b.embeds[0], b.taps[0], min(depth, b.embeds.shape[1]))
        paths.append(rank_paths(steps, truth)[first:].cpu())
    return paths, seqs, firsts


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

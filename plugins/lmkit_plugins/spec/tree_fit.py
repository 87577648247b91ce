"""Fitting a static draft tree (``speculative.tree``) to an EAGLE-3 head: where the
target's own greedy answers rank under the head's drafts, and the tree of ``N`` nodes
that would accept the most of them (``lmkit spec fit-tree``; ``bench/eagle_tree_sim.py``
compares trees and chains with it).

A tree's nodes are *rank paths*, ``(r1, r2, ...)``: "the head's ``r1``-th most likely
token, then, fed that token, its ``r2``-th most likely one, ...". A step accepts the
longest prefix of the true rank path that is a node. For every position of the
answers the true token's rank at each depth is taken with the head fed the true tokens
and its own outputs (:meth:`TrainableEagle3.unrolled`, as drafting runs it); the best
static tree of ``N`` nodes is the ``N`` most frequent true rank prefixes. The head is
measured, not the engine: what a tree costs per step is not modelled.
"""

from __future__ import annotations

import json
import random
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


def check_head_dir(path: Path) -> dict[str, Any]:
    """The ``config.json`` of an EAGLE-3 head directory (``model.safetensors`` beside it).

    Raises:
        ValueError: the directory is not one (no config, no weights, an EAGLE-1/2 head).
    """
    config_path = path / "config.json"
    if not config_path.is_file() or not (path / "model.safetensors").is_file():
        raise ValueError(f"{path}: not an EAGLE-3 head directory (config.json and "
                         "model.safetensors, as lmkit spec train-eagle writes them)")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{config_path}: unreadable ({e})") from None
    taps = ((config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            if isinstance(config, dict) else None)
    if not taps:
        raise ValueError(f"{path}: not an EAGLE-3 head (its config.json has no "
                         "eagle_config.eagle_aux_hidden_state_layer_ids)")
    return config


def load_head(path: Path, hf_config: Any) -> tuple[Any, torch.Tensor]:
    """An EAGLE-3 head checkpoint (``config.json`` and ``model.safetensors``, as
    ``lmkit spec train-eagle`` writes them) as a ``TrainableEagle3`` and its draft
    vocabulary (target ids, ascending)."""
    from safetensors.torch import load_file

    from lmkit_plugins.spec.eagle_trainable import TrainableEagle3

    config = check_head_dir(path)
    taps = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    tensors = load_file(str(path / "model.safetensors"))
    d2t = tensors.pop("d2t", None)
    tensors.pop("t2d", None)
    size = int(config.get("draft_vocab_size") or hf_config.vocab_size)
    ids = d2t + torch.arange(len(d2t)) if d2t is not None else torch.arange(size)
    head = TrainableEagle3(hf_config, len(taps), len(ids))
    missing, unexpected = head.load_state_dict(tensors, strict=False)
    if unexpected or any(not m.startswith("rotary.") for m in missing):
        raise ValueError(f"{path}: weights do not fit the head (missing {missing}, "
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


def fit_tree(model: str, head_dir: Path, prompts: list[str], nodes: int, *,
             max_new_tokens: int = 128, depth: int = 6, max_rank: int = 8,
             device: str = "cpu", seed: int = 0) -> dict[str, Any]:
    """The best static tree of ``nodes`` nodes for the head at ``head_dir`` on the
    target's answers to ``prompts``, scored by the served walk on half of the answers
    after fitting it on the other half (seeded), beside the best chain; then refit on
    every answer (the tree returned).

    Returns:
        ``tree`` (rank paths, breadth first: what ``speculative.tree`` takes), its
        ``depth``, ``held_tokens_per_step`` (fit on one half, walked on the other),
        ``chain`` (the chain of the tree's depth on the held half), ``answers`` and
        ``rows`` (positions walked).
    """
    paths = answer_data(model, head_dir, prompts, max_new_tokens, depth, device)[0]
    order = list(range(len(paths)))
    random.Random(seed).shuffle(order)
    fit, held = [paths[i] for i in order[::2]], [paths[i] for i in order[1::2]]
    scored = best_tree(prefix_counts(fit, max_rank), nodes)
    tree = best_tree(prefix_counts(paths, max_rank), nodes)
    tree_depth = max((len(p) for p in tree), default=0)
    return {"tree": [list(p) for p in sorted(tree, key=lambda p: (len(p), p))],
            "depth": tree_depth, "answers": len(paths),
            "rows": sum(p.shape[0] for p in paths),
            "held_tokens_per_step": served_tokens(held, scored)["tokens_per_step"],
            "chain": served_tokens(held, chain(max(1, tree_depth)))["tokens_per_step"]}

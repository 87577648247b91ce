"""How well a head in training drafts on sequences it never trained on.

``lmkit spec train-eagle`` keeps a few of its sequences out of training (``--holdout``)
and, at every checkpoint, runs the head over them exactly as it trains (the unrolled
draft steps of :meth:`~lmkit_plugins.spec.eagle_trainable.TrainableEagle3.unrolled`:
row ``s`` of step ``j`` is the ``j``-th draft of the chain that starts after position
``s``); chains that start in the prompt are left out, since serving drafts only
after it. A draft is right where the head's argmax equals the target's (both over the
draft vocabulary); a chain's ``j``-th draft is accepted under greedy verification when
it and every draft before it in the chain are right. Draft position ``j``'s accuracy
``a_j`` is the fraction of chains whose drafts ``0..j`` are all right among those whose
drafts ``0..j-1`` are (the acceptance rate at that position), and the expected tokens
per speculative step of ``k`` drafts ``1 + a0 + a0 a1 + ... + a0 ... a(k-1)``. ``lmkit spec
train-eagle`` compares against the sequence's own tokens (the target's greedy answer),
so answer tokens outside the draft vocabulary count as misses, as in serving.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["default_holdout", "draft_accuracy", "expected_tokens_per_step", "holdout_split"]

#: sets of at least this many sequences hold some out by default
HOLDOUT_MIN_SET = 100
HOLDOUT_MAX = 100


def default_holdout(num_sequences: int) -> int:
    """5% of a set of at least :data:`HOLDOUT_MIN_SET` sequences, at most
    :data:`HOLDOUT_MAX`; none for smaller sets (every sequence trains)."""
    if num_sequences < HOLDOUT_MIN_SET:
        return 0
    return min(HOLDOUT_MAX, num_sequences // 20)


def holdout_split(num_sequences: int, holdout: int | None, seed: int
                  ) -> tuple[list[int], list[int]]:
    """``(training indices, held-out indices)``, both ascending: ``holdout`` sequences
    (``None``: :func:`default_holdout`) drawn with ``seed``, the same on every run of the
    same data (a resumed run keeps its split).

    :raises ValueError: ``holdout`` is negative or leaves no sequence to train on.
    """
    holdout = default_holdout(num_sequences) if holdout is None else holdout
    if holdout < 0 or holdout >= num_sequences:
        raise ValueError(f"--holdout {holdout}: keep between 0 and {num_sequences - 1} of the "
                         f"{num_sequences} sequences out of training")
    order = torch.randperm(num_sequences, generator=torch.Generator().manual_seed(seed + 1))
    held = sorted(order[:holdout].tolist())
    held_set = set(held)
    return [i for i in range(num_sequences) if i not in held_set], held


@torch.no_grad()
def draft_accuracy(head: Any, examples: Sequence[Callable[[], tuple[Any, ...]]],
                   ttt_steps: int) -> list[float]:
    """Per draft position ``j``, the acceptance rate of the ``j``-th draft among chains
    whose earlier drafts were all accepted (module docstring); ``nan`` where no chain
    reaches it. ``examples`` give ``(embeds [m, hidden], taps [m, width], target_logits
    [m, draft vocab])`` of one sequence each, laid out as the training loss takes them
    (:func:`~lmkit_plugins.spec.eagle_trainable.distill_loss`), optionally with a fourth
    item ``first``: chains starting before row ``first`` (the prompt, which serving
    never drafts) are not counted, and a fifth, ``truth [m]``: the draft id of the token
    each row must predict (``-1``: outside the draft vocabulary, never right), compared
    instead of the target logits' argmax over the draft vocabulary."""
    accepted = [0] * ttt_steps  # chains (starts s < m - j) with drafts 0..j all right
    reached = [0] * ttt_steps  # the same starts with drafts 0..j-1 all right
    for example in examples:
        embeds, taps, target, *rest = example()
        first = int(rest[0]) if rest else 0
        steps = head.unrolled(embeds, taps, min(ttt_steps, embeds.shape[0]))
        want = rest[1] if len(rest) > 1 else target.argmax(-1)
        # chains that start in the prompt never count: none of them is "reached"
        chain = torch.arange(embeds.shape[0], device=want.device) >= first
        for j, logits in enumerate(steps):
            right = logits.argmax(-1) == want[j:]  # row s: the chain after position s
            before = chain[:right.shape[0]]  # step 0: every counted start
            chain = before & right
            reached[j] += int(before.sum())
            accepted[j] += int(chain.sum())
    return [a / r if r else float("nan") for a, r in zip(accepted, reached, strict=True)]


def expected_tokens_per_step(accuracy: Sequence[float]) -> float:
    """``1 + a0 + a0 a1 + ...``: tokens a speculative step yields on average when draft
    ``j`` is accepted with probability ``accuracy[j]`` once the drafts before it were."""
    total, run = 1.0, 1.0
    for a in accuracy:
        if run == 0.0:  # no chain gets this far (its accuracy is nan: never reached)
            break
        run *= a
        total += run
    return total

"""How well a head in training drafts on sequences it never trained on.

``lmkit spec train-eagle`` keeps a few of its sequences out of training (``--holdout``)
and, at every checkpoint, runs the head over them exactly as it trains (the unrolled
draft steps of :meth:`~lmkit_plugins.spec.eagle_trainable.TrainableEagle3.unrolled`):
step ``j``'s accuracy is the fraction of positions where the head's argmax equals the
target's (both over the draft vocabulary), given that the ``j`` drafts before it were
right -- an estimate of the acceptance rate at draft position ``j`` under greedy
verification. With them, the expected tokens per speculative step of ``k`` drafts is
``1 + a0 + a0 a1 + ... + a0 ... a(k-1)``. The estimate ignores target tokens outside the
draft vocabulary (which no draft can match), so serving accepts somewhat less.
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
def draft_accuracy(head: Any, examples: Sequence[Callable[[], tuple[Any, Any, Any]]],
                   ttt_steps: int) -> list[float]:
    """Per draft step, the fraction of positions where the head's argmax is the
    target's. ``examples`` give ``(embeds [m, hidden], taps [m, width], target_logits
    [m, draft vocab])`` of one sequence each, laid out as the training loss takes them
    (:func:`~lmkit_plugins.spec.eagle_trainable.distill_loss`)."""
    correct = [0] * ttt_steps
    counted = [0] * ttt_steps
    for example in examples:
        embeds, taps, target = example()
        steps = head.unrolled(embeds, taps, min(ttt_steps, embeds.shape[0]))
        want = target.argmax(-1)
        for j, logits in enumerate(steps):
            correct[j] += int((logits.argmax(-1) == want[j:]).sum())
            counted[j] += logits.shape[0]
    return [c / n if n else float("nan") for c, n in zip(correct, counted, strict=True)]


def expected_tokens_per_step(accuracy: Sequence[float]) -> float:
    """``1 + a0 + a0 a1 + ...``: tokens a speculative step yields on average when draft
    ``j`` is accepted with probability ``accuracy[j]`` once the drafts before it were."""
    total, run = 1.0, 1.0
    for a in accuracy:
        run *= a
        total += run
    return total

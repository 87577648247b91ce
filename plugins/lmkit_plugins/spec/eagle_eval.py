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

__all__ = ["accuracy_report", "default_holdout", "draft_accuracy", "expected_tokens_per_step",
           "holdout_split", "report_line", "served_walk"]

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


def _right_runs(head: Any, example: Callable[[], tuple[Any, ...]], ttt_steps: int
                ) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """``(runs [m], first, truth)`` of one sequence: for each chain start ``s``, how many
    of its drafts in a row are right from the first (at most the steps left after
    ``s``); ``truth``: the example's fifth item, if any."""
    embeds, taps, target, *rest = example()
    first = int(rest[0]) if rest else 0
    m = embeds.shape[0]
    steps = head.unrolled(embeds, taps, min(ttt_steps, m))
    want = rest[1] if len(rest) > 1 else target.argmax(-1)
    runs = torch.zeros(m, dtype=torch.int64, device=want.device)
    alive = torch.ones(m, dtype=torch.bool, device=want.device)
    for j, logits in enumerate(steps):
        right = logits.argmax(-1) == want[j:]  # row s: the chain after position s
        now = torch.zeros_like(alive)
        now[:right.shape[0]] = alive[:right.shape[0]] & right
        runs += now
        alive = now
    return runs, first, rest[1] if len(rest) > 1 else None


@torch.no_grad()
def draft_accuracy(head: Any, examples: Sequence[Callable[[], tuple[Any, ...]]],
                   ttt_steps: int) -> list[float]:
    """Per draft position ``j``, the acceptance rate of the ``j``-th draft among chains
    whose earlier drafts were all accepted (module docstring); ``nan`` where no chain
    reaches it. ``examples`` give ``(embeds [m, hidden], taps [m, width], target [m, draft
    vocab])`` of one sequence each (the target's logits or distribution: only its argmax
    is read), laid out as the training loss takes them
    (:func:`~lmkit_plugins.spec.eagle_trainable.distill_loss`), optionally with a fourth
    item ``first``: chains starting before row ``first`` (the prompt, which serving
    never drafts) are not counted, and a fifth, ``truth [m]``: the draft id of the token
    each row must predict (``-1``: outside the draft vocabulary, never right), compared
    instead of the target logits' argmax over the draft vocabulary."""
    return accuracy_report(head, examples, ttt_steps)["accuracy"]


@torch.no_grad()
def served_walk(head: Any, examples: Sequence[Callable[[], tuple[Any, ...]]],
                num_drafts: int) -> dict[str, Any]:
    """What serving would measure on these sequences with ``num_drafts`` drafts a step:
    walk each answer as greedy verification does -- a chain starts after the answer's
    first row, accepts its drafts while they are right, and the next chain starts after
    the token the target adds -- and count as the engine's statistics do: tokens per
    verification (``spec_mean_accepted_length``) and, per draft position, the fraction
    of verifications accepting it (``spec_acceptance_rate_pos_J``).

    It differs from :func:`draft_accuracy`, which counts a chain at every position: a
    walk starts chains only where the previous one stopped, after a wrong draft, and
    skips the positions an accepted chain covered, which tend to be the easy ones (on
    the tiny test model the all-positions rate at position 0 read 0.058 and the walk's
    closer to what the engine served). ``examples`` as for :func:`draft_accuracy`.
    """
    return accuracy_report(head, examples, num_drafts)["served_walk"]


@torch.no_grad()
def accuracy_report(head: Any, examples: Sequence[Callable[[], tuple[Any, ...]]],
                    ttt_steps: int) -> dict[str, Any]:
    """Both measures of ``examples`` from one pass of the head over each (an example
    may run the target): the per-position accuracy of :func:`draft_accuracy`, the
    tokens per step it implies, :func:`served_walk` (under ``served_walk``) and, for
    examples that give ``truth``, ``vocab_coverage``: the fraction of the tokens to
    draft (rows from ``first``) that the draft vocabulary holds at all -- a ceiling on
    every draft position's accuracy (``None`` without ``truth``)."""
    counts = _Counts(ttt_steps)
    inside = rows = 0
    for example in examples:
        runs, first, truth = _right_runs(head, example, ttt_steps)
        counts.add_all_starts(runs, first)
        counts.add_walk(runs, first)
        if truth is not None:
            drafted = truth[first:runs.shape[0]]
            inside += int((drafted >= 0).sum())
            rows += drafted.shape[0]
    accuracy = counts.accuracy()
    return {"sequences": len(examples), "accuracy": accuracy,
            "tokens_per_step": expected_tokens_per_step(accuracy),
            "served_walk": counts.walk(), "vocab_coverage": inside / rows if rows else None}


def report_line(report: dict[str, Any]) -> str:
    """:func:`accuracy_report` in words (after "<what> (N sequences): ")."""
    walk = report["served_walk"]
    return (f"{', '.join(f'{a:.3f}' for a in report['accuracy'])} by draft position, "
            f"{report['tokens_per_step']:.2f} tokens per speculative step; as served "
            f"({len(walk['acceptance_by_position'])} drafts a step, chains where the last "
            f"stopped): {', '.join(f'{a:.3f}' for a in walk['acceptance_by_position'])} "
            f"accepted by position, {walk['tokens_per_step']:.2f} tokens per step"
            + ("" if report.get("vocab_coverage") is None else
               f"; the draft vocabulary holds {report['vocab_coverage']:.1%} of the tokens "
               "to draft"))


class _Counts:
    """Chain tallies over sequences, for ``k`` draft positions: every start counted
    (:func:`draft_accuracy`) and the served walk (:func:`served_walk`)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.reached = [0] * k  # chains (starts s < m - j) with drafts 0..j-1 all right
        self.accepted = [0] * k  # the same with drafts 0..j all right
        self.drafted = [0] * k  # walk: verifications with a draft at position j
        self.walk_accepted = [0] * k  # walk: ... accepting it
        self.verifications = 0
        self.tokens = 0

    def add_all_starts(self, runs: torch.Tensor, first: int) -> None:
        rows = torch.arange(runs.shape[0], device=runs.device)
        for j in range(self.k):
            # chains that start in the prompt never count: none of them is "reached"
            starts = (rows >= first) & (rows < runs.shape[0] - j)
            self.reached[j] += int((starts & (runs >= j)).sum())
            self.accepted[j] += int((starts & (runs > j)).sum())

    def add_walk(self, runs: torch.Tensor, first: int) -> None:
        runs_list, m, s = runs.tolist(), runs.shape[0], first
        while s < m:
            n_drafts = min(self.k, m - s)
            took = min(runs_list[s], n_drafts)
            for j in range(n_drafts):
                self.drafted[j] += 1
                self.walk_accepted[j] += int(took > j)
            self.verifications += 1
            self.tokens += took + 1
            s += took + 1

    def accuracy(self) -> list[float]:
        return [a / r if r else float("nan")
                for a, r in zip(self.accepted, self.reached, strict=True)]

    def walk(self) -> dict[str, Any]:
        v = self.verifications
        return {"verifications": v, "tokens_per_step": self.tokens / v if v else float("nan"),
                "acceptance_by_position": [a / d if d else float("nan") for a, d in
                                           zip(self.walk_accepted, self.drafted, strict=True)]}


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

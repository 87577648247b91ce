"""Speculative-decoding counters, for ``EngineCore.stats()``, ``/metrics`` and benchmarks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class SpecDecodeStats:
    """Totals since the engine started.

    A *verification* is one request in one step with at least one draft scheduled. Of
    its ``d`` drafts the first ``a`` were accepted, and ``a + 1`` tokens were emitted
    (the accepted drafts and one token from the target).

    With a draft tree the drafts are its first ``d`` nodes, the accepted ones a path, and
    a *position* is a depth: position ``j`` counts verifications whose nodes reach depth
    ``j + 1`` and those accepting a draft there.

    Args:
        num_speculative_tokens: ``k``; per-position counters cover positions ``0..k-1``.
        tree_depths: with a draft tree, ``depths[n]`` is the depth of its first ``n``
            nodes (:attr:`lmkit.spec_decode.tree.DraftTree.depths`); the counters then
            cover its depths.
    """

    def __init__(self, num_speculative_tokens: int,
                 tree_depths: list[int] | None = None) -> None:
        self.tree_depths = tree_depths
        self.k = max(tree_depths) if tree_depths else num_speculative_tokens
        self.num_proposed_tokens = 0  # drafted by the proposer (some never scheduled)
        self.num_verifications = 0
        self.num_draft_tokens = 0  # scheduled and verified
        self.num_accepted_tokens = 0
        self.drafted_at = [0] * self.k  # verifications with a draft at j
        self.accepted_at = [0] * self.k  # ... whose draft j was accepted

    def record_proposals(self, num_tokens: int) -> None:
        """Count draft tokens the proposer produced this step."""
        self.num_proposed_tokens += num_tokens

    def record_step(self, num_draft_tokens: Mapping[str, int],
                    num_accepted_tokens: Mapping[str, int]) -> None:
        """Count one step's verifications (``ModelRunnerOutput`` fields, by request)."""
        for rid, drafted in num_draft_tokens.items():
            if drafted <= 0:
                continue
            accepted = min(num_accepted_tokens.get(rid, 0), drafted)
            self.num_verifications += 1
            self.num_draft_tokens += drafted
            self.num_accepted_tokens += accepted
            depths = self.tree_depths
            reach = drafted if depths is None else depths[min(drafted, len(depths) - 1)]
            for j in range(min(reach, self.k)):
                self.drafted_at[j] += 1
                if j < accepted:
                    self.accepted_at[j] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / verified draft tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification: 1 + accepted drafts on average (0 before any)."""
        if not self.num_verifications:
            return 0.0
        return 1.0 + self.num_accepted_tokens / self.num_verifications

    def acceptance_rate_at(self, position: int) -> float:
        """Of the verifications with a draft at ``position``, the fraction accepting it."""
        n = self.drafted_at[position]
        return self.accepted_at[position] / n if n else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Flat numeric entries (the serving channel keeps only numbers): totals, rates,
        and ``spec_acceptance_rate_pos_J`` for each draft position ``J``."""
        out: dict[str, Any] = {
            "spec_num_proposed_tokens": self.num_proposed_tokens,
            "spec_num_verifications": self.num_verifications,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_acceptance_rate": self.acceptance_rate,
            "spec_mean_accepted_length": self.mean_accepted_length,
        }
        for j in range(self.k):
            out[f"spec_acceptance_rate_pos_{j}"] = self.acceptance_rate_at(j)
        return out

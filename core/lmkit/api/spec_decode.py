"""The SpecProposer contract. Proposers only propose; the core verifies, so every
proposer is lossless."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class ProposerInput:
    """What a proposer sees each step, for the requests that may speculate.

    ``token_ids[i]`` is request ``req_ids[i]``'s prompt and output so far (a view the
    proposer must not mutate). ``hidden_states`` is the target model's last hidden
    states for the step's tokens, given only to proposers whose spec declares the
    ``"hidden_states"`` feature.
    """

    req_ids: list[str]
    token_ids: list[list[int]]
    num_spec_tokens: int
    hidden_states: torch.Tensor | None = None
    extra: dict[str, Any] | None = None


@dataclass
class Proposal:
    """Draft tokens per request (at most ``num_spec_tokens`` each, possibly none) and,
    optionally, the draft distributions ``[num_drafts, vocab]`` they were sampled from.
    Without ``draft_probs`` the drafts are treated as deterministic (one-hot)."""

    draft_token_ids: list[list[int]]
    draft_probs: list[torch.Tensor | None] | None = None


class SpecProposer(ABC):
    """Proposes draft tokens for the target model to verify.

    Constructed as ``cls(config, options=opts)``.
    """

    @abstractmethod
    def propose(self, batch: ProposerInput) -> Proposal:
        """Draft up to ``batch.num_spec_tokens`` tokens per request."""

    def remove_requests(self, req_ids: set[str]) -> None:  # noqa: B027 - optional
        """Forget per-request state (finished or preempted requests)."""

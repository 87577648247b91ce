"""The SpecProposer contract. Proposers only propose; the core verifies, so every
proposer is lossless.

Each engine step, after the sampled tokens are appended, the engine asks the proposer
for up to ``k`` draft tokens per decoding request (:meth:`SpecProposer.propose`). The
next step runs the target model once over every request's last token and its drafts;
the core then accepts the longest prefix of drafts that verification allows (greedy:
the drafts equal to the target's argmax; random: rejection sampling against the draft
distribution) plus one token from the target, so the output distribution is exactly
the target model's whatever the drafts were.

What a proposer declares in its :class:`~lmkit.api.Spec` (as data, never as methods):

* ``stack_needs={"attention": Needs({"multi_token_query"})}``: verification runs
  several query tokens per decoding request.
* ``caps.features``: ``"hidden_states"`` if it consumes the target model's hidden
  states (EAGLE-style heads), ``"own_kv_cache"`` if it keeps a KV cache of its own
  (a draft model, in the same paged layout and block tables as the target);
  ``caps.values={"max_k": {...}}`` the draft lengths it supports.

Proposers that declare neither feature run in the engine-core process on token ids
alone; the others need the model runner's device memory and are handed
``hidden_states`` / ``block_ids`` in :class:`ProposerInput`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class ProposerInput:
    """What a proposer sees each step, for the requests that may speculate.

    Attributes:
        req_ids: the requests to draft for (decoding, not opted out), in batch order.
        token_ids: ``token_ids[i]`` is request ``req_ids[i]``'s prompt and accepted
            output so far; read-only views the proposer must not mutate or keep.
        num_spec_tokens: ``k``, the most drafts to propose per request (fewer, or none,
            is fine; the scheduler may also use fewer when the token budget or
            ``max_tokens`` is short).
        num_new_tokens: per request, how many tokens at the end of ``token_ids[i]`` are
            new since this proposer last saw the request (all of them the first time).
            Incremental proposers (suffix indexes, draft models catching their KV cache
            up) use it; ``None`` means unknown (treat every token as possibly new).
        hidden_states: for proposers declaring ``"hidden_states"``: the target model's
            final hidden states of the new tokens, ``[sum(num_new_tokens), hidden]`` in
            request order; ``None`` otherwise.
        block_ids: for proposers declaring ``"own_kv_cache"``: each request's KV block
            table (its draft KV lives in the same slots of the proposer's own cache);
            ``None`` otherwise.
    """

    req_ids: list[str]
    token_ids: Sequence[Sequence[int]]
    num_spec_tokens: int
    num_new_tokens: list[int] | None = None
    hidden_states: torch.Tensor | None = None
    block_ids: list[list[int]] | None = None


@dataclass
class Proposal:
    """Draft tokens per request, in ``ProposerInput.req_ids`` order.

    ``draft_token_ids[i]`` holds at most ``num_spec_tokens`` ids (possibly none).
    ``draft_probs``, optional, gives per request the distribution each draft was sampled
    from, ``[len(draft_token_ids[i]), vocab]`` (float, rows summing to 1, the draft
    token with positive mass), or ``None`` for a request whose drafts are
    deterministic. Without ``draft_probs`` every draft is treated as deterministic, a
    one-hot distribution: exactly what prompt lookup and greedy draft models produce.
    Draft probabilities let rejection sampling accept more of a sampled draft.
    """

    draft_token_ids: list[list[int]]
    draft_probs: list[torch.Tensor | None] | None = None


class SpecProposer(ABC):
    """Proposes draft tokens for the target model to verify.

    Constructor (the one signature the engine uses): ``cls(config, *, options)``.
    ``config`` is the engine's :class:`~lmkit.api.LMKitConfig`
    (``config.speculative.num_speculative_tokens`` is ``k``), ``options`` the validated
    instance of the spec's options model.
    """

    @abstractmethod
    def propose(self, batch: ProposerInput) -> Proposal:
        """Draft up to ``batch.num_spec_tokens`` tokens per request.

        Called once per engine step with every request that may speculate; must be
        deterministic for deterministic inputs (seeded outputs stay reproducible) and
        cheap: O(context) per request or better, no per-token Python.
        """

    def remove_requests(self, req_ids: set[str]) -> None:  # noqa: B027 - optional
        """Forget per-request state of finished, aborted or preempted requests.

        Ids never seen are ignored. A removed request may come back (a preempted one
        resumes) and is then proposed for as if new.
        """

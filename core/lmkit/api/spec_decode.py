"""The proposer contracts. Proposers only propose; the core verifies, so every
proposer is lossless.

Each engine step, after the sampled tokens are appended, the proposer drafts up to
``k`` tokens per decoding request. The next step runs the target model once over every
request's last token and its drafts; the core then accepts the longest prefix of drafts
that verification allows (greedy: the drafts equal to the target's argmax; random:
rejection sampling against the draft distribution) plus one token from the target, so
the output distribution is exactly the target model's whatever the drafts were.

A proposer plugin (kind ``speculative``) subclasses one of two interfaces, both built
as ``cls(config, *, options)``:

* :class:`SpecProposer` runs in the engine-core process on token ids alone
  (:meth:`SpecProposer.propose` once per step), e.g. prompt lookup (``ngram``).
* :class:`RunnerProposer` runs in the model runner, next to the target model: a draft
  head (EAGLE) that reads the target's hidden states and keeps a paged KV cache of its
  own, addressed through the target's block tables. The runner drafts with it on the
  device right after the target's forward of the same step and returns the drafts in
  :class:`~lmkit.api.ModelRunnerOutput`.

What a proposer declares in its :class:`~lmkit.api.Spec` (as data, never as methods):

* ``stack_needs={"attention": Needs({"multi_token_query"})}``: verification runs
  several query tokens per decoding request.
* ``caps.features``: ``"hidden_states"`` if it consumes the target model's hidden
  states, ``"own_kv_cache"`` if it keeps a KV cache of its own: either makes it
  runner-hosted (its class must subclass :class:`RunnerProposer`);
  ``caps.values={"max_k": {...}}`` the draft lengths it supports.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from lmkit.api.attention import AttentionBackend
    from lmkit.api.model import CausalLM, ForwardContext, ModelBuildContext

#: ``caps.features`` that make a proposer runner-hosted (a :class:`RunnerProposer`)
RUNNER_HOSTED_FEATURES = frozenset({"hidden_states", "own_kv_cache"})


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
    """

    req_ids: list[str]
    token_ids: Sequence[Sequence[int]]
    num_spec_tokens: int
    num_new_tokens: list[int] | None = None


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


class Proposer(ABC):  # noqa: B024 - the base of the two interfaces below
    """What every proposer plugin class subclasses (through :class:`SpecProposer` or
    :class:`RunnerProposer`)."""

    def remove_requests(self, req_ids: set[str]) -> None:  # noqa: B027 - optional
        """Forget per-request state of finished, aborted or preempted requests.

        Ids never seen are ignored. A removed request may come back (a preempted one
        resumes) and is then proposed for as if new.
        """


class SpecProposer(Proposer):
    """Proposes draft tokens from token ids, in the engine-core process.

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


@dataclass(frozen=True)
class DraftHeadContext:
    """What the model runner gives a :class:`RunnerProposer` to load it.

    Attributes:
        target: the loaded target model; a head that shares the target's input
            embedding or language-model head calls its
            :meth:`~lmkit.api.CausalLM.embed_input_ids` / ``compute_logits``.
        target_hf_config: the target's ``config.json``.
        build: dtype, device, block size and the attention backend class and options
            the head builds its own attention backend with (its KV cache uses the
            target's block size and block ids).
    """

    target: CausalLM
    target_hf_config: Any
    build: ModelBuildContext


class RunnerProposer(Proposer):
    """A draft head hosted in the model runner (EAGLE-style): it reads the target's
    hidden states and keeps a paged KV cache of its own.

    Constructor (the one signature the runner uses): ``cls(config, *, options)``;
    ``config.speculative.model`` names the head's directory. The constructor reads the
    head's configuration only (no weights) and raises
    :class:`~lmkit.errors.ConfigError` when it is missing or unreadable.

    The runner then calls :meth:`check_target` before any weights load,
    :meth:`load` once the target is loaded, and allocates ``num_kv_layers`` KV caches
    shaped by :attr:`attn` with the target's (same number of blocks, counted in the
    memory profile). Each step, after the target's forward and verification, it runs
    :meth:`forward` once over the positions the target computed and kept (their
    features are the target's hidden states; the KV of rejected positions is
    overwritten in a later step), then ``k - 1`` times over one position per request
    (its features are the head's previous outputs), taking :meth:`draft_argmax` (the
    argmax of :meth:`compute_logits`) as each draft: greedy drafts, which verification
    treats as deterministic (one-hot), so outputs keep the target's distribution. With
    :attr:`samples_drafts`, the drafts of requests that sample are drawn instead from
    :meth:`draft_logits` after the request's temperature and truncation filters, and
    verification gets the distributions they were drawn from
    (:mod:`lmkit.sample.draft_sampling`).
    """

    #: KV caches the head needs (its decoder layers); set by the constructor
    num_kv_layers: int
    #: the target layers whose inputs (the residual stream entering each) the head reads,
    #: concatenated in this order, as its first pass's features (EAGLE-3); empty: the
    #: target's final hidden states (EAGLE-1/2). Known after :meth:`check_target`.
    target_layers: tuple[int, ...] = ()
    #: the width of the catch-up pass's features (what the runner hands :meth:`forward`
    #: there): the target's hidden size, times ``len(target_layers)`` when those are set;
    #: set by :meth:`check_target`. With :attr:`supports_cuda_graphs`, a catch-up pass
    #: after a decode or verification step then replays in CUDA graphs too (flattened,
    #: one row per kept position); 0: it always runs eagerly
    target_feature_size: int = 0
    #: its attention backend (set by :meth:`load`): shapes its KV caches, planned per step
    attn: AttentionBackend
    #: the width of :meth:`forward`'s output features (set by :meth:`load`)
    hidden_size: int = 0
    #: a :meth:`forward` over one position per request may be captured in a CUDA graph
    #: (no host synchronisation, no data-dependent shapes; needs :attr:`hidden_size`): the
    #: runner then replays the ``k - 1`` draft passes when the target's decode runs in
    #: graphs
    supports_cuda_graphs: bool = False
    #: with :attr:`supports_cuda_graphs`: :meth:`draft_argmax` may be captured too; the
    #: draft passes' graphs then take the drafts and feed them to the next pass on the
    #: device (one replay per pass); else it runs eagerly after each replay
    supports_graph_drafts: bool = False
    #: the runner samples the drafts of requests with ``temperature > 0`` from the head's
    #: distribution (:meth:`draft_logits`, filtered by the request's temperature, min-p,
    #: top-k and top-p) and verifies them against it; ``False``: argmax drafts for every
    #: request (a proposer option, e.g. ``draft_sampling: greedy``)
    samples_drafts: bool = False

    @abstractmethod
    def check_target(self, target_hf_config: Any) -> None:
        """Refuse a target the head does not fit, before any weights load.

        Raises:
            ConfigError: naming the mismatch (hidden size, vocabulary, ...).
        """

    @abstractmethod
    def load(self, ctx: DraftHeadContext) -> None:
        """Build the head's modules and attention backend; load its weights.

        Raises:
            ModelLoadError: the checkpoint does not match the head's configuration.
        """

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """One draft pass over packed tokens (the planned :attr:`attn`, the head's KV
        caches in ``ctx``).

        ``input_ids[i]`` is the token *after* position ``positions[i]``,
        ``hidden_states[i]`` the feature at that position: the target's hidden state
        (``[n, target hidden]``) or this head's own previous output. Writes the head's
        KV at the planned slots; returns its output features ``[n, hidden]``.
        """

    @abstractmethod
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` head outputs -> float32 logits over the target's vocabulary."""

    def draft_argmax(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` head outputs -> ``[n]`` int64 greedy drafts (target token ids):
        ``compute_logits(hidden_states).argmax(-1)``, the first id of equal maxima.

        Optional: override it to reach the same ids in fewer operations (e.g. the argmax
        over a draft vocabulary, then mapped to target ids, instead of full-vocabulary
        logits). Runs between draft passes: no host synchronisation, no data-dependent
        shapes.
        """
        return self.compute_logits(hidden_states).argmax(dim=-1)

    def draft_logits(self, hidden_states: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[n, hidden]`` head outputs -> (float32 logits ``[n, draft vocab]``, the int64
        target id of each draft id or ``None`` when the draft vocabulary is the
        target's): what sampled drafts are drawn from.

        Optional: the default is :meth:`compute_logits` over the target's vocabulary;
        a head with a smaller draft vocabulary returns its own logits and the map.
        Runs between draft passes: no host synchronisation, no data-dependent shapes.
        """
        return self.compute_logits(hidden_states), None

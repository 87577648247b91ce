"""Logits processors: batch-level plugins that change the logits before sampling.

A processor (vLLM-v1 style) sees the whole step's logits at once, never one request at
a time. It keeps per-request state in tensors indexed by a *slot* (an integer in
``[0, max_num_slots)`` the sampler gives each request, stable for the request's life) and
is told when the batch changes through :meth:`LogitsProcessor.update_state`. Each step
:meth:`LogitsProcessor.apply` gets the float32 logits ``[num_rows, vocab]`` and, per
row, the slot of the row's request, so the work is a few batched tensor operations
(e.g. ``state[slots]``), with no Python loop over requests in the hot path.

Requests select processors by name (``SamplingParams.logits_processors``, with their
own arguments in ``SamplingParams.extra_args``); the config's
``logits_processors.enable`` applies processors to every request. Register one with
the ``register_logits_processors`` hook::

    @lmkit.hookimpl
    def register_logits_processors(register):
        register(Spec(name="force-token", target="my_pkg.procs:ForceToken"))
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from lmkit.api.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class LogitsProcessorContext:
    """What a processor is built with: ``cls(ctx, options)``.

    Args:
        vocab_size: the logits' width.
        max_num_slots: slots are in ``[0, max_num_slots)``; size state tensors by it.
        device: where the logits live (a :class:`torch.device`).
    """

    vocab_size: int
    max_num_slots: int
    device: Any


@dataclass(frozen=True, slots=True)
class AddedRequest:
    """A request that starts using the processor at ``slot``.

    ``output_token_ids`` is the request's live list of generated tokens (accepted ones
    only; it grows after every step): keep a reference rather than copying it.
    """

    slot: int
    req_id: str
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


@dataclass(frozen=True, slots=True)
class BatchUpdate:
    """The requests that left (``removed`` slots, freed first) and joined since the last
    update; a slot in ``removed`` may be reused by a request in ``added``."""

    removed: Sequence[int] = field(default_factory=tuple)
    added: Sequence[AddedRequest] = field(default_factory=tuple)


class LogitsProcessor(ABC):
    """A batch-level logits processor (see the module docstring).

    Constructed once per engine as ``cls(ctx, options)`` (``ctx`` a
    :class:`LogitsProcessorContext`, ``options`` the validated instance of the spec's
    options model), the first time a request selects it, or at start-up when the config
    enables it for every request.
    """

    #: True when :meth:`apply` never changes which token has the largest logit (e.g.
    #: a temperature-like rescaling); greedy requests then keep the argmax fast path.
    is_argmax_invariant: ClassVar[bool] = False

    @classmethod
    def validate_params(cls, params: SamplingParams, vocab_size: int) -> None:
        """Check a request's arguments (``params.extra_args``) when it arrives; raise
        :class:`~lmkit.errors.InvalidRequestError` (with ``param="extra_args"``) for
        arguments that do not fit. Called in the engine core before the request is
        queued, for every request the processor applies to, so a bad argument refuses
        that request alone. The default accepts everything."""
        return None

    @abstractmethod
    def update_state(self, update: BatchUpdate) -> None:
        """Take the batch changes since the last step (called before :meth:`apply`,
        only when something changed). Per-request arguments are in
        ``added[i].params.extra_args``, already accepted by :meth:`validate_params`:
        do not raise here (it would stop the engine's step)."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Return the changed logits (changed in place, or a new tensor of the same
        shape and dtype).

        Args:
            logits: float32 ``[num_rows, vocab]``, after logit bias, the token bans
                and penalties, before temperature and the filters.
            slots: int64 ``[num_rows]`` on the logits' device: each row's request slot.
                Rows of requests that do not use this processor carry slots it was never
                given (or was told were removed): its state must leave those rows
                unchanged (e.g. an ``active`` flag per slot, cleared on removal). With
                speculative decoding a request owns several consecutive rows (one per
                draft plus one), all with its slot.
        """

"""The StructuredOutputBackend contract: constraints compiled into token masks.

A constraint is a ``(kind, spec)`` pair taken from ``SamplingParams.structured_outputs``:

==================  ==============================================  ================
kind                spec                                            feature (caps)
==================  ==============================================  ================
``json``            a JSON schema (dict, bool, or its JSON text)    ``json_schema``
``json_object``     ignored: any JSON object                        ``json_object``
``regex``           a regular expression (the whole output)        ``regex``
``grammar``         a grammar (EBNF/GBNF, or Lark)                  ``grammar``
``choice``          a non-empty list of strings                     ``choice``
``structural_tag``  the backend's structural-tag description        ``structural_tag``
==================  ==============================================  ================

A backend declares the features it supports in its spec's ``caps``; the engine refuses
requests for the others before calling the backend.

Compiling is split in two so that the engine can share and cache the expensive part:
:meth:`StructuredOutputBackend.compile_shared` turns a constraint into an immutable,
request-independent object (run in a thread pool with a time limit, cached in a
bounded LRU per constraint), and :meth:`StructuredOutputBackend.new_grammar` makes
each request's :class:`Grammar` (the matcher state) from it. A backend whose compile
is cheap implements only :meth:`StructuredOutputBackend.compile`.

Token bitmasks are int32 tensors ``[num_rows, ceil(vocab_size / 32)]``: token ``t`` is
allowed in a row when bit ``t % 32`` of word ``t // 32`` is set (the layout of
xgrammar and llguidance).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class Grammar(ABC):
    """One request's matcher state over a compiled constraint.

    The engine calls it from one thread at a time: :meth:`fill_bitmask` before each
    step that samples, :meth:`accept_tokens` with the tokens the step produced. For
    speculative decoding it accepts draft tokens to fill one bitmask row per draft
    position, then rolls them back with :meth:`rollback`.
    """

    @abstractmethod
    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over ``token_ids``; False (state unchanged) if any is not allowed."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative drafts)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token mask into ``bitmask[row]`` (int32, 32 tokens per word);
        other rows are left untouched."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the constraint is complete and only end-of-sequence may follow."""


class StructuredOutputBackend(ABC):
    """Compiles constraints for one tokenizer.

    Constructor (the one signature the engine uses): ``cls(tokenizer, vocab_size, *,
    options)``. ``tokenizer`` is the model's Hugging Face tokenizer, ``vocab_size`` the
    width of the model's logits (which may exceed the tokenizer's vocabulary; ids past
    the tokenizer must never be allowed), ``options`` the validated instance of the
    spec's options model."""

    @abstractmethod
    def compile(self, kind: str, spec: Any) -> Grammar:
        """Compile a constraint (``kind`` one of ``json``, ``json_object``, ``regex``,
        ``grammar``, ``choice``, ``structural_tag``) into a fresh :class:`Grammar`.

        Raise :class:`lmkit.errors.InvalidRequestError` for an invalid constraint, with
        a message that names the problem (it becomes the HTTP 400's message).
        """

    def compile_shared(self, kind: str, spec: Any) -> Any:
        """The expensive, request-independent part of :meth:`compile`: an immutable
        object that :meth:`new_grammar` turns into fresh grammars, from any thread.

        The engine runs this in a thread pool under ``structured_output.compile_timeout_s``
        and caches the result per constraint. The default defers everything to
        :meth:`compile` (returns ``(kind, spec)``); override it together with
        :meth:`new_grammar` when compiling is costly (e.g. a vocabulary-wide
        precomputation per grammar). Raise ``InvalidRequestError`` like :meth:`compile`.
        """
        return (kind, spec)

    def new_grammar(self, shared: Any) -> Grammar:
        """A fresh :class:`Grammar` (initial state) from :meth:`compile_shared`'s result.
        Must be cheap: it runs once per request. Default: ``compile(*shared)``."""
        kind, spec = shared
        return self.compile(kind, spec)

    def shared_size_bytes(self, shared: Any) -> int:
        """Memory held by a :meth:`compile_shared` result, for the engine's cache limit
        (``structured_output.grammar_cache_mb``); 0 when unknown (the default)."""
        return 0

    def fill_bitmasks(self, grammars: Sequence[Grammar], bitmask: torch.Tensor,
                      rows: Sequence[int]) -> None:
        """Fill ``bitmask[rows[i]]`` for ``grammars[i]``: a step's rows at once (requests
        without draft tokens). The default calls each grammar's :meth:`Grammar.fill_bitmask`
        in turn; a backend may fill them in parallel."""
        for grammar, row in zip(grammars, rows, strict=True):
            grammar.fill_bitmask(bitmask, row)

    @staticmethod
    def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                            indices: Sequence[int] | None = None) -> None:
        """Set ``logits[i, t]`` to ``-inf`` where bit ``t`` of ``bitmask[i]`` is 0, for
        every row ``i`` in ``indices`` (all rows when ``None``); in place.

        ``logits`` is float ``[num_rows, vocab]`` and ``bitmask`` int32
        ``[num_rows, ceil(vocab / 32)]`` on the same device. Called by the model runner
        in the worker process. The default is lmkit's vectorised torch implementation
        (:func:`lmkit.sample.bitmask.apply_token_bitmask`); a backend may override it
        with its own kernel.
        """
        from lmkit.sample.bitmask import apply_token_bitmask

        apply_token_bitmask(logits, bitmask, indices)

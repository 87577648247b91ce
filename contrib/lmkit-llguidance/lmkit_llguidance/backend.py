"""The structured-output backend on llguidance: constraints compiled to llguidance
grammars (JSON schema, regex, Lark or GBNF grammars, choices), matched token by token.

llguidance computes a token mask with an Earley parser over a lexer and a token trie,
so no per-grammar precompilation of the vocabulary is needed: compiling a new schema
costs about a millisecond, and the mask for a step is computed lazily from the parser
state (typically tens of microseconds).
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.hf
from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark
from lmkit.api import Grammar, InvalidRequestError, StructuredOutputBackend

JSON_OBJECT_SCHEMA = {"type": "object"}


class LLGuidanceGrammar(Grammar):
    """One request's matcher state (an ``llguidance.LLMatcher``).

    :meth:`accept_tokens` is all-or-nothing: a refused list leaves the matcher exactly
    as it was (llguidance consumes the longest valid prefix; that prefix is rolled
    back). llguidance stops a matcher by itself as soon as nothing but the end can
    follow (after ``"maybe"`` in a choice of yes/no/maybe); from then on the only
    allowed token is EOS, which this class accepts and counts without passing it on,
    so that :meth:`rollback` stays exact.
    """

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: frozenset[int]) -> None:
        self._matcher = matcher
        self._eos = eos_token_ids
        self._num_eos_after_stop = 0  # EOS tokens accepted once the matcher had stopped

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over ``token_ids``; False (state unchanged) if any is not allowed."""
        tokens = list(token_ids)
        consumed = self._matcher.try_consume_tokens(tokens)
        rest = tokens[consumed:]
        if rest and not (self._matcher.is_stopped() and all(t in self._eos for t in rest)):
            if consumed:
                self._matcher.rollback(consumed)
            return False
        self._num_eos_after_stop += len(rest)
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative drafts)."""
        undo_eos = min(num_tokens, self._num_eos_after_stop)
        self._num_eos_after_stop -= undo_eos
        if num_tokens - undo_eos:
            self._matcher.rollback(num_tokens - undo_eos)

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the allowed-token mask into ``bitmask[row]`` (CPU int32 tensor with
        ``ceil(vocab_size / 32)`` words per row, each row contiguous)."""
        target = bitmask[row]
        if bitmask.dtype.itemsize != 4 or bitmask.device.type != "cpu" or not target.is_contiguous():
            raise ValueError("fill_bitmask needs a CPU int32 bitmask with contiguous rows, got "
                             f"{bitmask.dtype} on {bitmask.device}")
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)

    def is_terminated(self) -> bool:
        """Whether the constraint is complete and only EOS may follow."""
        return bool(self._matcher.is_stopped())


class LLGuidanceBackend(StructuredOutputBackend):
    """Compiles constraints for one tokenizer with llguidance.

    Constructed by the engine as ``cls(tokenizer, vocab_size, options=...)`` where
    ``tokenizer`` is a Hugging Face fast tokenizer and ``vocab_size`` the model's
    (possibly padded) vocabulary, which sets the bitmask width.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, options: Any = None) -> None:
        self.options = options
        self.vocab_size = vocab_size
        try:
            self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        except Exception as e:
            raise ValueError(
                f"llguidance cannot use this tokenizer ({type(tokenizer).__name__}): {e}; it "
                "needs a Hugging Face fast tokenizer (tokenizer.json)") from e
        eos = list(getattr(self.ll_tokenizer, "eos_tokens", None) or [])
        self.eos_token_ids = frozenset(eos or [self.ll_tokenizer.eos_token])
        flexible = bool(getattr(options, "whitespace_flexible", False))
        self._json_defaults = {"whitespace_flexible": flexible}

    def grammar_source(self, kind: str, spec: Any) -> str:
        """The llguidance grammar (a JSON string) for a constraint; raises
        :class:`InvalidRequestError` for an unknown kind or a malformed spec."""
        if kind in ("json", "json_object"):
            schema = JSON_OBJECT_SCHEMA if kind == "json_object" else spec
            if isinstance(schema, (dict, bool)):
                schema = json.dumps(schema)
            if not isinstance(schema, str):
                raise InvalidRequestError(f"a json constraint must be a JSON schema (object or "
                                          f"string), got {type(spec).__name__}")
            return llguidance.LLMatcher.grammar_from_json_schema(schema,
                                                                  defaults=self._json_defaults)
        if kind == "regex":
            if not isinstance(spec, str):
                raise InvalidRequestError(f"a regex constraint must be a string, got {spec!r}")
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            if not (isinstance(spec, list) and spec and all(isinstance(c, str) for c in spec)):
                raise InvalidRequestError("a choice constraint must be a non-empty list of "
                                          f"strings, got {spec!r}")
            alternatives = " | ".join(json.dumps(c) for c in spec)
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        if kind == "grammar":
            if not isinstance(spec, str):
                raise InvalidRequestError(f"a grammar constraint must be a string, got {spec!r}")
            lark = spec
            if "::=" in spec:
                try:
                    lark = gbnf_to_lark(spec)
                except GbnfToLarkError as e:
                    raise InvalidRequestError(f"invalid GBNF grammar: {e}") from e
            return llguidance.LLMatcher.grammar_from_lark(lark)
        raise InvalidRequestError(
            f"the llguidance backend does not support {kind!r} constraints; it supports json, "
            "json_object, regex, choice and grammar (Lark or GBNF)")

    def compile(self, kind: str, spec: Any) -> LLGuidanceGrammar:
        """Compile a constraint into a fresh :class:`LLGuidanceGrammar`.

        Raises:
            InvalidRequestError: the constraint is malformed (the message is llguidance's
                diagnosis, e.g. the position of a regex error).
        """
        return self.new_grammar(self.compile_shared(kind, spec))

    def compile_shared(self, kind: str, spec: Any) -> str:
        """The validated llguidance grammar (a JSON string) for a constraint: what lmkit
        caches per constraint and shares between requests."""
        source = self.grammar_source(kind, spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            source, self.ll_tokenizer)
        if is_error:
            raise InvalidRequestError(
                f"invalid {kind} constraint: {'; '.join(m.strip() for m in messages)}")
        return source

    def new_grammar(self, shared: str) -> LLGuidanceGrammar:
        """A fresh matcher over a validated grammar."""
        matcher = llguidance.LLMatcher(self.ll_tokenizer, shared)
        if matcher.is_error():
            raise InvalidRequestError(f"invalid constraint: {matcher.get_error()}")
        return LLGuidanceGrammar(matcher, self.eos_token_ids)

    def shared_size_bytes(self, shared: str) -> int:
        """The grammar text's size (the matcher's state is per request)."""
        return len(shared)

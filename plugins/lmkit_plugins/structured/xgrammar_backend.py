"""The ``xgrammar`` structured-output backend: constraints compiled with xgrammar.

xgrammar compiles a grammar against the tokenizer once (a per-grammar precomputation of
which tokens each grammar position allows: milliseconds for a small JSON schema,
seconds for a schema with many string patterns), after which a matcher fills a step's
token mask in microseconds. So this backend splits the contract's two stages:
:meth:`XGrammarBackend.compile_shared` returns xgrammar's ``CompiledGrammar`` (which the
engine caches and shares between requests) and :meth:`XGrammarBackend.new_grammar`
wraps a fresh ``GrammarMatcher`` around it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr
from lmkit.api import Grammar, InvalidRequestError, StructuredOutputBackend

from lmkit_plugins.structured import XGrammarOptions
from lmkit_plugins.structured.json_schema_check import unsupported_keywords
from lmkit_plugins.structured.json_schema_rewrite import rewrite_short_strings

JSON_OBJECT_SCHEMA = {"type": "object"}
COMPACT_SEPARATORS = (",", ":")
BATCH_FILL_MIN_ROWS = 4  # below this, one matcher at a time is as fast
# xgrammar prefixes errors with "[hh:mm:ss] /path/file.cc:123: "
_LOG_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


class XGrammarGrammar(Grammar):
    """One request's matcher state (an ``xgrammar.GrammarMatcher``).

    :meth:`accept_tokens` is all-or-nothing (tokens accepted before a refused one are
    rolled back). Once the matcher has terminated (it accepted a stop token), further
    stop tokens are accepted and counted here without reaching the matcher, so that
    the mask of a terminated grammar (stop tokens only) and :meth:`rollback` agree.
    """

    def __init__(self, matcher: xgr.GrammarMatcher, stop_token_ids: Sequence[int]) -> None:
        self._matcher = matcher
        self._stop = frozenset(int(t) for t in stop_token_ids)
        self._num_stops_after_end = 0  # stop tokens accepted after termination

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over ``token_ids``; False (state unchanged) if any is not allowed."""
        done = 0
        for token in token_ids:
            if self._matcher.is_terminated():
                ok = token in self._stop
                self._num_stops_after_end += ok
            else:
                ok = self._matcher.accept_token(int(token))
            if not ok:
                self.rollback(done)
                return False
            done += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative drafts)."""
        extra = min(num_tokens, self._num_stops_after_end)
        self._num_stops_after_end -= extra
        if num_tokens > extra:
            self._matcher.rollback(num_tokens - extra)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token mask into ``bitmask[row]`` (a CPU int32 tensor
        ``[rows, ceil(vocab / 32)]``)."""
        if not self._matcher.is_terminated():
            self._matcher.fill_next_token_bitmask(bitmask, row)
            return
        words = torch.zeros(bitmask.shape[1], dtype=torch.int64)
        for token in self._stop:
            if token < words.numel() * 32:
                words[token // 32] |= 1 << (token % 32)
        bitmask[row] = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)

    def is_terminated(self) -> bool:
        """Whether a stop token was accepted at a point where the constraint is complete."""
        return bool(self._matcher.is_terminated())


class XGrammarBackend(StructuredOutputBackend):
    """Compiles constraints for one tokenizer with xgrammar.

    Constructed by the engine as ``cls(tokenizer, vocab_size, options=...)``;
    ``vocab_size`` is the width of the model's logits (ids past the tokenizer are
    never allowed). ``options`` is :class:`lmkit_plugins.structured.XGrammarOptions`.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, options: XGrammarOptions | None = None
                 ) -> None:
        opts = options if options is not None else XGrammarOptions()
        self.vocab_size = vocab_size
        self.whitespace_flexible = opts.whitespace_flexible
        threads = opts.compiler_threads
        try:
            self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer,
                                                                     vocab_size=vocab_size)
        except Exception as e:
            raise ValueError(
                f"xgrammar cannot use this tokenizer ({type(tokenizer).__name__}): {e}; it "
                "needs a Hugging Face tokenizer with a known vocabulary type") from e
        self.stop_token_ids = list(self.tokenizer_info.stop_token_ids)
        self.batch_matcher = xgr.BatchGrammarMatcher(
            max_threads=opts.fill_threads or default_fill_threads())
        # caching is the engine's (a bounded LRU shared by every backend)
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=threads,
                                            cache_enabled=False)

    # -- the contract ---------------------------------------------------------------

    def compile(self, kind: str, spec: Any) -> XGrammarGrammar:
        """Compile a constraint into a fresh :class:`XGrammarGrammar`."""
        return self.new_grammar(self.compile_shared(kind, spec))

    def compile_shared(self, kind: str, spec: Any) -> xgr.CompiledGrammar:
        """xgrammar's ``CompiledGrammar`` for a constraint (thread-safe, immutable).

        Raises:
            InvalidRequestError: an unknown kind, a malformed spec, or a JSON-schema
                keyword xgrammar cannot enforce; the message is xgrammar's diagnosis.
        """
        try:
            if kind in ("json", "json_object"):
                return self._compile_json(kind, spec)
            if kind == "regex":
                return self.compiler.compile_regex(_text(kind, spec))
            if kind == "grammar":
                text = _text(kind, spec)
                if "::=" in text:  # EBNF (GBNF); the start rule is ``root``
                    return self.compiler.compile_grammar(text)
                return self.compiler.compile_lark(text)
            if kind == "choice":
                return self.compiler.compile_grammar(choice_ebnf(spec))
            if kind == "structural_tag":
                return self.compiler.compile_structural_tag(spec)
        except InvalidRequestError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own types
            raise InvalidRequestError(
                f"invalid {kind} constraint (xgrammar): {_describe(e)}",
                param="structured_outputs", code="invalid_constraint") from e
        raise InvalidRequestError(
            f"the xgrammar backend does not support {kind!r} constraints; it supports json, "
            "json_object, regex, grammar (EBNF or Lark), choice and structural_tag",
            param="structured_outputs", code="unsupported_constraint")

    def new_grammar(self, shared: xgr.CompiledGrammar) -> XGrammarGrammar:
        """A fresh matcher over a compiled grammar (microseconds)."""
        return XGrammarGrammar(xgr.GrammarMatcher(shared), self.stop_token_ids)

    def shared_size_bytes(self, shared: xgr.CompiledGrammar) -> int:
        """The compiled grammar's memory (its token-mask cache, mostly)."""
        return int(shared.memory_size_bytes)

    def fill_bitmasks(self, grammars: Sequence[Grammar], bitmask: torch.Tensor,
                      rows: Sequence[int]) -> None:
        """Fill a step's rows in parallel with xgrammar's batch matcher (its own threads,
        without the GIL) when there are several; terminated grammars one by one."""
        live = [(g, r) for g, r in zip(grammars, rows, strict=True)
                if isinstance(g, XGrammarGrammar) and not g.is_terminated()]
        if len(live) < BATCH_FILL_MIN_ROWS:
            super().fill_bitmasks(grammars, bitmask, rows)
            return
        self.batch_matcher.batch_fill_next_token_bitmask(
            [g._matcher for g, _ in live], bitmask, indices=[r for _, r in live])
        done = {r for _, r in live}
        for grammar, row in zip(grammars, rows, strict=True):
            if row not in done:
                grammar.fill_bitmask(bitmask, row)

    @staticmethod
    def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                            indices: Sequence[int] | None = None) -> None:
        """xgrammar's in-place kernel: Triton on CUDA, C++ on CPU (several times faster
        than the torch version on CPU; :func:`lmkit.sample.bitmask.apply_token_bitmask`
        stays the reference)."""
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1],
                                        indices=None if indices is None else list(indices))

    # -- helpers --------------------------------------------------------------------

    def _compile_json(self, kind: str, spec: Any) -> xgr.CompiledGrammar:
        schema = JSON_OBJECT_SCHEMA if kind == "json_object" else spec
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"the json constraint is not valid JSON: {e}",
                                          param="structured_outputs",
                                          code="invalid_constraint") from None
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise InvalidRequestError(
                f"a json constraint must be a JSON schema object, got {json.dumps(schema)[:80]}",
                param="structured_outputs", code="invalid_constraint")
        bad = unsupported_keywords(schema)
        if bad:
            keyword, path, reason = bad[0]
            raise InvalidRequestError(
                f"the xgrammar backend does not support the JSON schema keyword {keyword!r} "
                f"(at {path}): {reason}; remove it from the schema",
                param="structured_outputs", code="unsupported_constraint")
        flexible = self.whitespace_flexible
        return self.compiler.compile_json_schema(
            json.dumps(rewrite_short_strings(schema)), any_whitespace=flexible,
            separators=None if flexible else COMPACT_SEPARATORS,
            # strict: no properties or items beyond the schema's (still valid output);
            # json_object allows any object
            strict_mode=kind == "json")


def default_fill_threads() -> int:
    """Mask-filling threads: a quarter of the CPU cores, 1 to 8. More would compete with
    the model's own CPU threads (with two cores, xgrammar's default halved CPU decode
    throughput), and a step's fills rarely need more."""
    return max(1, min(8, (os.cpu_count() or 1) // 4))


def choice_ebnf(spec: Any) -> str:
    """An EBNF grammar matching exactly one of the strings in ``spec``."""
    if not (isinstance(spec, list) and spec and all(isinstance(c, str) and c for c in spec)):
        raise InvalidRequestError(
            f"a choice constraint must be a non-empty list of non-empty strings, got {spec!r}",
            param="structured_outputs", code="invalid_constraint")
    return "root ::= " + " | ".join(json.dumps(c) for c in spec)


def _text(kind: str, spec: Any) -> str:
    if not isinstance(spec, str) or not spec:
        raise InvalidRequestError(f"a {kind} constraint must be a non-empty string, got "
                                  f"{spec!r}", param="structured_outputs",
                                  code="invalid_constraint")
    return spec


def _describe(e: BaseException) -> str:
    """xgrammar's error message without its log prefix, on one line."""
    lines = [_LOG_PREFIX.sub("", line).strip() for line in str(e).splitlines()]
    return " ".join(line for line in lines if line) or type(e).__name__

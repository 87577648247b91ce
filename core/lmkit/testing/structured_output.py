"""Conformance suite for structured-output backends
(:class:`lmkit.api.StructuredOutputBackend` and its :class:`~lmkit.api.Grammar`).

The backend is built over a byte-level tokenizer (one token per byte, EOS = 256; see
:mod:`lmkit.testing.tiny_model`) with ``vocab_size`` 320, so every token can be tried
at every state. For each constraint kind the spec claims (``choice``, ``regex``,
``json_schema``, ``json_object``) the suite walks the grammar's states and checks:

* ``bitmask, accept, rollback and termination per state``, by brute force over the
  whole vocabulary at every visited state: a token's bit is set in ``fill_bitmask``
  exactly when ``accept_tokens([token])`` succeeds; ids past the tokenizer are never
  allowed; only the requested bitmask row is written; a refused token changes
  nothing; ``rollback(1)`` after an accepted token restores the mask and termination;
  EOS is allowed exactly where the text so far is a complete match; accepting EOS
  terminates the grammar; a terminated grammar allows nothing but EOS;
* ``multi-token accept and rollback``: a path accepted in one call equals the same
  path token by token; a list holding a refused token is refused whole, state
  unchanged; ``rollback(n)`` returns to the start;
* ``language``: for finite constraints the set of complete strings reachable through
  the masks equals the constraint's language; for JSON, random walks through the
  masks yield only documents that parse and match the schema;
* ``invalid constraints``: a malformed regex or schema raises ``InvalidRequestError``;
* ``shared compilation and batch filling``: grammars from one ``compile_shared`` result
  (what the engine caches) start like ``compile``'s and never share state;
  ``fill_bitmasks`` writes exactly the rows one ``fill_bitmask`` per grammar would.

Use :func:`check_structured_output_backend`, or subclass
:class:`StructuredOutputConformance` and define a ``structured_output_backend``
fixture returning the spec or class.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from lmkit.errors import InvalidRequestError
from lmkit.testing.failure import (
    CONSTRUCTOR_PROPERTY,
    NotApplicable,
    Target,
    resolve_target,
    run_checks,
    skip_if_not_applicable,
)
from lmkit.testing.structured_output_cases import CASES, INVALID, Case
from lmkit.testing.tiny_model import NUM_BYTE_TOKENS, make_byte_tokenizer

SUITE = "structured output"
VOCAB_SIZE = 320  # the byte tokenizer's 257 tokens, padded like a model's embedding
EOS = NUM_BYTE_TOKENS
ROWS, ROW = 3, 1  # the bitmask has 3 rows; the suite fills row 1
SENTINEL = 0x5A5A5A5A
STATES = "bitmask, accept, rollback and termination per state"
SHARED = "shared compilation and batch filling"


class Probe:
    """One grammar under test, with brute-force views of its state."""

    def __init__(self, t: Target, prop: str, case: Case, grammar: Any) -> None:
        self.t, self.prop, self.case, self.g = t, prop, case, grammar
        self.tokens: list[int] = []  # accepted so far

    @property
    def text(self) -> str:
        """The accepted bytes as text (EOS left out)."""
        return bytes(t for t in self.tokens if t < EOS).decode("utf-8", "replace")

    def fail(self, detail: str) -> AssertionError:
        return self.t.fail(SUITE, self.prop, f"{self.case.describe()}, after {self.text!r}",
                           detail)

    def raw_mask(self) -> bytes:
        """``fill_bitmask``'s row as bytes (checking that other rows are untouched)."""
        words = -(-VOCAB_SIZE // 32)
        bitmask = torch.full((ROWS, words), SENTINEL, dtype=torch.int32)
        self.g.fill_bitmask(bitmask, ROW)
        for r in range(ROWS):
            if r != ROW and bool((bitmask[r] != SENTINEL).any()):
                raise self.fail(f"fill_bitmask(bitmask, {ROW}) also wrote row {r}")
        return bitmask[ROW].numpy().tobytes()

    def mask(self) -> frozenset[int]:
        """The allowed token ids (bit ``i % 32`` of word ``i // 32``)."""
        bits = np.unpackbits(np.frombuffer(self.raw_mask(), dtype=np.uint8), bitorder="little")
        return frozenset(np.flatnonzero(bits).tolist())

    def state(self) -> tuple[bytes, bool]:
        """The mask and termination, to compare states."""
        return self.raw_mask(), bool(self.g.is_terminated())

    def accept(self, tokens: list[int]) -> bool:
        ok = bool(self.g.accept_tokens(list(tokens)))
        if ok:
            self.tokens += tokens
        return ok

    def rollback(self, n: int) -> None:
        self.g.rollback(n)
        del self.tokens[len(self.tokens) - n:]

    def check_state(self) -> frozenset[int]:
        """Every per-state property; returns the allowed ids."""
        before = self.state()
        allowed, terminated = self.mask(), before[1]
        if any(t >= EOS + 1 for t in allowed):
            raise self.fail(f"the mask allows ids {sorted(t for t in allowed if t > EOS)[:5]} "
                            f"past the tokenizer's {EOS + 1} tokens")
        if terminated and allowed - {EOS}:
            raise self.fail(f"is_terminated() is True yet the mask allows "
                            f"{sorted(allowed - {EOS})[:8]}")
        for tok in range(EOS + 1):
            ok = self.accept([tok])
            if ok != (tok in allowed):
                raise self.fail(f"token {tok} ({_show(tok)}): accept_tokens returned {ok} but "
                                f"its bitmask bit is {int(tok in allowed)}")
            if ok:
                if tok == EOS and not self.g.is_terminated():
                    raise self.fail("accepting EOS did not make is_terminated() True")
                self.rollback(1)
                if self.state() != before:
                    raise self.fail(f"accept_tokens([{tok}]) then rollback(1) did not restore "
                                    "the mask and termination")
        if self.state() != before:
            raise self.fail("refused tokens changed the state (mask or termination)")
        eos_ok = EOS in allowed
        if eos_ok != self.case.accepts(self.text) and not terminated:
            raise self.fail(f"EOS is {'allowed' if eos_ok else 'refused'} but {self.text!r} is "
                            f"{'not ' if not self.case.accepts(self.text) else ''}a complete "
                            "match of the constraint")
        return allowed


def _show(tok: int) -> str:
    return "EOS" if tok == EOS else repr(bytes([tok]).decode("latin-1"))


def _compile(t: Target, backend: Any, prop: str, case: Case) -> Any:
    try:
        return backend.compile(case.kind, case.spec)
    except Exception as e:
        raise t.fail(SUITE, prop, case.describe(),
                     f"compile() raised {type(e).__name__}: {e}") from e


def _backend(t: Target, prop: str = "construction") -> Any:
    """The backend built as ``cls(tokenizer, vocab_size, options=opts)``."""
    return t.build(SUITE, "structured_output", prop,
                   f"the byte-level test tokenizer, vocab_size {VOCAB_SIZE}",
                   make_byte_tokenizer(), VOCAB_SIZE, options=t.options)


def _cases(t: Target) -> list[Case]:
    cases = [c for c in CASES if t.has_feature(c.feature)]
    if not cases:
        raise NotApplicable(f"{t.name} claims none of {', '.join(c.feature for c in CASES)}")
    return cases


def _explore(t: Target, prop: str, case: Case, backend: Any) -> set[str]:
    """Depth-first over every state of a finite constraint (all properties per state);
    return the complete strings found."""
    probe = Probe(t, prop, case, _compile(t, backend, prop, case))
    found: set[str] = set()
    max_len = max(map(len, case.language or {""})) + 1

    def visit(depth: int) -> None:
        allowed = probe.check_state()
        if EOS in allowed:
            found.add(probe.text)
        if depth >= max_len:
            if allowed - {EOS}:
                raise probe.fail(f"still allows {sorted(allowed - {EOS})[:8]} past the longest "
                                 "string of the language")
            return
        for tok in sorted(allowed - {EOS}):
            probe.accept([tok])
            visit(depth + 1)
            probe.rollback(1)

    visit(0)
    return found


def _walk(t: Target, prop: str, case: Case, backend: Any, seed: int) -> tuple[str, list[int]] | None:
    """A random path through the masks (all properties checked on the way); the
    complete text and its tokens, or None if it ran past 48 tokens."""
    rng = random.Random(seed)
    probe = Probe(t, prop, case, _compile(t, backend, prop, case))
    tokens: list[int] = []
    for _ in range(48):
        allowed = probe.check_state() if len(tokens) < 24 else probe.mask()
        if EOS in allowed and (len(allowed) == 1 or rng.random() < 0.5):
            return probe.text, tokens
        choices = sorted(allowed - {EOS})
        if not choices:
            raise probe.fail("the mask allows nothing (not even EOS) before termination")
        favoured = [c for c in choices if chr(c) in case.alphabet] or choices
        tok = rng.choice(favoured if rng.random() < 0.9 else choices)
        probe.accept([tok])
        tokens.append(tok)
    return None


def _language(t: Target) -> None:
    backend = _backend(t)
    for case in _cases(t):
        prop = "language"
        if case.language is not None:
            found = _explore(t, prop, case, backend)
            if found != case.language:
                raise t.fail(SUITE, prop, case.describe(),
                             f"complete strings reachable through the masks: {sorted(found)[:12]}"
                             f"; the constraint's language: {sorted(case.language)[:12]} "
                             f"(missing {sorted(case.language - found)[:6]}, extra "
                             f"{sorted(found - case.language)[:6]})")
            continue
        done = [w for w in (_walk(t, prop, case, backend, s) for s in range(12)) if w]
        if not done:
            raise t.fail(SUITE, prop, case.describe(), "12 random walks through the masks never "
                         "reached a complete document within 48 tokens")
        for text, _ in done:
            if not case.accepts(text):
                raise t.fail(SUITE, prop, case.describe(),
                             f"the masks led to the complete text {text!r}, which does not "
                             "satisfy the constraint")


def _multi_token(t: Target) -> None:
    """Accepting a whole path in one call equals accepting it token by token; a list
    with a bad token is refused whole; rollback(n) returns to the start."""
    backend = _backend(t)
    prop = "multi-token accept and rollback"
    for case in _cases(t):
        walk = None
        for seed in range(12):
            walk = _walk(t, prop, case, backend, seed)
            if walk:
                break
        if walk is None or not walk[1]:
            continue
        text, tokens = walk
        probe = Probe(t, prop, case, _compile(t, backend, prop, case))
        start = probe.state()
        if len(tokens) > 1:
            probe.accept(tokens[:1])
            refused = next(tok for tok in range(EOS) if tok not in probe.mask())
            probe.rollback(1)
            with_bad = [tokens[0], refused, *tokens[1:]]
            if probe.accept(with_bad):
                raise probe.fail(f"accept_tokens({with_bad}) accepted a list whose second "
                                 f"token {refused} the mask refuses")
            if probe.state() != start:
                raise probe.fail("a refused multi-token accept_tokens changed the state")
        if not probe.accept(tokens):
            raise probe.fail(f"accept_tokens({tokens}) refused the path {text!r} that the "
                             "masks allowed token by token")
        if EOS not in probe.mask():
            raise probe.fail(f"after accepting {text!r} in one call, EOS is not allowed")
        probe.rollback(len(tokens))
        if probe.state() != start:
            raise probe.fail(f"rollback({len(tokens)}) after accepting {text!r} in one call did "
                             "not restore the initial mask and termination")


def _invalid(t: Target) -> None:
    backend = _backend(t)
    tried = False
    for feature, (kind, spec) in INVALID.items():
        if not t.has_feature(feature):
            continue
        tried = True
        try:
            backend.compile(kind, spec)
        except InvalidRequestError:
            continue
        except Exception as e:
            raise t.fail(SUITE, "invalid constraints", f"{kind} constraint {json.dumps(spec)}",
                         f"compile() raised {type(e).__name__}: {e}; raise "
                         "lmkit.api.InvalidRequestError so that the request gets a 400") from e
        raise t.fail(SUITE, "invalid constraints", f"{kind} constraint {json.dumps(spec)}",
                     "compile() accepted a malformed constraint")
    if not tried:
        raise NotApplicable(f"{t.name} claims neither regex nor json_schema")


def _shared(t: Target) -> None:
    """Grammars made by ``new_grammar`` from one ``compile_shared`` result start like
    ``compile``'s and never share state; ``fill_bitmasks`` equals one fill per grammar."""
    backend = _backend(t)
    prop = SHARED
    for case in _cases(t):
        try:
            shared = backend.compile_shared(case.kind, case.spec)
            one, two = backend.new_grammar(shared), backend.new_grammar(shared)
        except Exception as e:
            raise t.fail(SUITE, prop, case.describe(), f"compile_shared/new_grammar raised "
                         f"{type(e).__name__}: {e}") from e
        first, second = Probe(t, prop, case, one), Probe(t, prop, case, two)
        start = Probe(t, prop, case, _compile(t, backend, prop, case)).state()
        if first.state() != start:
            raise first.fail("new_grammar(compile_shared(...)) starts in another state (mask or "
                             "termination) than compile(...)")
        walk = next((w for w in (_walk(t, prop, case, backend, s) for s in range(6)) if w), None)
        path = walk[1] if walk and walk[1] else sorted(first.mask() - {EOS})[:1]
        if not first.accept(path):
            raise first.fail(f"accept_tokens({path}) refused a path the masks allow")
        if second.state() != start:
            raise second.fail("advancing one grammar changed another made from the same "
                              "compile_shared result: they must not share state")
        words = -(-VOCAB_SIZE // 32)
        batch = torch.full((ROWS + 1, words), SENTINEL, dtype=torch.int32)
        backend.fill_bitmasks([one, two], batch, [2, 0])
        rows = {0: second.raw_mask(), 2: first.raw_mask()}
        for r in range(ROWS + 1):
            got = batch[r].numpy().tobytes()
            want = rows.get(r, torch.full((words,), SENTINEL, dtype=torch.int32).numpy().tobytes())
            if got != want:
                raise first.fail(f"fill_bitmasks([a, b], bitmask, [2, 0]) wrote row {r} "
                                 + ("differently from fill_bitmask" if r in rows else
                                    "although no grammar was given that row"))


def _checks(t: Target) -> dict[str, Callable[[], None]]:
    def states() -> None:
        backend = _backend(t)
        for case in _cases(t):
            if case.language is not None:
                _explore(t, STATES, case, backend)
            else:
                for seed in range(3):
                    _walk(t, STATES, case, backend, seed)

    return {CONSTRUCTOR_PROPERTY: lambda: _backend(t, CONSTRUCTOR_PROPERTY),
            STATES: states,
            "language": lambda: _language(t),
            "multi-token accept and rollback": lambda: _multi_token(t),
            "invalid constraints": lambda: _invalid(t),
            SHARED: lambda: _shared(t)}


def check_structured_output_backend(backend: Any, options: Any = None,
                                    only: Iterable[str] | None = None) -> dict[str, str]:
    """Run every structured-output property against ``backend`` (a Spec, Registration
    or StructuredOutputBackend subclass built as ``cls(tokenizer, vocab_size,
    options=...)``). Without a spec, every constraint kind is tested.

    :raises ConformanceFailure: naming the property, the constraint and the text so far.
    """
    t = resolve_target(backend, options)
    return run_checks(_checks(t), set(only) if only is not None else None)


class StructuredOutputConformance:
    """pytest base class: one test per structured-output property. Define a
    ``structured_output_backend`` fixture returning the spec or class."""

    def _check(self, backend: Any, prop: str) -> None:
        skip_if_not_applicable(_checks(resolve_target(backend))[prop])

    def test_constructor_signature(self, structured_output_backend: Any) -> None:
        self._check(structured_output_backend, CONSTRUCTOR_PROPERTY)

    def test_states(self, structured_output_backend: Any) -> None:
        self._check(structured_output_backend, STATES)

    def test_language(self, structured_output_backend: Any) -> None:
        self._check(structured_output_backend, "language")

    def test_multi_token_accept_and_rollback(self, structured_output_backend: Any) -> None:
        self._check(structured_output_backend, "multi-token accept and rollback")

    def test_invalid_constraints(self, structured_output_backend: Any) -> None:
        self._check(structured_output_backend, "invalid constraints")

    def test_shared_compilation_and_batch_filling(self, structured_output_backend: Any) -> None:
        self._check(structured_output_backend, SHARED)

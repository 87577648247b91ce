"""Compiling constraints into grammars, off the engine's step loop.

:class:`GrammarCompiler` owns the structured-output backend (built on first use, in a
compile thread), the :class:`~lmkit.structured.cache.GrammarCache` of shared
compilations, and the :class:`~lmkit.structured.compile_pool.CompilePool`. Each request
gets its own job that yields a fresh :class:`~lmkit.api.Grammar`: from the cache, from
a compilation of the same constraint already running (identical constraints compile
once), or compiled now. :class:`RequestGrammar` is the per-request state the job fills.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from lmkit.api.structured_output import Grammar, StructuredOutputBackend
from lmkit.errors import InvalidRequestError
from lmkit.structured.cache import GrammarCache
from lmkit.structured.compile_pool import CompileJob, CompilePool
from lmkit.structured.constraint import PARAM, Constraint

logger = logging.getLogger(__name__)


class RequestGrammar:
    """A request's structured-output state (``request.structured_output``): its
    constraint, the compile job, when the job was queued and when its compilation
    started (the time limit counts from there), and the grammar once it is ready
    (:attr:`is_ready`)."""

    __slots__ = ("constraint", "job", "queued_at", "compile_started_at", "grammar")

    def __init__(self, constraint: Constraint) -> None:
        self.constraint = constraint
        self.job: CompileJob | None = None
        self.queued_at = time.monotonic()
        self.compile_started_at: float | None = None
        self.grammar: Grammar | None = None

    @property
    def is_ready(self) -> bool:
        return self.grammar is not None

    @property
    def future(self) -> Future[Any]:
        """The compile job's future (the job is submitted right after construction)."""
        assert self.job is not None, "add_request submits the job"
        return self.job.future


class GrammarCompiler:
    """Compiles constraints through one backend in a thread pool, with a bounded cache.

    Args:
        make_backend: builds the backend (``cls(tokenizer, vocab_size, options=...)``);
            called once, in a compile thread, when the first constraint arrives.
        backend_name: the backend's registered name (for messages).
        num_threads: compilations at once.
        cache_size, cache_bytes: bounds of the cache of shared compilations.
        vocab_size: the bitmask's width; when given, a new compilation whose grammar
            allows no first token (an empty language, e.g. ``root ::= root "a"``) is
            refused as an invalid request instead of failing its request mid-generation.
    """

    def __init__(self, make_backend: Callable[[], StructuredOutputBackend], backend_name: str,
                 num_threads: int = 2, cache_size: int = 256, cache_bytes: int = 0,
                 vocab_size: int | None = None) -> None:
        self.backend_name = backend_name
        self.vocab_size = vocab_size
        self.cache = GrammarCache(cache_size, cache_bytes)
        self.pool = CompilePool(num_threads)
        self._make_backend = make_backend
        self._backend: StructuredOutputBackend | None = None
        self._backend_error: BaseException | None = None
        self._lock = threading.Lock()
        self._inflight: dict[str, Future[Any]] = {}  # constraint key -> its compilation

    def submit(self, state: RequestGrammar) -> CompileJob:
        """Start making ``state``'s grammar; the job's future yields it (or raises
        :class:`InvalidRequestError`). Sets ``state.job``."""
        state.job = self.pool.submit(self._build_grammar, state)
        return state.job

    def abandon(self, state: RequestGrammar) -> None:
        """Give up on ``state``'s job (see :meth:`CompilePool.abandon`)."""
        if state.job is not None:
            self.pool.abandon(state.job)

    def shutdown(self) -> None:
        """Stop the compile threads (a running compilation finishes in the background)."""
        self.pool.shutdown()

    def backend(self) -> StructuredOutputBackend:
        """The backend, built on first use (thread-safe); a construction error is kept
        and raised again as an :class:`InvalidRequestError` for every request."""
        with self._lock:
            if self._backend is None and self._backend_error is None:
                try:
                    self._backend = self._make_backend()
                except Exception as e:
                    logger.exception("cannot start structured-output backend %r",
                                     self.backend_name)
                    self._backend_error = e
            if self._backend_error is not None:
                error = self._backend_error
                raise InvalidRequestError(
                    f"the {self.backend_name!r} structured-output backend could not start: "
                    f"{type(error).__name__}: {error}", param=PARAM, code="backend_unavailable")
            assert self._backend is not None
            return self._backend

    def _build_grammar(self, state: RequestGrammar) -> Grammar:
        """(compile thread) A fresh grammar: the shared compilation from the cache, from
        a compilation of the same constraint already running, or compiled now. The time
        limit starts once the backend exists (building it is a one-off cost)."""
        backend = self.backend()
        state.compile_started_at = time.monotonic()
        constraint = state.constraint
        shared = self.cache.get(constraint.key)
        if shared is None:
            shared = self._compile_shared(backend, constraint)
        return backend.new_grammar(shared)

    def _compile_shared(self, backend: StructuredOutputBackend, constraint: Constraint) -> Any:
        key = constraint.key
        with self._lock:
            running = self._inflight.get(key)
            if running is None:
                if key in self.cache:
                    hit = self.cache.get(key)
                    if hit is not None:
                        return hit
                mine: Future[Any] = Future()
                self._inflight[key] = mine
        if running is not None:
            return running.result()
        try:
            shared = backend.compile_shared(constraint.kind, constraint.spec)
            self._check_not_empty(backend, shared, constraint)
            self.cache.put(key, shared, backend.shared_size_bytes(shared))
        except BaseException as e:
            mine.set_exception(e)
            raise
        else:
            mine.set_result(shared)
            return shared
        finally:
            with self._lock:
                self._inflight.pop(key, None)

    def _check_not_empty(self, backend: StructuredOutputBackend, shared: Any,
                         constraint: Constraint) -> None:
        """Refuse a compilation that accepts no output: its fresh grammar is not complete
        and allows no token, so the request could only fail once generating."""
        if self.vocab_size is None:
            return
        from lmkit.sample.bitmask import allocate_bitmask

        grammar = backend.new_grammar(shared)
        if grammar.is_terminated():
            return
        mask = allocate_bitmask(1, self.vocab_size)
        grammar.fill_bitmask(mask, 0)
        if not bool(mask.any()):
            raise InvalidRequestError(
                f"the {constraint.describe()} constraint accepts no output: its grammar "
                "allows no first token (a rule or $ref that only leads back to itself, or "
                "an empty character class); give it at least one finite match",
                param=PARAM, code="invalid_constraint")

"""The structured-output manager: grammars from admission to the last token.

A :class:`~lmkit.engine.phases.StepPhase` of the engine core (see
:class:`StructuredOutputManager`): a constrained request waits in the scheduler in
status ``WAITING_FOR_GRAMMAR`` (skipped, keeping its place) until its grammar is
compiled, so the step loop never waits for a compiler; each step the manager fills
the bitmask rows of the scheduled constrained requests; after the step it advances
their grammars with the tokens the scheduler accepted and ends those whose grammar
terminated. A grammar that raises or breaks its contract fails its own request
(:meth:`StructuredOutputManager.take_failed`); the others go on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, wait
from pathlib import Path
from typing import TYPE_CHECKING

from lmkit.api.contract import build
from lmkit.api.request import Request, RequestStatus
from lmkit.api.structured_output import Grammar, StructuredOutputBackend
from lmkit.engine.phases import StepPhase
from lmkit.errors import InvalidRequestError
from lmkit.plugin_host.faults import plugin_label, raised_in
from lmkit.spec_decode.tree import DraftTree, configured_tree
from lmkit.structured.compiler import GrammarCompiler, RequestGrammar
from lmkit.structured.constraint import PARAM, parse_constraint
from lmkit.structured.fault import explain_refused_tokens
from lmkit.structured.off import StructuredOutputOff
from lmkit.structured.rows import (
    PlainRows,
    check_accepted,
    checked_grammar,
    count_valid_drafts,
    fill_draft_rows,
)

if TYPE_CHECKING:
    from lmkit.api.outputs import EngineCoreOutput
    from lmkit.api.runner_output import ModelRunnerOutput
    from lmkit.api.scheduler import Scheduler
    from lmkit.api.scheduler_output import SchedulerOutput
    from lmkit.config.schema import LMKitConfig
    from lmkit.plugin_host.resolve import ResolvedStack

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.01  # how long an otherwise idle step waits for a compilation to finish


class StructuredOutputManager(StepPhase):
    """Compiles constraints through one backend and drives the requests' grammars.

    Args:
        scheduler: the engine's scheduler (constrained requests wait in it; the
            manager finishes those refused or whose grammar ends).
        make_backend: builds the backend, once, in a compile thread, for the first
            constraint (``cls(tokenizer, vocab_size, options=...)``).
        backend_name: the backend's registered name (for messages); ``features``: the
            constraint features its spec declares; ``vocab_size``: the logits' width.
        compile_timeout_s: how long a grammar may compile (once a thread starts on it).
        num_compile_threads: compilations at once; ``cache_size``, ``cache_bytes``:
            bounds of the LRU of compiled grammars.
        queue_timeout_s: how long a request may wait for a compile thread (default: ten
            compile timeouts, at least a minute).
        plugin: the plugin that registered the backend (for messages); ``tree``: the
            draft tree (``speculative.tree``) whose first nodes a request's drafts are.

    Step phases: :meth:`add_request`, :meth:`before_schedule` (:meth:`admit`),
    :meth:`after_schedule` (:meth:`fill_bitmask`), :meth:`after_model_output`
    (:meth:`advance`), :meth:`abort_requests`; :meth:`take_rejected` hands over the
    requests refused since.
    """

    def __init__(self, scheduler: Scheduler,
                 make_backend: Callable[[], StructuredOutputBackend], backend_name: str,
                 features: Iterable[str], vocab_size: int, compile_timeout_s: float = 30.0,
                 num_compile_threads: int = 2, cache_size: int = 256,
                 cache_bytes: int = 0, queue_timeout_s: float | None = None,
                 plugin: str | None = None, tree: DraftTree | None = None) -> None:
        self.tree, self.backend_name = tree, backend_name
        self.label = plugin_label("structured-output backend", backend_name, plugin)
        self.plain_rows = PlainRows(self.label)
        self._failed: dict[str, str] = {}  # request id -> how its grammar failed
        self.features = frozenset(features)
        self.vocab_size = vocab_size
        self.scheduler = scheduler
        self.compile_timeout_s = compile_timeout_s
        # waiting for a thread (behind runaway compilations) is bounded too
        self.queue_timeout_s = (max(60.0, 10 * compile_timeout_s) if queue_timeout_s is None
                                else queue_timeout_s)
        self.compiler = GrammarCompiler(make_backend, backend_name, num_compile_threads,
                                        cache_size, cache_bytes, vocab_size=vocab_size)
        self._pending: dict[str, Request] = {}  # waiting for their grammar, arrival order
        self._active: dict[str, Request] = {}  # grammar ready (request.structured_output)
        self._drafting: dict[str, Request] = {}  # ready requests that may get drafts
        self._idle = False  # the last step scheduled nothing
        self._rejected: list[tuple[str, InvalidRequestError]] = []
        self.num_compile_timeouts = 0
        self.num_drafts_trimmed = 0

    @classmethod
    def from_stack(cls, config: LMKitConfig, stack: ResolvedStack, model_dir: Path,
                   vocab_size: int, scheduler: Scheduler) -> StepPhase:
        """The manager for the stack's structured-output backend, or (off) a phase that
        refuses constrained requests; the backend and tokenizer load on first use."""
        reg = stack.get("structured_output")
        if reg is None:
            return StructuredOutputOff(config)
        section = config.structured_output
        options = stack.options.get("structured_output")

        def make_backend() -> StructuredOutputBackend:
            from lmkit.loading.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(Path(model_dir), config.model.tokenizer)
            return build("structured_output", reg.spec.load(), tokenizer,
                         vocab_size, options=options, plugin=reg.origin)

        return cls(scheduler, make_backend, reg.name, reg.spec.caps.features, vocab_size,
                   compile_timeout_s=section.compile_timeout_s,
                   num_compile_threads=section.num_compile_threads,
                   cache_size=section.grammar_cache_size,
                   cache_bytes=int(section.grammar_cache_mb * 2**20), plugin=reg.origin,
                   tree=configured_tree(config.speculative))

    # -- requests in ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """For a constrained request (just queued in the scheduler): validate its
        constraint, start compiling it and set it ``WAITING_FOR_GRAMMAR`` (``WAITING``
        by :meth:`admit` once its grammar is ready). Others pass.

        Raises:
            InvalidRequestError: a malformed constraint, a kind this backend does not
                support, or an id already waiting here.
        """
        if request.sampling_params.structured_outputs is None:
            return
        constraint = parse_constraint(request.sampling_params.structured_outputs or {})
        if constraint.feature not in self.features:
            raise InvalidRequestError(
                f"the {self.backend_name!r} structured-output backend does not support "
                f"{constraint.feature} constraints (it supports: "
                f"{', '.join(sorted(self.features)) or 'none'}); use another constraint, or "
                "choose a backend that has it with structured_output.backend",
                param=PARAM, code="unsupported_constraint")
        rid = request.request_id
        if rid in self._pending or rid in self._active:
            raise InvalidRequestError(f"request id {rid!r} is already in use", param="request_id",
                                      code="duplicate_request_id")
        state = RequestGrammar(constraint)
        self.compiler.submit(state)
        request.structured_output = state
        request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self._pending[rid] = request

    def has_pending(self) -> bool:
        """Whether any request waits for its grammar."""
        return bool(self._pending)

    def before_schedule(self) -> None:
        """Requests whose grammar became ready may be scheduled (:meth:`admit`); after
        a step that scheduled nothing, wait a little for a compilation first."""
        self.admit(idle=self._idle)

    def admit(self, idle: bool = False) -> list[Request]:
        """Let requests whose grammar is ready be scheduled (``WAITING``); refuse
        (finish) those whose compilation failed or overran ``compile_timeout_s``. With
        ``idle`` (nothing else to run), first wait up to :data:`IDLE_WAIT_S` for a
        compilation to end. Returns the requests made ready."""
        admitted: list[Request] = []
        if not self._pending:
            return admitted
        if idle:
            wait([r.structured_output.future for r in self._pending.values()],
                 timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        now = time.monotonic()
        for rid, request in list(self._pending.items()):
            state: RequestGrammar = request.structured_output
            future = state.future
            if future.done():
                del self._pending[rid]
                try:
                    state.grammar = checked_grammar(future.result(), self.label,
                                                    state.constraint.describe())
                except InvalidRequestError as e:
                    self._reject(request, e)
                    continue
                except Exception as e:  # a backend bug: this request fails, the engine goes on
                    logger.exception("structured-output backend %r failed", self.backend_name)
                    self._reject(request, InvalidRequestError(
                        f"the {self.backend_name!r} backend failed to compile the "
                        f"{state.constraint.describe()} constraint: {type(e).__name__}: {e}",
                        param=PARAM, code="constraint_compile_failed"))
                    continue
                request.status = RequestStatus.WAITING
                self._active[rid] = request
                if request.sampling_params.use_spec_decode:
                    self._drafting[rid] = request
                admitted.append(request)
            else:
                error = self._overdue(state, now)
                if error is not None:
                    del self._pending[rid]
                    self.compiler.abandon(state)
                    self._reject(request, error)
        return admitted

    def _overdue(self, state: RequestGrammar, now: float) -> InvalidRequestError | None:
        """The refusal of a compilation past ``compile_timeout_s`` (timed from its start),
        or queued past ``queue_timeout_s`` behind others; ``None`` while in time."""
        started = state.compile_started_at
        if started is not None and now - started > self.compile_timeout_s:
            self.num_compile_timeouts += 1
            return InvalidRequestError(
                f"compiling the {state.constraint.describe()} constraint took longer than "
                f"structured_output.compile_timeout_s = {self.compile_timeout_s:g}s; "
                "simplify it (fewer string patterns, smaller bounds) or raise the limit",
                param=PARAM, code="constraint_compile_timeout")
        if started is None and now - state.queued_at > self.queue_timeout_s:
            return InvalidRequestError(
                f"the grammar compiler is busy ({self.compiler.pool.num_abandoned} "
                "compilations overran their time limit and still run); the "
                f"{state.constraint.describe()} "
                f"constraint waited {self.queue_timeout_s:g}s for a compile thread; retry later",
                param=PARAM, code="constraint_compile_busy")
        return None

    def take_rejected(self) -> list[tuple[str, InvalidRequestError]]:
        """``(request id, error)`` of every request refused since the last call (they
        were never scheduled and produce no output)."""
        rejected, self._rejected = self._rejected, []
        return rejected

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Forget these requests (waiting or admitted); unknown ids are ignored."""
        for rid in request_ids:
            request = self._pending.pop(rid, None)
            if request is not None:
                request.structured_output.future.cancel()
            self._active.pop(rid, None)
            self._drafting.pop(rid, None)

    # -- one step ---------------------------------------------------------------------

    def after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        """Fill the planned step's bitmask (:meth:`fill_bitmask`)."""
        self._idle = not scheduler_output.total_num_scheduled_tokens
        self.fill_bitmask(scheduler_output)

    def after_model_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput,
                           outputs: list[EngineCoreOutput]) -> None:
        """Advance grammars over the step's accepted tokens (:meth:`advance`)."""
        self.advance(outputs)

    def fill_bitmask(self, scheduler_output: SchedulerOutput) -> None:
        """Fill ``grammar_bitmask`` and ``structured_output_request_ids`` of a planned
        step: each scheduled constrained request gets ``1 + len(drafts)`` rows from
        ``structured_output_request_ids[req_id]`` (row ``j``: the mask after its first
        ``j`` drafts, or with a tree after the path to node ``j``; see
        :mod:`lmkit.structured.rows`)."""
        from lmkit.sample.bitmask import allocate_bitmask

        scheduled = [(rid, self._active[rid].structured_output)
                     for rid in scheduler_output.num_scheduled_tokens if rid in self._active]
        if not scheduled:
            return
        spec = scheduler_output.scheduled_spec_decode_tokens
        num_rows = sum(1 + len(spec.get(rid) or ()) for rid, _ in scheduled)
        bitmask = allocate_bitmask(num_rows, self.vocab_size)
        row = 0
        plain: list[Grammar] = []  # requests without drafts: filled in one backend call
        plain_rows: list[int] = []
        plain_ids: list[str] = []
        for rid, state in scheduled:
            drafts = spec.get(rid) or []
            scheduler_output.structured_output_request_ids[rid] = row
            assert state.grammar is not None, "an admitted request has its grammar"
            if drafts:
                try:
                    fill_draft_rows(state.grammar, bitmask, row, drafts, self.tree)
                except Exception as e:
                    self._fault(rid, e, f"filling the bitmask rows of {len(drafts)} drafts")
            else:
                plain.append(state.grammar)
                plain_rows.append(row)
                plain_ids.append(rid)
            row += 1 + len(drafts)
        if plain:
            errors = self.plain_rows.fill(self.compiler.backend(), plain, bitmask, plain_rows)
            for i, error in errors.items():
                self._fault(plain_ids[i], error, "filling its bitmask row")
        scheduler_output.grammar_bitmask = bitmask

    def advance(self, outputs: list[EngineCoreOutput]) -> None:
        """Advance grammars over the tokens each output appended; a request whose
        grammar terminated without the scheduler stopping it ends now (``stop``). One
        whose grammar refuses its tokens ends with an error (even when the scheduler
        just stopped it: its last token is not valid output), marked as the request's
        own fault when its parameters left no token to sample
        (:func:`~lmkit.structured.fault.explain_refused_tokens`)."""
        for out in outputs:
            request = self._active.get(out.request_id)
            if request is None:
                continue
            try:
                self._advance_one(out, request)
            except Exception as e:
                self._fault(out.request_id, e, "advancing over the step's tokens")
                continue
            if out.finish_reason is not None:
                del self._active[out.request_id]
                self._drafting.pop(out.request_id, None)

    def _advance_one(self, out: EngineCoreOutput, request: Request) -> None:
        state: RequestGrammar = request.structured_output
        grammar = state.grammar
        assert grammar is not None
        new = list(out.new_token_ids)
        if new and not check_accepted(grammar.accept_tokens(new), grammar):
            refusal = explain_refused_tokens(grammar, request, list(out.new_token_ids),
                                             state.constraint.describe(), self.vocab_size)
            if refusal.code is None:
                logger.error("request %s: %s", out.request_id, refusal.message)
            else:  # the request's own doing: no engine error to log loudly
                logger.info("request %s: %s", out.request_id, refusal.message)
            self.scheduler.finish_requests(out.request_id, RequestStatus.FINISHED_ERROR)
            out.finish_reason, out.stop_reason = "error", refusal.message
            out.error_code, out.error_param = refusal.code, refusal.param
        elif out.finish_reason is None and grammar.is_terminated():
            self.scheduler.finish_requests(out.request_id, RequestStatus.FINISHED_STOPPED)
            out.finish_reason = RequestStatus.FINISHED_STOPPED.finish_reason

    def num_valid_draft_tokens(self, request_id: str, draft_token_ids: list[int]) -> int:
        """How many leading ``draft_token_ids`` the request's grammar allows (all of them
        for an unconstrained request); the grammar is left as it was. A proposer's
        drafts can be cut to this before they are scheduled, so that no verification
        slot is spent on a token the grammar forbids."""
        request = self._active.get(request_id)
        grammar = None if request is None else request.structured_output.grammar
        if grammar is None:
            return len(draft_token_ids)
        try:
            return count_valid_drafts(grammar, draft_token_ids)
        except Exception as e:
            self._fault(request_id, e, f"checking {len(draft_token_ids)} draft tokens")
            return 0

    def trim_draft_tokens(self) -> int:
        """Cut every constrained request's draft tokens (``spec_token_ids``, set by a
        proposer) to what its grammar allows, so that no verification slot is spent on
        a forbidden token; returns how many drafts were dropped."""
        dropped = 0
        for rid, request in list(self._drafting.items()):
            drafts = request.spec_token_ids
            if drafts:
                keep = self.num_valid_draft_tokens(rid, drafts)
                if keep < len(drafts):
                    request.spec_token_ids = drafts[:keep]
                    dropped += len(drafts) - keep
        self.num_drafts_trimmed += dropped
        return dropped

    # -- housekeeping -----------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Counters for metrics: waiting for grammars, constrained requests running,
        compile timeouts, abandoned compile threads, and the grammar cache's."""
        return {"num_grammars_compiling": len(self._pending),
                "num_constrained_requests": len(self._active),
                "grammar_compile_timeouts": self.num_compile_timeouts,
                "grammar_drafts_trimmed": self.num_drafts_trimmed,
                "grammar_compile_threads_abandoned": self.compiler.pool.num_abandoned,
                **self.compiler.cache.stats()}

    def shutdown(self) -> None:
        """Stop the compile threads (a running compilation finishes in the background)."""
        self.compiler.shutdown()

    def take_failed(self) -> dict[str, str]:
        """Requests whose grammar raised or broke its contract since the last call."""
        failed, self._failed = self._failed, {}
        return failed

    def _fault(self, rid: str, error: Exception, doing: str) -> None:
        """Stop serving a request whose grammar failed (the engine ends it)."""
        message = raised_in(self.label, error, doing)
        logger.error("request %s: %s", rid, message, exc_info=error)
        self._active.pop(rid, None)
        self._drafting.pop(rid, None)
        self._failed.setdefault(rid, message)

    def _reject(self, request: Request, error: InvalidRequestError) -> None:
        self.scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR)
        self._rejected.append((request.request_id, error))

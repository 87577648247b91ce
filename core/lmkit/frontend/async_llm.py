"""``AsyncLLM``: the asyncio frontend of an engine core running in its own process.

Tokenization and chat templates (:class:`InputProcessor`), the ``n > 1`` fan-out, and
detokenization and stop strings (:class:`OutputProcessor`) happen here, in the API
process, so they never stall the engine's step loop. One background task per engine
reads its outputs and hands them to per-request :class:`OutputCollector` s through
:class:`~lmkit.frontend.in_flight.InFlight`, the bookkeeping of the requests in flight.

With ``parallel.data_parallel_size`` N > 1 there are N engine processes
(:mod:`lmkit.frontend.engine_set`, started in parallel); each request is routed to one
of them (:mod:`lmkit.frontend.router`: prefix affinity, then load) and stays there, its
aborts included. When an engine process dies, every request in flight *on it* fails at
once with :class:`~lmkit.errors.EngineDeadError`, :attr:`AsyncLLM.is_healthy` turns
false, and new requests go to the engines still alive (:attr:`AsyncLLM.can_serve`);
:meth:`AsyncLLM.restart_engine` starts a new one in its place
(:mod:`lmkit.serve.supervisor` decides when).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from lmkit.api.outputs import EngineCoreOutput, OutputKind, PoolingOutput, RequestOutput
from lmkit.api.pooling import PoolingParams
from lmkit.api.sampling_params import SamplingParams
from lmkit.config.schema import LMKitConfig
from lmkit.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineOutputs,
    EngineReady,
    EngineStats,
    RequestRejected,
    StatsQuery,
)
from lmkit.errors import EngineDeadError, InvalidRequestError, LMKitError
from lmkit.frontend.collector import OutputCollector, RequestObserver
from lmkit.frontend.core_client import EngineCoreClient
from lmkit.frontend.engine_set import EngineSet, EngineSlot, engine_launches, start_engines
from lmkit.frontend.in_flight import InFlight

logger = logging.getLogger(__name__)

# longer text is tokenized in a thread (about 1 ms of encoding per 1,000 characters)
TOKENIZE_INLINE_CHARS = 100_000
# the output loop lets the event loop run after at most this long delivering outputs:
# streams send what their requests got so far, and each chunk carries every token
# delivered since (an H200 serving 256 streams of a small model went seconds between
# two chunks of one stream while the loop drained a backlog that never emptied)
OUTPUT_SLICE_S = 0.01


class RequestAbortedError(LMKitError):
    """The request was aborted through :meth:`AsyncLLM.abort` while being consumed."""


class AsyncLLM:
    """Submit requests and stream their outputs; the engine runs in another process.

    Build it with ``await AsyncLLM.start(config)``; close it with ``await shutdown()``.
    ``engines`` is one engine's client (with its ``ready``) or the started engines.
    """

    def __init__(self, engines: EngineCoreClient | list[EngineSlot], ready: EngineReady,
                 config: LMKitConfig, tokenizer: Any, observer: RequestObserver | None = None,
                 env: dict[str, str] | None = None) -> None:
        from lmkit.frontend.output_processor import OutputProcessor
        from lmkit.frontend.processor import InputProcessor

        if isinstance(engines, EngineCoreClient):
            engines = [EngineSlot(0, engines, ready, stats=dict(ready.stats))]
        self.engines = EngineSet(engines, config.cache.block_size)
        self.ready = ready
        self.config = config
        self.tokenizer = tokenizer
        self.observer = observer
        self.input_processor = InputProcessor(
            tokenizer, ready.max_model_len, ready.vocab_size, ready.eos_token_ids,
            max_constraint_chars=config.structured_output.max_constraint_chars,
            logits_processors=ready.logits_processors)
        self.output_processor = OutputProcessor(tokenizer)
        self.in_flight = InFlight(self.output_processor)
        self._query_ids = itertools.count(1)
        self._background: set[asyncio.Task[None]] = set()
        self._shutting_down = False
        self._env = env

    @classmethod
    async def start(cls, config: LMKitConfig, *, observer: RequestObserver | None = None,
                    startup_timeout: float | None = None,
                    env: dict[str, str] | None = None) -> AsyncLLM:
        """Start the engine-core process(es) in parallel, wait until they are ready, load
        the tokenizer. Raises :class:`~lmkit.errors.ConfigError` (before anything starts)
        when the data-parallel engines need more devices than present, and
        :class:`~lmkit.frontend.core_client.EngineStartupError` naming the engine that
        failed."""
        from lmkit.loading.tokenizer import check_tokenizer_setting, load_tokenizer

        check_tokenizer_setting(config.model.tokenizer)  # before any engine starts
        slots = await start_engines(engine_launches(config, env), startup_timeout)
        try:
            tokenizer = await asyncio.to_thread(load_tokenizer, slots[0].ready.model_dir,
                                                config.model.tokenizer)
        except BaseException:
            await asyncio.gather(*(s.client.close(kill=True) for s in slots))
            raise
        llm = cls(slots, slots[0].ready, config, tokenizer, observer, env)
        llm._start_output_loops()
        return llm

    def _start_output_loops(self) -> None:
        for slot in self.engines.slots:
            if slot.loop_task is None:
                slot.loop_task = asyncio.create_task(
                    self._output_loop(slot.index), name=f"lmkit-engine-outputs-{slot.index}")

    async def restart_engine(self, startup_timeout: float | None = None,
                             engine: int = 0) -> None:
        """Replace dead engine process ``engine`` with a new one (same configuration,
        devices and tokenizer).

        Its requests in flight have already failed; raises
        :class:`~lmkit.frontend.core_client.EngineStartupError` if the new one fails to start.
        """
        if self.engines.slots[engine].is_alive() or self._shutting_down:
            raise RuntimeError("restart_engine needs a dead engine and a running frontend")
        launch = engine_launches(self.config, self._env)[engine]
        slot = await self.engines.replace(launch, startup_timeout)
        if engine == 0:
            self.ready = slot.ready
        self._start_output_loops()

    async def wait_engine_death(self, engine: int = 0) -> None:
        """Return once engine ``engine``'s current process has died (or failed)."""
        await self.engines.slots[engine].died.wait()

    # ------------------------------------------------------------------ facts

    @property
    def max_model_len(self) -> int:
        return self.ready.max_model_len

    @property
    def client(self) -> EngineCoreClient:
        """The first engine's channel (the only one without data parallelism)."""
        return self.engines.slots[0].client

    @property
    def num_engines(self) -> int:
        """Engine processes behind this frontend (``parallel.data_parallel_size``)."""
        return len(self.engines)

    def engine_alive(self, engine: int) -> bool:
        """True while engine ``engine``'s process runs."""
        return self.engines.slots[engine].is_alive()

    @property
    def is_healthy(self) -> bool:
        """True while every engine process runs and answers."""
        return not self._shutting_down and all(self.engines.alive())

    @property
    def can_serve(self) -> bool:
        """True while at least one engine runs (new requests are routed to those)."""
        return not self._shutting_down and any(self.engines.alive())

    @property
    def dead_reason(self) -> str | None:
        """Why the dead engine(s) died, naming them when there are several."""
        return self.engines.dead_reason()

    @property
    def engine_pid(self) -> int | None:
        """The first engine's process id."""
        return self.client.pid

    @property
    def stats(self) -> dict[str, float]:
        """The first engine's latest stats (every engine's: :attr:`engine_stats`)."""
        return self.engines.slots[0].stats

    @property
    def engine_stats(self) -> list[dict[str, float]]:
        """Each engine's latest ``EngineCore.stats()`` (empty while it is dead)."""
        return [s.stats for s in self.engines.slots]

    @property
    def num_in_flight(self) -> int:
        """Parent requests submitted and not yet finished."""
        return len(self.in_flight)

    # ------------------------------------------------------------------ requests

    async def generate(self, prompt: str | list[int] | None, params: SamplingParams, *,
                       messages: list[dict[str, Any]] | None = None,
                       request_id: str | None = None, priority: int = 0,
                       chat_kwargs: dict[str, Any] | None = None, observe: bool = True,
                       engine: int | None = None, output_kind: OutputKind = "cumulative"
                       ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes: by default its cumulative output
        (with per-step deltas) at each step; ``output_kind`` ``"delta"`` gives only each
        step's new part, ``"final"`` one output at the end (both cost less than the
        default, whose copies grow; see :data:`~lmkit.api.outputs.OutputKind`). An
        unknown kind raises ``ValueError``.

        ``observe=False`` keeps the request out of the metrics (warm-up); ``engine`` pins
        the request to one engine instead of routing it (warm-up, tests).

        Raises :class:`InvalidRequestError` for a bad request (before or after it reaches
        the engine) and :class:`EngineDeadError` if the engine dies. Closing the iterator
        early (e.g. the client went away) aborts the request and frees its KV blocks.
        """
        from lmkit.frontend.processor import child_params

        if not self.can_serve:
            raise EngineDeadError(self.dead_reason or "the engine is shutting down")
        rid = request_id or uuid.uuid4().hex
        if self.in_flight.holds(rid):
            raise InvalidRequestError(f"request id {rid!r} is already in use",
                                      param="request_id", code="duplicate_request_id")
        text, ids = await self._tokenize(prompt, messages, chat_kwargs)
        if params.n == 1:
            requests = [(self.input_processor.make_request(rid, ids, params, priority), 0)]
        else:
            requests = [(self.input_processor.make_request(
                f"{rid}-{i}", ids, child_params(params, i), priority), i)
                for i in range(params.n)]
        chosen = self.engines.route(rid, ids, len(ids) * params.n, engine)
        collector = OutputCollector(len(ids), self.observer if observe else None,
                                    kind=output_kind)
        self.in_flight.add(rid, collector, requests, text, params.n, output_kind)
        finished = False
        try:
            client = self.engines.slots[chosen].client
            for req, _ in requests:
                await client.send(AddRequest.from_request(req))
            while True:
                output = await collector.get()
                finished = output.finished
                yield output
                if finished:
                    return
        except EngineDeadError:
            collector.observe_end("error")
            raise
        except InvalidRequestError:
            collector.discard()  # the HTTP layer counts it as an invalid request
            raise
        finally:
            if not finished:
                collector.observe_end("abort")
            await self._forget(rid, abort=not finished)

    async def embed(self, prompt: str | list[int], params: PoolingParams, *,
                    request_id: str | None = None, priority: int = 0,
                    engine: int | None = None) -> PoolingOutput:
        """Run one pooling request (prefill only, beside generation in the same engine
        steps) and return its pooled output. Raises as :meth:`generate` does (``engine``
        as there); cancelling the call aborts the request."""
        if not self.can_serve:
            raise EngineDeadError(self.dead_reason or "the engine is shutting down")
        rid = request_id or uuid.uuid4().hex
        if self.in_flight.holds(rid):
            raise InvalidRequestError(f"request id {rid!r} is already in use",
                                      param="request_id", code="duplicate_request_id")
        _, ids = await self._tokenize(prompt, None, None)
        request = self.input_processor.make_pooling_request(rid, ids, params, priority)
        index = self.engines.route(rid, ids, len(ids), engine)
        result: asyncio.Future[EngineCoreOutput] = asyncio.get_running_loop().create_future()
        self.in_flight.pooling[rid] = result
        try:
            await self.engines.slots[index].client.send(AddRequest.from_request(request))
            out = await result
        except BaseException:
            if not result.done():
                await self._send_abort([rid], index)
            raise
        finally:
            self.in_flight.pooling.pop(rid, None)
            self.engines.release(rid)
        if out.pooled is None:
            raise InvalidRequestError(f"the engine ended pooling request {rid!r} without a "
                                      f"result ({out.finish_reason})", code="engine_error")
        return PoolingOutput(rid, ids, out.pooled)

    async def _tokenize(self, prompt: str | list[int] | None,
                        messages: list[dict[str, Any]] | None,
                        chat_kwargs: dict[str, Any] | None) -> tuple[str | None, list[int]]:
        """Tokenize inline, or in a thread when the text is long: a 4 MB prompt takes
        seconds to encode (the fast tokenizer releases the GIL meanwhile), and on the
        event loop it would stall every other request."""
        size = len(prompt) if isinstance(prompt, str) else sum(
            len(str(m.get("content") or "")) for m in messages or ())
        if size < TOKENIZE_INLINE_CHARS:
            return self.input_processor.tokenize(prompt, messages, chat_kwargs)
        return await asyncio.to_thread(self.input_processor.tokenize, prompt, messages,
                                       chat_kwargs)

    async def abort(self, request_id: str) -> None:
        """Abort a request by the id given to :meth:`generate` (no-op when finished)."""
        collector = self.in_flight.collectors.get(request_id)
        if collector is not None:
            collector.fail(RequestAbortedError(f"request {request_id!r} was aborted"))
        await self._forget(request_id, abort=True)

    async def _forget(self, rid: str, abort: bool) -> None:
        index = self.engines.release(rid)
        engine_ids = self.in_flight.forget(rid)
        if abort and engine_ids and index is not None:
            await self._send_abort(engine_ids, index)

    async def _send_abort(self, engine_ids: list[str], engine: int) -> None:
        client = self.engines.slots[engine].client
        if client.is_alive():
            with contextlib.suppress(EngineDeadError):
                await client.send(AbortRequests(request_ids=engine_ids))

    async def get_stats(self, timeout: float = 10.0, engine: int = 0) -> dict[str, float]:
        """Fresh ``EngineCore.stats()`` from engine ``engine``'s process."""
        qid = next(self._query_ids)
        fut: asyncio.Future[dict[str, float]] = asyncio.get_running_loop().create_future()
        self.in_flight.stats_waiters[qid] = fut
        try:
            await self.engines.slots[engine].client.send(StatsQuery(query_id=qid))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.in_flight.stats_waiters.pop(qid, None)

    # ------------------------------------------------------------------ output loop

    async def _output_loop(self, index: int = 0) -> None:
        slot = self.engines.slots[index]
        loop = asyncio.get_running_loop()
        last_yield = loop.time()
        try:
            while True:
                message = await slot.client.recv()  # returns at once while a backlog waits
                if isinstance(message, EngineOutputs):
                    self._deliver(message, index)
                    if loop.time() - last_yield >= OUTPUT_SLICE_S:
                        # behind a busy engine the backlog never empties: let the streams
                        # (and new requests) run, or they would wait until it does
                        await asyncio.sleep(0)
                        last_yield = loop.time()
                elif isinstance(message, EngineStats):
                    slot.stats = message.stats
                    self.in_flight.answer_stats(message.query_id, message.stats)
                elif isinstance(message, RequestRejected):
                    rid = self.in_flight.reject(message)
                    if rid is not None:
                        await self._forget(rid, abort=True)
        except EngineDeadError as e:
            error = e if len(self.engines) == 1 else EngineDeadError(f"engine {index}: {e}")
            if not self._shutting_down:
                logger.error("engine core %d died: %s; failing %d requests in flight on it",
                             index, e, len(self.engines.requests_on(index)))
            self._fail_engine(index, error)
        except Exception as e:  # a bug here must not leave requests hanging
            logger.exception("the engine output loop failed")
            self._fail_engine(index, EngineDeadError(f"the frontend's output loop failed: {e!r}"))
            await slot.client.close(kill=True)
        slot.stats = {}  # a dead engine runs nothing: no stale gauges
        self.engines.router.forget_engine(index)
        slot.died.set()

    def _deliver(self, message: EngineOutputs, index: int = 0) -> None:
        abort_ids = self.in_flight.deliver(message)
        if abort_ids:  # stop strings matched: the engine need not go on
            task = asyncio.get_running_loop().create_task(self._send_abort(abort_ids, index))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _fail_engine(self, index: int, error: BaseException) -> None:
        """Fail every request routed to engine ``index`` (stats queries: all of them,
        which cannot tell engines apart and are retried by their callers)."""
        self.in_flight.fail(list(self.engines.requests_on(index)), error)
        if len(self.engines) == 1:  # (all the same: nothing else waits on another engine)
            self.in_flight.fail_all(error)

    # ------------------------------------------------------------------ lifecycle

    @property
    def is_shutting_down(self) -> bool:
        """True once :meth:`shutdown` has begun."""
        return self._shutting_down

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Fail what is still in flight, stop the engine process, close the channel."""
        self._shutting_down = True
        self.in_flight.fail_all(EngineDeadError("the server is shutting down"))
        await self.engines.close(timeout)

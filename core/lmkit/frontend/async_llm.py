"""``AsyncLLM``: the asyncio frontend of an engine core running in its own process.

Tokenization and chat templates (:class:`InputProcessor`), the ``n > 1`` fan-out, and
detokenization and stop strings (:class:`OutputProcessor`) happen here, in the API
process, so they never stall the engine's step loop. One background task reads the
engine's outputs and hands them to per-request :class:`OutputCollector` s. When the
engine process dies, every request in flight fails at once with
:class:`~lmkit.errors.EngineDeadError` and :attr:`AsyncLLM.is_healthy` turns false;
:meth:`AsyncLLM.restart_engine` starts a new one (:mod:`lmkit.serve.supervisor` decides
when).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from lmkit.api.outputs import RequestOutput
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
from lmkit.frontend.core_client import EngineCoreClient, engine_config_json

logger = logging.getLogger(__name__)

# longer text is tokenized in a thread (about 1 ms of encoding per 1,000 characters)
TOKENIZE_INLINE_CHARS = 100_000


class RequestAbortedError(LMKitError):
    """The request was aborted through :meth:`AsyncLLM.abort` while being consumed."""


class AsyncLLM:
    """Submit requests and stream their outputs; the engine runs in another process.

    Build it with ``await AsyncLLM.start(config)``; close it with ``await shutdown()``.
    """

    def __init__(self, client: EngineCoreClient, ready: EngineReady, config: LMKitConfig,
                 tokenizer: Any, observer: RequestObserver | None = None,
                 env: dict[str, str] | None = None) -> None:
        from lmkit.frontend.output_processor import OutputProcessor
        from lmkit.frontend.processor import InputProcessor

        self.client = client
        self.ready = ready
        self.config = config
        self.tokenizer = tokenizer
        self.observer = observer
        self.input_processor = InputProcessor(
            tokenizer, ready.max_model_len, ready.vocab_size, ready.eos_token_ids,
            max_constraint_chars=config.structured_output.max_constraint_chars,
            logits_processors=ready.logits_processors)
        self.output_processor = OutputProcessor(tokenizer)
        self.stats: dict[str, float] = dict(ready.stats)
        self._collectors: dict[str, OutputCollector] = {}
        self._parent_of: dict[str, str] = {}  # engine request id -> parent id
        self._children: dict[str, list[str]] = {}  # parent id -> engine request ids
        self._stats_waiters: dict[int, asyncio.Future[dict[str, float]]] = {}
        self._query_ids = itertools.count(1)
        self._loop_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._shutting_down = False
        self._env = env
        self._engine_died = asyncio.Event()

    @classmethod
    async def start(cls, config: LMKitConfig, *, observer: RequestObserver | None = None,
                    startup_timeout: float | None = None,
                    env: dict[str, str] | None = None) -> AsyncLLM:
        """Start the engine-core process, wait until it is ready, load the tokenizer."""
        from lmkit.loading.tokenizer import load_tokenizer

        client, ready = await _start_client(config, env, startup_timeout)
        try:
            tokenizer = await asyncio.to_thread(load_tokenizer, ready.model_dir)
        except BaseException:
            await client.close(kill=True)
            raise
        llm = cls(client, ready, config, tokenizer, observer, env)
        llm._loop_task = asyncio.create_task(llm._output_loop(), name="lmkit-engine-outputs")
        return llm

    async def restart_engine(self, startup_timeout: float | None = None) -> None:
        """Replace a dead engine process with a new one (same configuration and tokenizer).

        Requests in flight have already failed; raises
        :class:`~lmkit.frontend.core_client.EngineStartupError` if the new one fails to start.
        """
        if self.client.is_alive() or self._shutting_down:
            raise RuntimeError("restart_engine needs a dead engine and a running frontend")
        if self._loop_task is not None:
            await asyncio.gather(self._loop_task, return_exceptions=True)
        await self.client.close(kill=True)
        client, ready = await _start_client(self.config, self._env, startup_timeout)
        self.client, self.ready, self.stats = client, ready, dict(ready.stats)
        self._engine_died.clear()
        self._loop_task = asyncio.create_task(self._output_loop(), name="lmkit-engine-outputs")

    async def wait_engine_death(self) -> None:
        """Return once the current engine process has died (or failed)."""
        await self._engine_died.wait()

    async def warm_up(self, max_tokens: int = 4) -> None:
        """Run one short request through the whole path (chat template, tokenizer, engine
        prefill and decode, detokenizer), so that the first request's one-time costs
        (lazy imports and set-up, first-call allocations, kernels built on first use)
        are paid before the server reports ready. Not counted in the metrics."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        has_template = getattr(self.tokenizer, "chat_template", None) is not None
        messages = [{"role": "user", "content": "Hello!"}] if has_template else None
        async for _ in self.generate(None if has_template else "Hello!", params,
                                     messages=messages, request_id=f"warm-up-{uuid.uuid4().hex}",
                                     observe=False):
            pass

    # ------------------------------------------------------------------ facts

    @property
    def max_model_len(self) -> int:
        return self.ready.max_model_len

    @property
    def is_healthy(self) -> bool:
        """True while the engine process runs and answers."""
        return not self._shutting_down and self.client.is_alive()

    @property
    def dead_reason(self) -> str | None:
        return self.client.dead_reason

    @property
    def engine_pid(self) -> int | None:
        return self.client.pid

    @property
    def num_in_flight(self) -> int:
        """Parent requests submitted and not yet finished."""
        return len(self._collectors)

    # ------------------------------------------------------------------ requests

    async def generate(self, prompt: str | list[int] | None, params: SamplingParams, *,
                       messages: list[dict[str, Any]] | None = None,
                       request_id: str | None = None, priority: int = 0,
                       chat_kwargs: dict[str, Any] | None = None, observe: bool = True
                       ) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative output (with per-step deltas) until it finishes.

        ``observe=False`` keeps the request out of the metrics (warm-up).

        Raises :class:`InvalidRequestError` for a bad request (before or after it reaches
        the engine) and :class:`EngineDeadError` if the engine dies. Closing the iterator
        early (e.g. the client went away) aborts the request and frees its KV blocks.
        """
        from lmkit.frontend.processor import child_params

        if not self.is_healthy:
            raise EngineDeadError(self.dead_reason or "the engine is shutting down")
        rid = request_id or uuid.uuid4().hex
        if rid in self._collectors:
            raise InvalidRequestError(f"request id {rid!r} is already in use",
                                      param="request_id", code="duplicate_request_id")
        text, ids = await self._tokenize(prompt, messages, chat_kwargs)
        if params.n == 1:
            requests = [(self.input_processor.make_request(rid, ids, params, priority), 0)]
        else:
            requests = [(self.input_processor.make_request(
                f"{rid}-{i}", ids, child_params(params, i), priority), i)
                for i in range(params.n)]
        collector = OutputCollector(len(ids), self.observer if observe else None)
        self._collectors[rid] = collector
        self._children[rid] = [req.request_id for req, _ in requests]
        for req, index in requests:
            self.output_processor.add_request(req, text, parent_id=rid, index=index, n=params.n)
            self._parent_of[req.request_id] = rid
        finished = False
        try:
            for req, _ in requests:
                await self.client.send(AddRequest.from_request(req))
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
        collector = self._collectors.get(request_id)
        if collector is not None:
            collector.fail(RequestAbortedError(f"request {request_id!r} was aborted"))
        await self._forget(request_id, abort=True)

    async def _forget(self, rid: str, abort: bool) -> None:
        self._collectors.pop(rid, None)
        engine_ids = self.output_processor.abort(rid)
        for eid in self._children.pop(rid, ()):
            self._parent_of.pop(eid, None)
        if abort and engine_ids:
            await self._send_abort(engine_ids)

    async def _send_abort(self, engine_ids: list[str]) -> None:
        if self.client.is_alive():
            with contextlib.suppress(EngineDeadError):
                await self.client.send(AbortRequests(request_ids=engine_ids))

    async def get_stats(self, timeout: float = 10.0) -> dict[str, float]:
        """Fresh ``EngineCore.stats()`` from the engine process."""
        qid = next(self._query_ids)
        fut: asyncio.Future[dict[str, float]] = asyncio.get_running_loop().create_future()
        self._stats_waiters[qid] = fut
        try:
            await self.client.send(StatsQuery(query_id=qid))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._stats_waiters.pop(qid, None)

    # ------------------------------------------------------------------ output loop

    async def _output_loop(self) -> None:
        try:
            while True:
                message = await self.client.recv()
                if isinstance(message, EngineOutputs):
                    self._deliver(message)
                elif isinstance(message, EngineStats):
                    self.stats = message.stats
                    fut = self._stats_waiters.get(message.query_id or 0)
                    if fut is not None and not fut.done():
                        fut.set_result(message.stats)
                elif isinstance(message, RequestRejected):
                    await self._reject(message)
        except EngineDeadError as e:
            if not self._shutting_down:
                logger.error("engine core died: %s; failing %d requests in flight", e,
                             len(self._collectors))
            self._fail_all(e)
        except Exception as e:  # a bug here must not leave requests hanging
            logger.exception("the engine output loop failed")
            self._fail_all(EngineDeadError(f"the frontend's output loop failed: {e!r}"))
            await self.client.close(kill=True)
        self.stats = {}  # a dead engine runs nothing: no stale gauges
        self._engine_died.set()

    def _deliver(self, message: EngineOutputs) -> None:
        processed = self.output_processor.process_outputs(message.outputs)
        for output in processed.request_outputs:
            collector = self._collectors.get(output.request_id)
            if collector is not None:
                collector.put(output)
        if processed.abort_ids:  # stop strings matched: the engine need not go on
            task = asyncio.get_running_loop().create_task(self._send_abort(processed.abort_ids))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _reject(self, message: RequestRejected) -> None:
        rid = self._parent_of.get(message.request_id)
        collector = self._collectors.get(rid) if rid is not None else None
        if rid is None or collector is None:
            return
        collector.fail(InvalidRequestError(message.message, param=message.param,
                                           code=message.code))
        await self._forget(rid, abort=True)

    def _fail_all(self, error: BaseException) -> None:
        for collector in list(self._collectors.values()):
            collector.fail(error)
        for fut in self._stats_waiters.values():
            if not fut.done():
                fut.set_exception(error)

    # ------------------------------------------------------------------ lifecycle

    @property
    def is_shutting_down(self) -> bool:
        """True once :meth:`shutdown` has begun."""
        return self._shutting_down

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Fail what is still in flight, stop the engine process, close the channel."""
        self._shutting_down = True
        self._fail_all(EngineDeadError("the server is shutting down"))
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        await self.client.close(timeout=timeout)


async def _start_client(config: LMKitConfig, env: dict[str, str] | None,
                        startup_timeout: float | None) -> tuple[EngineCoreClient, EngineReady]:
    """A new engine process for ``config``, ready (closed again if it fails)."""
    client = EngineCoreClient(engine_config_json(config.model_dump(mode="json")), env=env)
    try:
        return client, await client.start(timeout=startup_timeout)
    except BaseException:
        await client.close(kill=True)
        raise

"""The offline ``LLM``'s engine under data parallelism: N engine-core processes (as
``lmkit serve --dp N`` starts them, :mod:`lmkit.frontend.engine_set`) behind the
synchronous interface of :class:`~lmkit.engine.core.EngineCore` that ``LLM`` drives
(``add_request``, ``step``, ``abort_requests``, ...).

Requests are routed as the server routes them (:class:`~lmkit.frontend.engine_set.
EngineSet`: prefix affinity, then load) and stay on their engine. The engines step on their own, in parallel;
:meth:`DataParallelEngine.step` returns what any of them produced since the last call
(waiting for the first output when nothing is ready). A private event loop runs the
channels, so an ``LLM`` with ``data_parallel_size > 1`` cannot be driven from inside a
running event loop (use :class:`~lmkit.frontend.async_llm.AsyncLLM` there). An engine
that dies fails the next :meth:`step` with :class:`~lmkit.errors.EngineDeadError`
(offline, nothing restarts it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

from lmkit.api.outputs import EngineCoreOutput
from lmkit.config.schema import LMKitConfig
from lmkit.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineOutputs,
    EngineStats,
    RequestRejected,
)
from lmkit.errors import EngineDeadError, InvalidRequestError
from lmkit.frontend.engine_set import EngineSet, EngineSlot, engine_launches, start_engines


class DataParallelEngine:
    """``data_parallel_size`` engine processes with ``EngineCore``'s step interface."""

    def __init__(self, config: LMKitConfig, startup_timeout: float | None = None) -> None:
        """Start the engines (in parallel) and wait until all are ready.

        :raises RuntimeError: called from a running event loop (it needs its own).
        :raises ConfigError: more CUDA devices needed than present.
        :raises EngineStartupError: an engine failed to start (naming it).
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError(
                f"LLM with data_parallel_size {config.parallel.data_parallel_size} drives its "
                "engine processes through its own event loop, so it cannot run inside a "
                "running one (async code, Jupyter); use lmkit.frontend.async_llm.AsyncLLM "
                "there (await AsyncLLM.start(config)), or call LLM from a thread.")
        self._loop = asyncio.new_event_loop()
        try:
            self.slots: list[EngineSlot] = self._loop.run_until_complete(
                start_engines(engine_launches(config), startup_timeout))
        except BaseException:
            self._loop.close()
            raise
        ready = self.slots[0].ready
        self.config = config
        self.model_dir = ready.model_dir
        self.facts = SimpleNamespace(max_model_len=ready.max_model_len,
                                     vocab_size=ready.vocab_size,
                                     eos_token_ids=list(ready.eos_token_ids))
        self.engines = EngineSet(self.slots, config.cache.block_size)
        self._rejected: list[tuple[str, InvalidRequestError]] = []
        self._inbox: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._readers = [self._loop.create_task(self._read(slot)) for slot in self.slots]
        self._closed = False

    async def _read(self, slot: EngineSlot) -> None:
        """Forward one engine's messages (or its death) to the inbox."""
        try:
            while True:
                await self._inbox.put((slot.index, await slot.client.recv()))
        except EngineDeadError as e:
            await self._inbox.put((slot.index, e))

    # ------------------------------------------------------------------ EngineCore's API

    def add_request(self, request: Any) -> None:
        """Route a validated request to one engine and send it there."""
        ids = request.prompt_token_ids
        engine = self.engines.route(request.request_id, ids, len(ids))
        try:
            self._loop.run_until_complete(
                self.slots[engine].client.send(AddRequest.from_request(request)))
        except BaseException:
            self.engines.release(request.request_id)
            raise

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort requests on their engines; unknown or finished ids are ignored."""
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            engine = self.engines.release(rid)
            if engine is not None:
                by_engine.setdefault(engine, []).append(rid)
        for engine, ids in by_engine.items():
            client = self.slots[engine].client
            if client.is_alive():
                self._loop.run_until_complete(client.send(AbortRequests(request_ids=ids)))

    def has_unfinished_requests(self) -> bool:
        """Whether any request sent to an engine has not finished."""
        return self.engines.num_routed > 0

    def take_rejected_requests(self) -> list[tuple[str, InvalidRequestError]]:
        """``(request id, error)`` of requests an engine refused."""
        rejected, self._rejected = self._rejected, []
        return rejected

    def step(self) -> list[EngineCoreOutput]:
        """The outputs of every engine since the last call (waits for the first one
        while requests are unfinished).

        :raises EngineDeadError: an engine died (naming it).
        """
        if not self.has_unfinished_requests():
            return []
        return self._loop.run_until_complete(self._drain())

    async def _drain(self) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        messages = [await self._inbox.get()]
        while not self._inbox.empty():
            messages.append(self._inbox.get_nowait())
        for engine, message in messages:
            if isinstance(message, EngineDeadError):
                raise EngineDeadError(f"engine {engine} of {len(self.slots)}: {message}")
            if isinstance(message, EngineOutputs):
                for out in message.outputs:
                    if self.engines.engine_of(out.request_id) is None:
                        continue  # aborted meanwhile
                    outputs.append(out)
                    if out.finished:
                        self.engines.release(out.request_id)
            elif isinstance(message, RequestRejected):
                if self.engines.release(message.request_id) is not None:
                    self._rejected.append((message.request_id, InvalidRequestError(
                        message.message, param=message.param, code=message.code)))
            elif isinstance(message, EngineStats):
                self.slots[engine].stats = message.stats
        return outputs

    def stats(self) -> dict[str, Any]:
        """Each engine's latest stats (``engines``) and the router's counts."""
        return {"data_parallel_size": len(self.slots),
                "routed_requests": list(self.engines.router.num_routed),
                "engines": [dict(s.stats) for s in self.slots]}

    def shutdown(self) -> None:
        """Stop the engine processes; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._loop.run_until_complete(self._close())
        self._loop.close()

    async def _close(self) -> None:
        for task in self._readers:
            task.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        await asyncio.gather(*(s.client.close() for s in self.slots), return_exceptions=True)

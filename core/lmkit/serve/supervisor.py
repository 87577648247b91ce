"""Starting the engine (warmed up) and restarting it when it dies (each engine on its
own under data parallelism).

:func:`start_engine` starts the engine-core process and runs one warm-up request
through it, so the first client request does not pay one-time costs. The
:class:`EngineSupervisor` task waits for the engine to die; then every request in
flight has already failed (503 ``engine_dead``) and the supervisor restarts the engine
after ``server.engine_restart_backoff_s``, doubling the wait after each failed try. It
gives up after ``server.engine_restart_attempts`` tries in a row and calls
``on_give_up``, where the server exits with status 1 so that a process supervisor
(systemd, Kubernetes) can restart it. The count of tries starts again once an engine
has run for :data:`STABLE_AFTER_S` seconds, so a server that crashes now and then keeps
restarting while one that crashes at once stops.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Callable

from lmkit.api.pooling import PoolingParams
from lmkit.api.sampling_params import SamplingParams
from lmkit.config.schema import LMKitConfig
from lmkit.engine.gc_heap import freeze_startup_heap
from lmkit.errors import EngineDeadError
from lmkit.frontend.async_llm import AsyncLLM
from lmkit.frontend.collector import RequestObserver

logger = logging.getLogger(__name__)

STABLE_AFTER_S = 60.0  # an engine that ran this long resets the count of restart tries


async def warm_up(llm: AsyncLLM, max_tokens: int = 4, engine: int | None = None) -> None:
    """Run one short request through the whole path (chat template, tokenizer, engine
    prefill and decode, detokenizer) on ``engine`` (default: on every engine, at once),
    so that the first request's one-time costs (lazy imports and set-up, first-call
    allocations, kernels built on first use) are paid before the server reports ready.
    Not counted in the metrics. A pooling-only model (no language-model head) warms up
    with one embedding."""
    if engine is None:
        await asyncio.gather(*(warm_up(llm, max_tokens, e) for e in range(llm.num_engines)))
        return
    rid = f"warm-up-{uuid.uuid4().hex}"
    if not llm.ready.generates:
        await llm.embed("Hello!", PoolingParams(), request_id=rid, engine=engine)
        return
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    has_template = getattr(llm.tokenizer, "chat_template", None) is not None
    messages = [{"role": "user", "content": "Hello!"}] if has_template else None
    async for _ in llm.generate(None if has_template else "Hello!", params, messages=messages,
                                request_id=rid, observe=False, engine=engine,
                                output_kind="final"):
        pass


async def start_engine(config: LMKitConfig, *, observer: RequestObserver | None = None,
                       env: dict[str, str] | None = None,
                       startup_timeout: float | None = None) -> AsyncLLM:
    """Start the engine-core process and warm it up, then freeze this (API) process's
    heap out of the garbage collector's full collections (:mod:`lmkit.engine.gc_heap`:
    its ~320,000 startup objects -- FastAPI, transformers, the tokenizer -- took a full
    collection 132 ms on a 2-core CPU, a stall of every stream); raises what
    :meth:`AsyncLLM.start` raises, or :class:`EngineDeadError` if the engine dies while
    warming up."""
    llm = await AsyncLLM.start(config, observer=observer, env=env,
                               startup_timeout=startup_timeout)
    try:
        started = time.monotonic()
        await warm_up(llm)
        logger.info("warm-up request took %.2fs", time.monotonic() - started)
    except BaseException:
        await llm.shutdown()
        raise
    freeze_startup_heap()
    return llm


class EngineSupervisor:
    """Restarts ``llm``'s engine processes when they die (see the module docstring);
    with several engines (data parallel) each is watched and restarted on its own, with
    its own count of tries, while the others keep serving.

    ``on_restart`` runs after each successful restart, ``on_give_up(error)`` once one
    engine's tries are spent. :attr:`is_restarting` is true from an engine's death until
    the new one is warm.
    """

    def __init__(self, llm: AsyncLLM, config: LMKitConfig, *,
                 startup_timeout: float | None = None,
                 on_restart: Callable[[AsyncLLM], None] | None = None,
                 on_give_up: Callable[[BaseException], None] | None = None) -> None:
        self.llm = llm
        self.max_attempts = config.server.engine_restart_attempts
        self.backoff_s = config.server.engine_restart_backoff_s
        self.startup_timeout = startup_timeout
        self.on_restart = on_restart
        self.on_give_up = on_give_up
        self._restarting: set[int] = set()
        self.gave_up: str | None = None
        self.num_restarts = 0
        self._next_try_at = 0.0

    @property
    def is_restarting(self) -> bool:
        """True from an engine's death (even before the supervisor has noticed it) until
        the new engine is warm, unless the supervisor gave up or restarts are off."""
        if self._restarting:
            return True
        return (self.gave_up is None and self.max_attempts > 0 and not self.llm.is_healthy
                and not self.llm.is_shutting_down)

    def retry_after_s(self) -> int:
        """Seconds a client should wait before retrying (for ``Retry-After``)."""
        return max(1, math.ceil(self._next_try_at - time.monotonic()) + 1)

    async def run(self) -> None:
        """Watch every engine until the frontend shuts down or one's tries are spent."""
        watchers = [asyncio.create_task(self._watch(e), name=f"lmkit-supervise-engine-{e}")
                    for e in range(self.llm.num_engines)]
        try:
            await asyncio.wait(watchers, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in watchers:
                w.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)

    async def _watch(self, engine: int) -> None:
        several = self.llm.num_engines > 1
        name = f"engine {engine}" if several else "the engine"
        tries = 0
        up_since = time.monotonic()
        while True:
            await self.llm.wait_engine_death(engine)
            if self.llm.is_shutting_down:
                return
            if time.monotonic() - up_since >= STABLE_AFTER_S:
                tries = 0
            self._restarting.add(engine)
            error: BaseException = EngineDeadError(self.llm.dead_reason or f"{name} died")
            while tries < self.max_attempts:
                delay = self.backoff_s * 2 ** tries
                tries += 1
                self._next_try_at = time.monotonic() + delay
                logger.warning("restarting %s in %.1fs (try %d of %d)", name, delay, tries,
                               self.max_attempts)
                await asyncio.sleep(delay)
                try:
                    await self._restart(engine)
                    break
                except Exception as e:  # a failed start: try again, or give up below
                    logger.error("the restart of %s failed: %s", name, e)
                    error = e
            else:
                self.gave_up = (f"{name} died and {self.max_attempts} restart tries "
                                f"failed: {error}")
                logger.error("%s; giving up", self.gave_up)
                self._restarting.discard(engine)
                if self.on_give_up is not None:
                    self.on_give_up(EngineDeadError(self.gave_up))
                return
            self._restarting.discard(engine)
            self.num_restarts += 1
            up_since = time.monotonic()
            logger.warning("%s is back", name)
            if self.on_restart is not None:
                self.on_restart(self.llm)

    async def _restart(self, engine: int) -> None:
        if not self.llm.engine_alive(engine):
            await self.llm.restart_engine(self.startup_timeout, engine=engine)
        await warm_up(self.llm, engine=engine)

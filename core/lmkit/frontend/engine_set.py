"""The engine-core processes of one frontend: one, or ``parallel.data_parallel_size``
(data parallel), each with its own channel, executor and (on CUDA) devices.

:func:`engine_launches` plans each engine's configuration and environment: the engines
see themselves as ``data_parallel_size: 1``, and on CUDA engine ``r`` sees only its own
devices through ``CUDA_VISIBLE_DEVICES`` (:func:`lmkit.config.parallel.
data_parallel_devices`, checked against the devices present before anything starts).
:func:`start_engines` starts them all at once and, if any fails, stops the others and
raises the failure with the engine's index.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from typing import Any

from lmkit.config.schema import LMKitConfig
from lmkit.engine.messages import EngineReady
from lmkit.frontend.core_client import EngineCoreClient, EngineStartupError, engine_config_json


@dataclass
class EngineLaunch:
    """How to start engine ``index``: its configuration (JSON) and extra environment."""

    index: int
    config_json: dict[str, Any]
    env: dict[str, str]


@dataclass
class EngineSlot:
    """One running engine core: its channel, its facts, its latest stats, the task that
    reads its outputs, and an event set when it dies."""

    index: int
    client: EngineCoreClient
    ready: EngineReady
    stats: dict[str, float] = field(default_factory=dict)
    loop_task: asyncio.Task[None] | None = None
    died: asyncio.Event = field(default_factory=asyncio.Event)

    def is_alive(self) -> bool:
        """False once the engine process exited or was declared dead."""
        return self.client.is_alive()


def engine_launches(config: LMKitConfig, env: dict[str, str] | None = None
                    ) -> list[EngineLaunch]:
    """One launch per data-parallel engine (one when ``data_parallel_size`` is 1).

    :raises ConfigError: more CUDA devices asked for than this host has.
    """
    dp = config.parallel.data_parallel_size
    base = engine_config_json(config.model_dump(mode="json"))
    if dp == 1:
        return [EngineLaunch(0, base, dict(env or {}))]
    from lmkit.config.parallel import data_parallel_devices
    from lmkit.plugin_host.resolve import resolve_device

    device, _ = resolve_device(config)
    visible = (env or {}).get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
    devices = data_parallel_devices(config, device, visible=visible)
    one = {**base, "parallel": {**base.get("parallel", {}), "data_parallel_size": 1}}
    launches = []
    for rank, visible_devices in enumerate(devices):
        rank_env = dict(env or {})
        if visible_devices is not None:
            rank_env["CUDA_VISIBLE_DEVICES"] = visible_devices
        launches.append(EngineLaunch(rank, one, rank_env))
    return launches


async def start_engine_slot(launch: EngineLaunch, num_engines: int,
                            startup_timeout: float | None) -> EngineSlot:
    """Start one engine and wait until it is ready (closed again if it fails); with
    several engines a failure's message names the engine."""
    client = EngineCoreClient(launch.config_json, env=launch.env)
    try:
        ready = await client.start(timeout=startup_timeout)
    except EngineStartupError as e:
        await client.close(kill=True)
        if num_engines == 1:
            raise
        raise EngineStartupError(f"engine {launch.index} of {num_engines}: {e}",
                                 exit_code=e.exit_code) from None
    except BaseException:
        await client.close(kill=True)
        raise
    return EngineSlot(launch.index, client, ready, stats=dict(ready.stats))


async def start_engines(launches: list[EngineLaunch], startup_timeout: float | None
                        ) -> list[EngineSlot]:
    """Start every engine in parallel; at the first failure stop the others (started or
    starting) and raise it, naming the engine."""
    n = len(launches)
    tasks = [asyncio.create_task(start_engine_slot(launch, n, startup_timeout),
                                 name=f"lmkit-engine-start-{launch.index}")
             for launch in launches]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception()]
        if failed or not all(t.done() for t in tasks):  # a failure, or we were cancelled
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            started = [t.result() for t in tasks
                       if t.done() and not t.cancelled() and t.exception() is None]
            await asyncio.gather(*(s.client.close(kill=True) for s in started),
                                 return_exceptions=True)
    if failed:
        raise failed[0].exception()  # type: ignore[misc]
    return [t.result() for t in tasks]


class EngineSet:
    """The engines of one frontend and which request runs on which.

    Every request is routed once (:meth:`route`, through an
    :class:`~lmkit.frontend.router.EngineRouter`) and stays on that engine for its life:
    its messages and aborts go to that engine until :meth:`release`.
    """

    def __init__(self, slots: list[EngineSlot], block_size: int) -> None:
        from lmkit.frontend.router import EngineRouter

        self.slots = slots
        self.router = EngineRouter(len(slots), block_size)
        self._routes: dict[str, tuple[int, int]] = {}  # request id -> (engine, tokens)

    def __len__(self) -> int:
        return len(self.slots)

    def alive(self) -> list[bool]:
        """Whether each engine is alive."""
        return [s.is_alive() for s in self.slots]

    def dead_reason(self) -> str | None:
        """Why the dead engines are dead (naming them when there are several), or None."""
        dead = [s for s in self.slots if not s.is_alive()]
        if not dead:
            return None
        if len(self.slots) == 1:
            return dead[0].client.dead_reason
        return "; ".join(f"engine {s.index}: {s.client.dead_reason}" for s in dead)

    def route(self, request_id: str, prompt_ids: list[int], num_tokens: int,
              engine: int | None = None) -> int:
        """Choose the engine of a new request (``engine`` pins it) and count it there.

        :raises EngineDeadError: when no engine (or the pinned one) is alive.
        """
        from lmkit.errors import EngineDeadError

        alive = self.alive()
        if engine is None:
            if not any(alive):
                raise EngineDeadError(self.dead_reason() or "no engine is running")
            engine = self.router.choose(prompt_ids, alive)
        elif not alive[engine]:
            raise EngineDeadError(self.slots[engine].client.dead_reason or "not running")
        self.router.add(engine, num_tokens)
        self._routes[request_id] = (engine, num_tokens)
        return engine

    @property
    def num_routed(self) -> int:
        """Requests routed and not yet released."""
        return len(self._routes)

    def engine_of(self, request_id: str) -> int | None:
        """The engine a request was routed to (None once released)."""
        route = self._routes.get(request_id)
        return route[0] if route is not None else None

    def release(self, request_id: str) -> int | None:
        """Forget a finished (or failed, aborted) request; returns its engine."""
        route = self._routes.pop(request_id, None)
        if route is None:
            return None
        self.router.release(*route)
        return route[0]

    def requests_on(self, engine: int) -> list[str]:
        """The request ids routed to ``engine`` and not yet released."""
        return [rid for rid, (e, _) in self._routes.items() if e == engine]

    async def replace(self, launch: EngineLaunch, startup_timeout: float | None) -> EngineSlot:
        """Start a new process for dead engine ``launch.index`` in place of the old one
        (whose output loop has ended or ends now), and return its slot."""
        old = self.slots[launch.index]
        if old.loop_task is not None:
            await asyncio.gather(old.loop_task, return_exceptions=True)
        await old.client.close(kill=True)
        slot = await start_engine_slot(launch, len(self.slots), startup_timeout)
        self.slots[launch.index] = slot
        return slot

    async def close(self, timeout: float) -> None:
        """Stop every engine's output loop, then its process (``timeout`` s each, at once)."""
        for slot in self.slots:
            if slot.loop_task is not None:
                slot.loop_task.cancel()
        await asyncio.gather(*(s.loop_task for s in self.slots if s.loop_task is not None),
                             return_exceptions=True)
        await asyncio.gather(*(s.client.close(timeout=timeout) for s in self.slots))

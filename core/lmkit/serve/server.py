"""Running the app under uvicorn: the engine first, then the port, then the URL.

:func:`run_server` starts the engine process and warms it up *before* binding, so the
port opens (and uvicorn logs ``Uvicorn running on ...``) only once the server can answer.
uvicorn then handles SIGINT/SIGTERM: it stops accepting connections, lets requests in
flight finish for up to ``shutdown_timeout`` seconds (then cancels them, which aborts
them in the engine), and runs the app's lifespan shutdown, which stops the engine
process. If the engine dies and cannot be restarted, the server stops and
:func:`run_server` raises :class:`~lmkit.errors.EngineDeadError` (status 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from typing import Any

from lmkit.config.schema import LMKitConfig
from lmkit.errors import LMKitError
from lmkit.frontend.async_llm import AsyncLLM
from lmkit.serve.app import build_app
from lmkit.serve.metrics import ServerMetrics
from lmkit.serve.supervisor import start_engine

logger = logging.getLogger(__name__)


class ServerStartupError(LMKitError):
    """The server could not start serving (the engine failed to start); exits with the
    status of the engine's error (2 for a model or configuration that cannot work)."""

    exit_code = 1

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def bound_url(server: Any, host: str, port: int) -> str:
    """``http://HOST:PORT`` as actually bound (resolves ``--port 0``)."""
    for s in getattr(server, "servers", []) or []:
        for sock in s.sockets:
            addr = sock.getsockname()
            host_part = f"[{addr[0]}]" if ":" in addr[0] else addr[0]
            return f"http://{host_part}:{addr[1]}"
    host_part = f"[{host}]" if ":" in host else host
    return f"http://{host_part}:{port}"


def run_server(config: LMKitConfig, *, on_ready: Callable[[AsyncLLM, str], None] | None = None,
               on_engine_ready: Callable[[AsyncLLM], None] | None = None,
               log_level: str = "info", shutdown_timeout: float = 30.0,
               startup_timeout: float | None = None,
               engine_env: dict[str, str] | None = None) -> None:
    """Start the engine, then serve ``config`` until SIGINT/SIGTERM.

    ``on_engine_ready(llm)`` runs once the engine is warm, before binding;
    ``on_ready(llm, url)`` once the port is bound. Raises :class:`ServerStartupError` if
    the engine cannot start, and :class:`~lmkit.errors.EngineDeadError` if it died and
    could not be restarted.
    """
    from lmkit.serve.event_loop import resolve_event_loop, resolve_http, run_in_loop

    # a missing uvloop or httptools fails here, before the engine starts
    loop, http = resolve_event_loop(config.server), resolve_http(config.server)
    run_in_loop(loop, _serve(config, on_ready, on_engine_ready, log_level, shutdown_timeout,
                             startup_timeout, engine_env, http))


async def _serve(config: LMKitConfig, on_ready: Callable[[AsyncLLM, str], None] | None,
                 on_engine_ready: Callable[[AsyncLLM], None] | None, log_level: str,
                 shutdown_timeout: float, startup_timeout: float | None,
                 engine_env: dict[str, str] | None, http: str = "auto") -> None:
    import uvicorn

    metrics = ServerMetrics()
    llm = await _start_engine(config, metrics, engine_env, startup_timeout)
    if on_engine_ready is not None:
        on_engine_ready(llm)
    gave_up: list[BaseException] = []
    holder: dict[str, Any] = {}

    def give_up(error: BaseException) -> None:
        gave_up.append(error)
        holder["server"].should_exit = True

    app = build_app(config, llm=llm, metrics=metrics, on_give_up=give_up,
                    startup_timeout=startup_timeout)
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.server.host, port=config.server.port, log_level=log_level,
        timeout_graceful_shutdown=int(shutdown_timeout), access_log=log_level == "debug",
        lifespan="on", http=http,
    ))
    holder["server"] = server

    async def announce() -> None:
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.02)
        if on_ready is not None:
            on_ready(llm, bound_url(server, config.server.host, config.server.port))

    announcer = asyncio.create_task(announce())
    try:
        await server.serve()
    finally:
        announcer.cancel()
        if not server.started:  # the bind failed: the lifespan never took the engine
            await llm.shutdown()
    if gave_up:
        raise gave_up[0]


async def _start_engine(config: LMKitConfig, metrics: ServerMetrics,
                        engine_env: dict[str, str] | None,
                        startup_timeout: float | None) -> AsyncLLM:
    """The warmed-up engine; SIGTERM while it starts stops it (uvicorn is not yet
    listening for signals)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    terminated: list[bool] = []

    def on_sigterm() -> None:
        terminated.append(True)
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        return await start_engine(config, observer=metrics, env=engine_env,
                                  startup_timeout=startup_timeout)
    except asyncio.CancelledError:
        if terminated:
            raise ServerStartupError("stopped by SIGTERM while the engine was starting") from None
        raise  # Ctrl-C: asyncio.run turns it into KeyboardInterrupt
    except LMKitError as e:
        raise ServerStartupError(str(e), exit_code=e.exit_code) from e
    finally:
        with contextlib.suppress(Exception):
            loop.remove_signal_handler(signal.SIGTERM)

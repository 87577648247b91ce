"""Running the app under uvicorn: the URL once ready, a clean stop on SIGTERM.

uvicorn handles SIGINT/SIGTERM: it stops accepting connections, lets requests in flight
finish for up to ``shutdown_timeout`` seconds (then cancels them, which aborts them in
the engine), and runs the app's lifespan shutdown, which stops the engine process.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from lmkit.config.schema import LMKitConfig
from lmkit.errors import LMKitError
from lmkit.frontend.async_llm import AsyncLLM
from lmkit.serve.app import build_app

logger = logging.getLogger(__name__)


class ServerStartupError(LMKitError):
    """The server could not start serving (the engine failed to start)."""

    exit_code = 1


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
               log_level: str = "info", shutdown_timeout: float = 30.0,
               startup_timeout: float | None = None,
               engine_env: dict[str, str] | None = None) -> None:
    """Serve ``config`` until SIGINT/SIGTERM; ``on_ready(llm, url)`` runs once ready.

    Raises :class:`ServerStartupError` if the engine cannot start.
    """
    import uvicorn

    failure: list[BaseException] = []
    holder: dict[str, Any] = {}

    def ready(llm: AsyncLLM) -> None:
        server = holder["server"]
        if not server.started:  # the engine beat uvicorn's bind: report once listening
            asyncio.get_running_loop().call_later(0.05, ready, llm)
            return
        if on_ready is not None:
            on_ready(llm, bound_url(server, config.server.host, config.server.port))

    def failed(error: BaseException) -> None:
        failure.append(error)
        server = holder.get("server")
        if server is not None:
            server.should_exit = True

    app = build_app(config, on_ready=ready, on_startup_failure=failed, engine_env=engine_env,
                    startup_timeout=startup_timeout)
    uv_config = uvicorn.Config(
        app, host=config.server.host, port=config.server.port, log_level=log_level,
        timeout_graceful_shutdown=int(shutdown_timeout), access_log=log_level == "debug",
        lifespan="on",
    )
    server = uvicorn.Server(uv_config)
    holder["server"] = server
    server.run()
    if failure:
        raise ServerStartupError(str(failure[0])) from failure[0]

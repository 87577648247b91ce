"""The API process's event loop and HTTP implementation (``server.event_loop``,
``server.http``).

Streaming costs the API process CPU on every token of every stream: waking the
request's task, writing its chunk to the socket. uvloop (libuv) runs the loop and the
socket transports in C, and httptools parses and frames HTTP in C; both come with the
optional ``fast-serve`` extra (``pip install 'lmkit[fast-serve]'``) and are used when
installed unless the configuration asks for asyncio's loop or h11. Asking for one that
is not installed is a configuration error, raised before the engine starts.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Coroutine
from typing import Any, TypeVar

from lmkit.config.schema import ServerConfig
from lmkit.errors import ConfigError

T = TypeVar("T")

_FIX = "install it with `pip install 'lmkit[fast-serve]'`, or set server.{key}={default}"


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _resolve(key: str, choice: str, module: str, default: str) -> str:
    if choice == "auto":
        return module if _installed(module) else default
    if choice == module and not _installed(module):
        raise ConfigError(f"server.{key}={module} needs the '{module}' package, which is not "
                          f"installed; " + _FIX.format(key=key, default=default))
    return choice


def resolve_event_loop(server: ServerConfig) -> str:
    """``"uvloop"`` or ``"asyncio"``: what ``server.event_loop`` means on this machine."""
    return _resolve("event_loop", server.event_loop, "uvloop", "asyncio")


def resolve_http(server: ServerConfig) -> str:
    """``"httptools"`` or ``"h11"``: what ``server.http`` means on this machine."""
    return _resolve("http", server.http, "httptools", "h11")


def run_in_loop(event_loop: str, main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion in a new loop of kind ``event_loop`` (a
    :func:`resolve_event_loop` result), as :func:`asyncio.run` does."""
    if event_loop == "uvloop":
        import uvloop

        return uvloop.run(main)  # type: ignore[no-any-return]
    return asyncio.run(main)

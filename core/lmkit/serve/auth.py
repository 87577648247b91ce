"""API-key authentication as ASGI middleware, in front of routing.

Every HTTP path but exactly ``/health`` needs ``Authorization: Bearer <key>``. The check
runs on the raw ASGI scope before any route is matched, so a new route can never forget
it, and path tricks (``//health``, ``/health/..``, percent-encoding) are refused unless
they route to ``/health`` itself. Keys are compared with :func:`hmac.compare_digest`.

The key comes from ``server.api_key`` (``--api-key``, ``LMKIT_API_KEY``) or from the
file named by ``server.api_key_file``; :func:`load_api_key` reads it. It stays in the API
process: the engine process never receives it.
"""

from __future__ import annotations

import hmac
import json
import logging
import stat
from pathlib import Path
from typing import Any

from lmkit.config.schema import ServerConfig
from lmkit.errors import ConfigError
from lmkit.serve.errors import error_body

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health"})


def load_api_key(server: ServerConfig) -> str | None:
    """The bearer key the server requires: ``server.api_key``, or the first line of
    ``server.api_key_file``; None when neither is set (no authentication).

    Raises :class:`ConfigError` when the file cannot be read or holds no key, and warns
    when other local users can read it.
    """
    if server.api_key_file is None:
        return server.api_key or None
    path = Path(server.api_key_file).expanduser()
    try:
        mode = path.stat().st_mode
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the API key file {path} (server.api_key_file / "
                          f"--api-key-file): {e}") from None
    key = lines[0].strip() if lines else ""
    if not key:
        raise ConfigError(f"the API key file {path} is empty; put the key on its first line")
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        logger.warning("the API key file %s can be read by other users (mode %o); "
                       "`chmod 600 %s`", path, stat.S_IMODE(mode), path)
    return key


class APIKeyMiddleware:
    """Refuse requests without the right bearer key with an OpenAI-shaped 401."""

    def __init__(self, app: Any, api_key: str) -> None:
        if not api_key:
            raise ValueError("APIKeyMiddleware needs a non-empty key")
        self.app = app
        self._key = api_key.encode("utf-8")

    def _authorized(self, scope: dict[str, Any]) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    return hmac.compare_digest(token.strip(), self._key)
                return False
        return False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)  # lifespan
            return
        if scope["type"] == "http" and scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        if self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps(error_body(
            "missing or invalid API key: send 'Authorization: Bearer <key>' with the key the "
            "server was started with (LMKIT_API_KEY, --api-key-file or --api-key)",
            "invalid_request_error",
            code="invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

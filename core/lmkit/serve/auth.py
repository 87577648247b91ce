"""API-key authentication as ASGI middleware, in front of routing.

Every HTTP path but exactly ``/health`` needs ``Authorization: Bearer <key>``. The check
runs on the raw ASGI scope before any route is matched, so a new route can never forget
it, and path tricks (``//health``, ``/health/..``, percent-encoding) are refused unless
they route to ``/health`` itself. Keys are compared with :func:`hmac.compare_digest`.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from lmkit.serve.errors import error_body

OPEN_PATHS = frozenset({"/health"})


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
            "server was started with (--api-key or LMKIT_API_KEY)", "invalid_request_error",
            code="invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

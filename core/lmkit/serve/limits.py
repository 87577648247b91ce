"""Admission control and request-size limits.

:class:`AdmissionController` bounds the sequences in flight: what the engine can run at
once (``max_num_seqs``) plus a queue of ``max_queued_requests``. Past that, a request is
refused at once with 429 and ``Retry-After`` instead of queueing without bound.
:class:`BodySizeLimitMiddleware` refuses bodies over ``max_bytes`` with 413 before any
JSON is parsed, whether or not the client sent ``Content-Length``.
"""

from __future__ import annotations

from typing import Any

from lmkit.serve.errors import APIError, error_body


class Admission:
    """One admitted request's share of the bound; release it exactly once."""

    def __init__(self, controller: AdmissionController, num_seqs: int) -> None:
        self._controller = controller
        self.num_seqs = num_seqs
        self._released = False

    def release(self) -> None:
        """Give the slots back (idempotent)."""
        if not self._released:
            self._released = True
            self._controller.in_flight -= self.num_seqs


class AdmissionController:
    """Counts sequences in flight and refuses new ones past ``capacity``."""

    def __init__(self, capacity: int, retry_after_s: int = 1) -> None:
        if capacity < 1:
            raise ValueError(f"admission capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self.num_rejected = 0

    def admit(self, num_seqs: int) -> Admission:
        """Reserve ``num_seqs`` slots or raise a 429 :class:`APIError`."""
        if self.in_flight + num_seqs > self.capacity and self.in_flight > 0:
            self.num_rejected += 1
            raise APIError(
                429, f"the server is at capacity ({self.in_flight} sequences in flight, "
                f"limit {self.capacity}); retry after {self.retry_after_s}s",
                code="rate_limit_exceeded", headers={"Retry-After": str(self.retry_after_s)})
        self.in_flight += num_seqs
        return Admission(self, num_seqs)


class BodySizeLimitMiddleware:
    """ASGI middleware: 413 for a request body larger than ``max_bytes``.

    The body is read (up to the limit) before the app runs and replayed to it; later
    ``receive`` calls go to the server, so the app still sees ``http.disconnect``.
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    too_big = int(value) > self.max_bytes
                except ValueError:
                    too_big = False
                if too_big:
                    await self._refuse(send)
                    return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # disconnected while sending
                await self.app(scope, _replay([message], receive), send)
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._refuse(send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
        await self.app(scope, _replay(replay, receive), send)

    async def _refuse(self, send: Any) -> None:
        import json

        body = json.dumps(error_body(
            f"the request body is larger than the server's limit of {self.max_bytes} bytes "
            "(server.max_request_body_bytes)", "invalid_request_error",
            code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _replay(messages: list[dict[str, Any]], receive: Any) -> Any:
    pending = list(messages)

    async def replay_receive() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay_receive

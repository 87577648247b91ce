"""Running one HTTP generation request: admission, errors, streaming, disconnects.

Both generation endpoints hand :func:`respond` their engine streams and a formatter
(which turns outputs into OpenAI JSON). The first output is awaited before any header
is sent, so a request the engine refuses still gets its 4xx status even when streaming;
after that, failures arrive as an SSE error event followed by ``[DONE]``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from lmkit.api.outputs import RequestOutput
from lmkit.errors import LMKitError
from lmkit.serve.app import ServerState
from lmkit.serve.errors import CLIENT_CLOSED_REQUEST, APIError
from lmkit.serve.streaming import (
    SSE_DONE,
    ClientDisconnected,
    last_item,
    merge_streams,
    sse,
    until_disconnect,
)


class Formatter(Protocol):
    """Turns engine outputs into one endpoint's OpenAI JSON."""

    def chunks(self, index: int, output: RequestOutput) -> list[dict[str, Any]]:
        """Stream chunks for a new output of prompt ``index``."""
        ...

    def events(self, index: int, output: RequestOutput) -> bytes:
        """The same chunks as server-sent events, in one piece (one socket write)."""
        ...

    def final_chunks(self) -> list[dict[str, Any]]:
        """Chunks after every request finished (the usage chunk)."""
        ...

    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        """The non-streaming response from each prompt's final output."""
        ...


def created_now() -> int:
    """OpenAI's ``created``: Unix seconds."""
    return int(time.time())


def _check_errors(output: RequestOutput) -> None:
    """Raise the error a completion finished with: 400 when the request's own parameters
    caused it (a :class:`~lmkit.errors.RequestFaultError`, e.g. ``no_allowed_token``),
    else 500 ``engine_error``. The request was already counted in the metrics."""
    for c in output.outputs:
        if c.finish_reason == "error":
            if c.error is not None:
                error = APIError.from_exception(c.error)
            else:
                error = APIError(500, "the engine failed on this request: "
                                 f"{c.stop_reason or 'error'}", code="engine_error")
            error.counted = True
            raise error


async def respond(request: Request, state: ServerState, num_seqs: int,
                  streams: list[AsyncIterator[RequestOutput]], formatter: Formatter,
                  stream: bool) -> Response:
    """Run ``streams`` (one per prompt) and answer with JSON or server-sent events."""
    admission = state.admission.admit(num_seqs)
    merged = merge_streams(streams)

    async def cleanup() -> None:
        admission.release()
        await merged.aclose()

    handed_over = False
    try:
        if not stream:
            outputs = await until_disconnect(request, last_item(merged))
            for out in outputs:
                _check_errors(out)
            return JSONResponse(formatter.response(outputs))
        try:
            first = await until_disconnect(request, merged.__anext__())
        except StopAsyncIteration:
            raise APIError(500, "the engine produced no output for this request",
                           code="internal_error") from None
        _check_errors(first[1])  # failed before any token: still an HTTP status
        response = _EngineStreamResponse(_sse_body(first, merged, formatter), cleanup)
        handed_over = True
        return response
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        if not handed_over:
            await cleanup()


async def _sse_body(first: tuple[int, RequestOutput],
                    merged: AsyncIterator[tuple[int, RequestOutput]],
                    formatter: Formatter) -> AsyncIterator[bytes]:
    try:
        pending = first
        while True:
            index, output = pending
            _check_errors(output)
            events = formatter.events(index, output)
            if events:
                yield events
            try:
                pending = await merged.__anext__()
            except StopAsyncIteration:
                break
        for chunk in formatter.final_chunks():
            yield sse(chunk)
        yield SSE_DONE
    except (LMKitError, APIError) as e:
        yield sse(APIError.from_exception(e).body())
        yield SSE_DONE


class _EngineStreamResponse(StreamingResponse):
    """Server-sent events whose ``cleanup`` (abort, release the admission) always runs,
    even when the client leaves before the first byte."""

    def __init__(self, content: AsyncIterator[bytes], cleanup: Any) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._cleanup = cleanup

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._cleanup()

"""Running one HTTP generation request: admission, errors, streaming, disconnects.

Both generation endpoints hand :func:`respond` their engine streams and a formatter
(which turns outputs into OpenAI JSON). The first output is awaited before any header
is sent, so a request the engine refuses still gets its 4xx status even when streaming;
after that, failures arrive as an SSE error event followed by ``[DONE]``.

A large body (``echo`` + ``logprobs`` over a long prompt, ``n`` choices, many top
log-probabilities: up to a gigabyte of JSON and a minute of CPU) is built and encoded on
a worker thread, in pieces (:func:`~lmkit.serve.streaming.encode_in_pieces`), so that the
event loop (every other stream, ``/health``) goes on meanwhile; a small one is built on
the loop, where a thread hop would cost more than the work.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from lmkit.api.outputs import RequestOutput
from lmkit.errors import LMKitError
from lmkit.serve.app import ServerState
from lmkit.serve.errors import CLIENT_CLOSED_REQUEST, APIError
from lmkit.serve.streaming import (
    SSE_DONE,
    ClientDisconnected,
    encode_in_pieces,
    last_item,
    merge_streams,
    sse,
    until_disconnect,
)

T = TypeVar("T")

# a body whose Formatter.cost reaches this is built off the event loop (about 2 ms of
# work for completions logprobs, 8 ms for chat's, which carry bytes too)
OFF_LOOP_MIN_COST = 1024
# bodies built at once; more wait their turn (the threads share one GIL anyway)
_builders = ThreadPoolExecutor(max_workers=4, thread_name_prefix="lmkit-response")
# a large body goes to the server in messages of this size: the loop's socket write
# copies what the socket does not take at once, and a gigabyte takes a second
SEND_BYTES = 1 << 20


def _slices(data: bytes | memoryview) -> Iterator[bytes]:
    """``data`` in :data:`SEND_BYTES` parts, each copied only when its turn comes."""
    for start in range(0, len(data), SEND_BYTES):
        yield bytes(data[start:start + SEND_BYTES])  # (no second copy of a bytes slice)


class _SlicedJSONResponse(Response):
    """JSON with the whole body's Content-Length, sent in :data:`SEND_BYTES` messages
    (same bytes and headers as a ``JSONResponse``)."""

    media_type = "application/json"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        for part in _slices(self.body):
            await send({"type": "http.response.body", "body": part, "more_body": True})
            await asyncio.sleep(0)  # each write a turn of the loop, whatever the server
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class Formatter(Protocol):
    """Turns engine outputs into one endpoint's OpenAI JSON."""

    def chunks(self, index: int, output: RequestOutput) -> list[dict[str, Any]]:
        """Stream chunks for a new output of prompt ``index``."""
        ...

    def events(self, index: int, output: RequestOutput, in_pieces: bool = False) -> bytes:
        """The same chunks as server-sent events, in one piece (one socket write);
        ``in_pieces``: encode each chunk in bounded pieces (built off the loop)."""
        ...

    def cost(self, index: int, output: RequestOutput, delta: bool) -> int:
        """About how much work the JSON for ``output`` is (:meth:`events` when ``delta``,
        else its part of :meth:`response`): one per log-probability entry (a token or
        one of its alternatives) and per 64 characters of text."""
        ...

    def final_chunks(self) -> list[dict[str, Any]]:
        """Chunks after every request finished (the usage chunk)."""
        ...

    def response(self, outputs: list[RequestOutput], iterate_choices: bool = False
                 ) -> dict[str, Any]:
        """The non-streaming response from each prompt's final output. With
        ``iterate_choices``, ``choices`` is an iterator that builds each choice as it is
        consumed (for :func:`~lmkit.serve.streaming.encode_in_pieces`: one choice alive
        at a time)."""
        ...


def created_now() -> int:
    """OpenAI's ``created``: Unix seconds."""
    return int(time.time())


async def _off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a builder thread, the event loop free meanwhile."""
    return await asyncio.get_running_loop().run_in_executor(_builders, fn, *args)


def _json_bytes(content: Any) -> bytes:
    # what JSONResponse.render writes, so both paths send the same bytes
    return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None,
                      separators=(",", ":")).encode("utf-8")


def build_json_response(formatter: Formatter, outputs: list[RequestOutput]) -> Response:
    """The non-streaming response, encoded in pieces: what a builder thread runs."""
    content = formatter.response(outputs, iterate_choices=True)
    return _SlicedJSONResponse(b"".join(encode_in_pieces(content, _json_bytes)))


async def _json_response(formatter: Formatter, outputs: list[RequestOutput]) -> Response:
    cost = sum(formatter.cost(i, out, delta=False) for i, out in enumerate(outputs))
    if cost < OFF_LOOP_MIN_COST:
        return JSONResponse(formatter.response(outputs))
    return await _off_loop(build_json_response, formatter, outputs)


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
            return await _json_response(formatter, outputs)
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
            if formatter.cost(index, output, delta=True) < OFF_LOOP_MIN_COST:
                events = formatter.events(index, output)
                if events:
                    yield events
            else:
                for part in _slices(await _off_loop(formatter.events, index, output, True)):
                    yield part
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

"""Server-sent events and the plumbing between engine outputs and an HTTP response.

- :func:`sse` frames one JSON event (``data: {...}\\n\\n``); :data:`SSE_DONE` ends a stream.
- :func:`until_disconnect` runs an awaitable but cancels it as soon as the client goes
  away, so a request nobody waits for is aborted and its KV blocks freed.
- :func:`merge_streams` interleaves the outputs of several requests (a batch of
  completion prompts) as they come, tagged with their position in the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request

T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"
_json = msgspec.json.Encoder()


def sse(payload: Any) -> bytes:
    """One server-sent event carrying ``payload`` as JSON."""
    return b"data: " + _json.encode(payload) + b"\n\n"


class ChunkTemplate:
    """One stream's chunk JSON: the fields every chunk repeats (``fixed``: id, object,
    created, model, ...) are encoded once; per chunk only ``choices`` (and ``usage`` when
    ``include_usage``) are. :meth:`event` is byte for byte ``sse(as_dict(...))``.
    """

    def __init__(self, fixed: dict[str, Any], include_usage: bool) -> None:
        if not fixed:
            raise ValueError("a chunk template needs at least one fixed field")
        self.fixed = fixed
        self.include_usage = include_usage
        self._head = b"data: " + _json.encode(fixed)[:-1] + b',"choices":'

    def as_dict(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None
                ) -> dict[str, Any]:
        """The chunk as a JSON-ready dict."""
        chunk = {**self.fixed, "choices": choices}
        if self.include_usage:
            chunk["usage"] = usage
        return chunk

    def event(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None
              ) -> bytes:
        """The chunk as one server-sent event."""
        if self.include_usage:
            return b"".join((self._head, _json.encode(choices), b',"usage":',
                             _json.encode(usage), b"}\n\n"))
        return self._head + _json.encode(choices) + b"}\n\n"


class ClientDisconnected(Exception):
    """The HTTP client closed the connection before the response was ready."""


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable``; cancel it and raise ClientDisconnected if the client leaves."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def merge_streams(streams: Sequence[AsyncIterator[T]]
                        ) -> AsyncGenerator[tuple[int, T], None]:
    """Yield ``(stream index, item)`` from every stream as items arrive.

    An exception in any stream is raised here and closes the others; closing this
    iterator closes all of them (each aborts its request).
    """
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
    _END = object()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item, None))
            await queue.put((i, _END, None))
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            await queue.put((i, None, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is _END:
                remaining -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t


async def last_item(stream: AsyncIterator[tuple[int, T]]) -> list[T]:
    """Drain a stream of ``(index, item)`` pairs keeping the last item per index."""
    last: dict[int, T] = {}
    async for i, item in stream:
        last[i] = item
    return [last[i] for i in sorted(last)]

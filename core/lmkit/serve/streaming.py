"""Server-sent events and the plumbing between engine outputs and an HTTP response.

- :func:`sse` frames one JSON event (``data: {...}\\n\\n``); :data:`SSE_DONE` ends a stream.
- :func:`until_disconnect` runs an awaitable but cancels it as soon as the client goes
  away, so a request nobody waits for is aborted and its KV blocks freed.
- :func:`merge_streams` interleaves the outputs of several requests (a batch of
  completion prompts) as they come, tagged with their position in the batch.
- :func:`encode_in_pieces` encodes a large JSON value in bounded pieces, so that a
  thread building a huge body lets the event loop's thread run between pieces.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterator,
    Sequence,
)
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request

T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"
_json = msgspec.json.Encoder()
# values one encoder call takes at most in encode_in_pieces (about a millisecond): a C
# encoder holds the GIL for its whole call, whichever thread makes it
PIECE_VALUES = 4096
_UNKNOWN = 1 << 62  # the weight of an iterator


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

    def event(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None,
              in_pieces: bool = False) -> bytes:
        """The chunk as one server-sent event; ``in_pieces`` (a large chunk built off the
        event loop) encodes ``choices`` with :func:`encode_in_pieces`, same bytes."""
        encoded = (b"".join(encode_in_pieces(choices, _json.encode)) if in_pieces
                   else _json.encode(choices))
        if self.include_usage:
            return b"".join((self._head, encoded, b',"usage":', _json.encode(usage),
                             b"}\n\n"))
        return self._head + encoded + b"}\n\n"


def _weight(obj: Any) -> int:
    """About how many JSON values ``obj`` holds (a string counts 1 per 64 characters).
    A container of more than a few items is estimated from three of them, so this
    costs little whatever the size."""
    if isinstance(obj, str):
        return 1 + len(obj) // 64
    if isinstance(obj, dict):
        if len(obj) <= 32:
            return 1 + sum(_weight(v) for v in obj.values())
        first = list(itertools.islice(obj.values(), 3))
        return 1 + len(obj) * max(_weight(v) for v in first)
    if isinstance(obj, list):
        if len(obj) <= 3:
            return 1 + sum(_weight(v) for v in obj)
        # not only the first: an echoed prompt's first token has no logprobs
        sample = (obj[0], obj[len(obj) // 2], obj[-1])
        return 1 + len(obj) * max(_weight(v) for v in sample)
    if isinstance(obj, Iterator):
        return _UNKNOWN  # its containers must be walked to reach it
    return 1


def encode_in_pieces(obj: Any, encode: Callable[[Any], bytes],
                     max_values: int = PIECE_VALUES) -> list[bytes]:
    """``encode(obj)`` split into pieces, each from one ``encode`` call over at most about
    ``max_values`` values; joined, they are byte for byte ``encode(obj)``.

    ``encode`` must write compact JSON (``,`` and ``:`` with no spaces, keys in order),
    as msgspec and ``json.dumps(..., separators=(",", ":"))`` do. Large lists are encoded
    in slices and large dicts (with string keys) value by value; smaller values whole.
    An iterator (which ``encode`` itself would refuse) is written as the array of its
    items, built a few at a time when their turn comes and dropped once encoded, so
    that a huge body never lives whole as Python objects (nor burdens the garbage
    collector, whose full passes walk every object alive, holding the GIL).
    """
    out: list[bytes] = []
    _pieces(obj, encode, max_values, out)
    return out


def _pieces(obj: Any, encode: Callable[[Any], bytes], max_values: int,
            out: list[bytes]) -> None:
    if isinstance(obj, list) and obj and (weight := _weight(obj)) > max_values:
        step = max(1, max_values // max(1, weight // len(obj)))
        out.append(b"[")
        for start in range(0, len(obj), step):
            _items(obj[start:start + step], encode, max_values, out, b"," if start else b"")
        out.append(b"]")
    elif (isinstance(obj, dict) and obj and all(type(k) is str for k in obj)
          and _weight(obj) > max_values):
        out.append(b"{")
        for i, (key, value) in enumerate(obj.items()):
            out.append((b"," if i else b"") + encode(key) + b":")
            _pieces(value, encode, max_values, out)
        out.append(b"}")
    elif isinstance(obj, Iterator):
        out.append(b"[")
        separator = b""
        for item in obj:
            # as many items as make max_values (judged by the first), built only now
            more = max_values // max(1, _weight(item)) - 1
            batch = [item, *itertools.islice(obj, more)] if more > 0 else [item]
            del item
            _items(batch, encode, max_values, out, separator)
            del batch  # free them before the next ones are built
            separator = b","
        out.append(b"]")
    else:
        out.append(encode(obj))


def _items(items: list[Any], encode: Callable[[Any], bytes], max_values: int,
           out: list[bytes], separator: bytes) -> None:
    """``items`` as the inside of a JSON array (after ``separator``): in one ``encode``
    call, or item by item when one is big or holds what ``encode`` refuses (an iterator)."""
    if len(items) > 1:
        try:
            out.append(separator + encode(items)[1:-1])  # without its brackets
            return
        except TypeError:
            pass
    for i, item in enumerate(items):
        out.append(separator if i == 0 else b",")
        _pieces(item, encode, max_values, out)


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

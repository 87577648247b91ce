"""What the API process holds of its requests while the engines run them.

:class:`InFlight` is ``AsyncLLM``'s bookkeeping, kept apart from the asyncio plumbing:
one :class:`~lmkit.frontend.collector.OutputCollector` per submitted (parent) request,
which engine requests each parent fanned out to (``n > 1``), the futures of pooling
requests and stats queries, and the :class:`~lmkit.frontend.output_processor.
OutputProcessor` that turns engine outputs into request outputs. Its methods never
await: the output loop calls them between two receives, and anything to send back to
an engine (aborts) is returned for the caller to send.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from lmkit.errors import InvalidRequestError

if TYPE_CHECKING:
    from lmkit.api.outputs import EngineCoreOutput, OutputKind
    from lmkit.engine.messages import EngineOutputs, RequestRejected
    from lmkit.frontend.collector import OutputCollector
    from lmkit.frontend.output_processor import OutputProcessor


class InFlight:
    """The requests submitted through one frontend and not yet finished."""

    def __init__(self, output_processor: OutputProcessor) -> None:
        self.output_processor = output_processor
        self.collectors: dict[str, OutputCollector] = {}
        self.parent_of: dict[str, str] = {}  # engine request id -> parent id
        self.children: dict[str, list[str]] = {}  # parent id -> engine request ids
        self.pooling: dict[str, asyncio.Future[EngineCoreOutput]] = {}
        self.stats_waiters: dict[int, asyncio.Future[dict[str, float]]] = {}

    def __len__(self) -> int:
        return len(self.collectors)

    def holds(self, rid: str) -> bool:
        """True while ``rid`` is in use by a generation or pooling request."""
        return rid in self.collectors or rid in self.pooling

    def add(self, rid: str, collector: OutputCollector, requests: list[tuple[Any, int]],
            text: str | None, n: int, kind: OutputKind = "cumulative") -> None:
        """Register parent ``rid`` and the engine requests it fans out to (``(request,
        index)`` pairs), so their outputs, of ``kind``, reach ``collector``. Raises
        ``ValueError`` for an unknown ``kind``, having registered nothing (the output
        processor checks it before it tracks the first request)."""
        for req, index in requests:
            self.output_processor.add_request(req, text, parent_id=rid, index=index, n=n,
                                              kind=kind)
            self.parent_of[req.request_id] = rid
        self.collectors[rid] = collector
        self.children[rid] = [req.request_id for req, _ in requests]

    def forget(self, rid: str) -> list[str]:
        """Drop parent ``rid``; returns the engine request ids still unfinished (to abort
        when the request did not finish)."""
        self.collectors.pop(rid, None)
        engine_ids = self.output_processor.abort(rid)
        for eid in self.children.pop(rid, ()):
            self.parent_of.pop(eid, None)
        return engine_ids

    def deliver(self, message: EngineOutputs) -> list[str]:
        """Hand one step's outputs to their collectors (and finished pooling requests to
        their futures); returns the engine request ids whose stop strings matched, which
        the engine need not go on with."""
        if self.pooling:  # (only while a pooling request is in flight)
            for out in message.outputs:
                result = self.pooling.get(out.request_id)
                if result is not None and out.finished and not result.done():
                    result.set_result(out)
        processed = self.output_processor.process_outputs(message.outputs)
        collectors = self.collectors
        for rid, num_new in processed.progress.items():  # ("final" requests still running)
            collector = collectors.get(rid)
            if collector is not None:
                collector.observe_tokens(num_new)
        for output in processed.request_outputs:
            collector = self.collectors.get(output.request_id)
            if collector is not None:
                collector.put(output)
        return processed.abort_ids

    def reject(self, message: RequestRejected) -> str | None:
        """Fail the request the engine refused; returns its parent id when a generation
        request is to be forgotten (and its siblings aborted), else ``None``."""
        error = InvalidRequestError(message.message, param=message.param, code=message.code)
        result = self.pooling.get(message.request_id)
        if result is not None and not result.done():
            result.set_exception(error)
            return None
        rid = self.parent_of.get(message.request_id)
        collector = self.collectors.get(rid) if rid is not None else None
        if rid is None or collector is None:
            return None
        collector.fail(error)
        return rid

    def answer_stats(self, query_id: int | None, stats: dict[str, float]) -> None:
        """Resolve the stats query ``query_id`` waits on, if any."""
        fut = self.stats_waiters.get(query_id or 0)
        if fut is not None and not fut.done():
            fut.set_result(stats)

    def fail(self, rids: list[str], error: BaseException) -> None:
        """Fail the generation and pooling requests ``rids``."""
        for rid in rids:
            collector = self.collectors.get(rid)
            if collector is not None:
                collector.fail(error)
            pooled = self.pooling.get(rid)
            if pooled is not None and not pooled.done():
                pooled.set_exception(error)

    def fail_all(self, error: BaseException) -> None:
        """Fail everything in flight, stats queries included."""
        for collector in list(self.collectors.values()):
            collector.fail(error)
        futures: list[asyncio.Future[Any]] = [*self.stats_waiters.values(),
                                              *self.pooling.values()]
        for fut in futures:
            if not fut.done():
                fut.set_exception(error)

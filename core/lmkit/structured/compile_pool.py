"""Threads that compile grammars off the engine's step loop.

Compilers (xgrammar, llguidance) release the GIL, so a compilation in a worker thread
does not slow the step loop. A thread cannot be killed, though: a compilation that
overstays its time limit is *abandoned*. Its request is refused at once; the thread
finishes the work in the background (the result still lands in the cache) and then
exits, and a replacement thread starts so that the pool keeps its capacity. At most
``max_abandoned`` threads may be abandoned at a time; beyond that, compilations queue
behind the runaway ones (and time out in turn) until one finishes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

logger = logging.getLogger(__name__)


class CompileJob:
    """One submitted call: its :attr:`future`, and when a worker started it."""

    __slots__ = ("fn", "args", "future", "started_at", "thread")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.args = args
        self.future: Future[Any] = Future()
        self.started_at: float | None = None
        self.thread: threading.Thread | None = None

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return  # cancelled while queued
        self.started_at = time.monotonic()
        try:
            result = self.fn(*self.args)
        except BaseException as e:
            self.future.set_exception(e)
        else:
            self.future.set_result(result)


class CompilePool:
    """``num_threads`` daemon threads running :class:`CompileJob` s in submission order.

    Args:
        num_threads: compilations that run at once.
        max_abandoned: most abandoned threads alive at once (see the module docstring).
    """

    def __init__(self, num_threads: int, max_abandoned: int | None = None,
                 name: str = "lmkit-grammar") -> None:
        if num_threads < 1:
            raise ValueError(f"CompilePool needs at least one thread, got {num_threads}")
        self.num_threads = num_threads
        self.max_abandoned = 2 * num_threads if max_abandoned is None else max_abandoned
        self.name = name
        self._queue: queue.SimpleQueue[CompileJob | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._abandoned: set[threading.Thread] = set()
        self._threads: set[threading.Thread] = set()
        self._closed = False
        self.num_abandoned_total = 0
        for _ in range(num_threads):
            self._start_thread()

    def submit(self, fn: Callable[..., Any], *args: Any) -> CompileJob:
        """Queue ``fn(*args)``; returns its job (its ``future`` holds the result)."""
        if self._closed:
            raise RuntimeError("the grammar compile pool is shut down")
        job = CompileJob(fn, args)
        self._queue.put(job)
        return job

    def abandon(self, job: CompileJob) -> None:
        """Give up on ``job`` (its request is refused): cancel it if it has not started;
        otherwise let its thread finish and exit, and start a replacement if fewer than
        ``max_abandoned`` threads are abandoned."""
        if job.future.cancel():
            return
        with self._lock:
            thread = job.thread
            if thread is None or job.future.done() or thread in self._abandoned:
                return
            if len(self._abandoned) >= self.max_abandoned:
                logger.warning("%d grammar compilations overran their time limit and still "
                               "run; not replacing more threads", len(self._abandoned))
                return
            self._abandoned.add(thread)
            self.num_abandoned_total += 1
        self._start_thread()

    @property
    def num_abandoned(self) -> int:
        """Abandoned threads still running their compilation."""
        return len(self._abandoned)

    def shutdown(self) -> None:
        """Stop the threads once they finish their current job (does not wait)."""
        self._closed = True
        for _ in range(len(self._threads)):
            self._queue.put(None)

    def _start_thread(self) -> None:
        thread = threading.Thread(target=self._work, name=self.name, daemon=True)
        with self._lock:
            self._threads.add(thread)
        thread.start()

    def _work(self) -> None:
        me = threading.current_thread()
        try:
            while True:
                job = self._queue.get()
                if job is None:
                    return
                job.thread = me
                job.run()
                with self._lock:
                    if me in self._abandoned:  # a replacement took this thread's place
                        self._abandoned.discard(me)
                        return
        finally:
            with self._lock:
                self._threads.discard(me)

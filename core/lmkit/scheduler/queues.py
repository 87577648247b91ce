"""Waiting queues: the order in which requests are admitted, a scheduler's main policy.

A :class:`PagedScheduler` subclass picks its queue in ``make_waiting_queue``. The
scheduler admits from the front (``peek``, then ``pop`` once the request got its
blocks) and puts preempted requests back with ``add_front``.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from lmkit.api.request import Request


class WaitingQueue(ABC):
    """Requests waiting to be admitted (new or preempted).

    Implementations must keep every operation but ``remove`` cheap (O(1) or
    O(log n)); ``remove`` serves aborts and may be O(n).
    """

    @abstractmethod
    def add(self, request: Request) -> None:
        """Queue a newly arrived request."""

    @abstractmethod
    def add_front(self, request: Request) -> None:
        """Queue a preempted request; it should be admitted again before new arrivals
        of the same standing (a queue ordered by a key may just :meth:`add`)."""

    @abstractmethod
    def peek(self) -> Request:
        """The request to admit next (raises ``IndexError`` when empty)."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return :meth:`peek`'s request."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Remove ``request`` (raises ``ValueError`` if absent)."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of queued requests."""

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Every queued request, in no promised order."""

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSWaitingQueue(WaitingQueue):
    """First come, first served: arrival order, preempted requests at the very front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_front(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityWaitingQueue(WaitingQueue):
    """Ordered by ``(priority, arrival_time)``: lower priority value first (as vLLM),
    then earlier arrival. A preempted request keeps its key, so it comes back ahead
    of anything that arrived after it at the same priority."""

    def __init__(self) -> None:
        # entries: (priority, arrival_time, tie-break counter, request)
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(
            self._heap, (request.priority, request.arrival_time, next(self._counter), request)
        )

    def add_front(self, request: Request) -> None:
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        for i, entry in enumerate(self._heap):
            if entry[3] is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"request {request.request_id!r} is not waiting")

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in self._heap)

"""The waiting queue of the fair-share scheduler: one FIFO per tenant; the tenant with
the least service goes first."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from lmkit.api import Request, WaitingQueue

from lmkit_fair_scheduler.ledger import Ledger


class TenantFairQueue(WaitingQueue):
    """Per-tenant first come, first served (preempted requests at their tenant's
    front); across tenants, least weighted service first, ties to the earliest head.

    ``peek`` is O(number of waiting tenants), usually a handful; ``pop`` charges the
    request's tokens provisionally so that the next ``peek`` of the same step sees it.
    """

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self._queues: dict[str, deque[Request]] = {}
        self._size = 0

    def _queue(self, request: Request) -> deque[Request]:
        return self._queues.setdefault(self.ledger.tenant_of(request), deque())

    def add(self, request: Request) -> None:
        self._queue(request).append(request)
        self._size += 1

    def add_front(self, request: Request) -> None:
        self._queue(request).appendleft(request)
        self._size += 1

    def _next_tenant(self) -> str:
        best, key = None, None
        for tenant, queue in self._queues.items():
            if queue:
                k = (self.ledger.level(tenant), queue[0].arrival_time)
                if key is None or k < key:
                    best, key = tenant, k
        if best is None:
            raise IndexError("peek from an empty waiting queue")
        return best

    def peek(self) -> Request:
        return self._queues[self._next_tenant()][0]

    def pop(self) -> Request:
        tenant = self._next_tenant()
        request = self._queues[tenant].popleft()
        self._size -= 1
        self.ledger.charge(tenant, request.num_tokens - request.num_computed_tokens,
                           provisional=True)
        return request

    def remove(self, request: Request) -> None:
        self._queue(request).remove(request)
        self._size -= 1

    def tenants(self) -> set[str]:
        """Tenants with at least one waiting request."""
        return {t for t, q in self._queues.items() if q}

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Request]:
        return (r for q in self._queues.values() for r in q)

"""The ``priority`` scheduler: lower ``priority`` value first, then arrival order."""

from __future__ import annotations

from collections.abc import Sequence

from lmkit.api import PagedScheduler, PriorityWaitingQueue, Request, WaitingQueue


def _rank(request: Request) -> tuple[int, float]:
    """Sort key: smaller is more important (lower priority value, then earlier)."""
    return (request.priority, request.arrival_time)


class PriorityScheduler(PagedScheduler):
    """Strict priority scheduling (lower ``Request.priority`` value = more important,
    as in vLLM), first come, first served within a priority.

    - Admission: waiting requests by ``(priority, arrival_time)``.
    - Preemption when a running request needs blocks the pool lacks: the least
      important running request (highest priority value, then latest arrival).
    - Admission preemption: when a waiting request cannot get blocks, it preempts the
      least important running request if that one ranks strictly below it, repeating
      until it fits or no such request is left. It never preempts for token budget:
      a high-priority arrival waits for the budget like everyone else. Equal priorities
      never preempt each other on admission, so requests cannot ping-pong.

    Within one priority nothing starves; across priorities, a steady stream of more
    important requests delays less important ones by design.
    """

    def make_waiting_queue(self) -> WaitingQueue:
        """A heap ordered by ``(priority, arrival_time)``."""
        return PriorityWaitingQueue()

    def choose_preemption_victim(self, running: Sequence[Request]) -> Request:
        """The least important running request (latest-admitted among equals)."""
        return max(reversed(running), key=_rank)

    def choose_admission_victim(
        self, request: Request, running: Sequence[Request]
    ) -> Request | None:
        """The least important running request if it ranks strictly below ``request``
        (a higher priority value); otherwise ``None``."""
        if not running:
            return None
        victim = max(reversed(running), key=_rank)
        return victim if victim.priority > request.priority else None

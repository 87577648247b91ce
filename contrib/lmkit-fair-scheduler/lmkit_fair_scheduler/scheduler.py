"""The ``fair-share`` scheduler: :class:`lmkit.api.PagedScheduler` with per-tenant
fair sharing of scheduled tokens (see the package README for the policy)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lmkit.api import (
    LMKitConfig,
    PagedScheduler,
    Request,
    SchedulerContext,
    SchedulerOutput,
    WaitingQueue,
)

from lmkit_fair_scheduler.ledger import Ledger
from lmkit_fair_scheduler.plugin import FairShareOptions
from lmkit_fair_scheduler.queue import TenantFairQueue


class FairShareScheduler(PagedScheduler):
    """Weighted fair sharing of the token budget between tenants.

    - Admission: the waiting tenant with the least weighted service goes first; within
      a tenant, first come, first served.
    - Preemption (KV pool full): a request of the running tenant with the most weighted
      service, its latest arrival.
    - Accounting: every scheduled token (prefill chunk, decode, draft) is charged to
      its tenant divided by the tenant's weight; prefix-cache hits are free. A tenant
      becoming busy again starts at the least service among busy tenants.

    Running requests are never preempted just to admit another tenant's request, so
    fairness acts on admissions and KV pressure, not inside a step's running batch.
    """

    def __init__(self, config: LMKitConfig, num_blocks: int,
                 options: FairShareOptions | None = None,
                 context: SchedulerContext | None = None) -> None:
        opts = options if options is not None else FairShareOptions()
        self.ledger = Ledger(opts.tenant_from, opts.weights, opts.default_tenant)
        super().__init__(config, num_blocks, opts, context)

    def make_waiting_queue(self) -> WaitingQueue:
        """A :class:`TenantFairQueue` over this scheduler's ledger."""
        return TenantFairQueue(self.ledger)

    def _busy_tenants(self) -> set[str]:
        queue = self.waiting
        assert isinstance(queue, TenantFairQueue)
        return queue.tenants() | {self.ledger.tenant_of(r) for r in self.running}

    def add_request(self, request: Request) -> None:
        """Queue ``request`` under its tenant (see :class:`Ledger` for idle tenants)."""
        tenant = self.ledger.tenant_of(request)
        busy = self._busy_tenants()
        if tenant not in busy:
            self.ledger.join(tenant, busy)
        super().add_request(request)

    def schedule(self) -> SchedulerOutput:
        """Plan a step, then charge each tenant the tokens scheduled for it."""
        output = super().schedule()
        self.ledger.settle()
        for rid, num_tokens in output.num_scheduled_tokens.items():
            request = self.requests.get(rid)
            if request is not None:
                self.ledger.charge(self.ledger.tenant_of(request), num_tokens)
        return output

    def choose_preemption_victim(self, running: Sequence[Request]) -> Request:
        """The latest arrival of the running tenant with the most weighted service."""
        return max(reversed(running), key=lambda r: (
            self.ledger.level(self.ledger.tenant_of(r)), r.arrival_time))

    def get_stats(self) -> dict[str, Any]:
        """PagedScheduler's counters plus ``tenant_service`` (weighted tokens served)."""
        stats = super().get_stats()
        stats["tenant_service"] = dict(self.ledger.service)
        return stats

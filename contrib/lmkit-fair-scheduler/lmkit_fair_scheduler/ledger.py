"""The service ledger: weighted tokens each tenant has been served."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from lmkit.api import Request


class Ledger:
    """Virtual service per tenant, in tokens divided by the tenant's weight.

    ``charge`` adds a step's scheduled tokens; ``provisional`` holds charges for
    requests admitted earlier in the step being planned, so that one step's
    admissions already alternate between tenants. A tenant that becomes busy again
    starts at the least service among busy tenants (start-time fair queueing), so idle
    time earns no credit to spend later in a burst.
    """

    def __init__(self, tenant_from: str, weights: Mapping[str, float], default_tenant: str
                 ) -> None:
        self.tenant_from = tenant_from
        self.weights = dict(weights)
        self.default_tenant = default_tenant
        self.service: dict[str, float] = {}
        self.provisional: dict[str, float] = {}

    def tenant_of(self, request: Request) -> str:
        """The tenant key of ``request`` (cached in ``request.extra['tenant']``)."""
        tenant = request.extra.get("tenant")
        if tenant is None:
            value = request.cache_salt if self.tenant_from == "cache_salt" else request.priority
            tenant = self.default_tenant if value is None else str(value)
            request.extra["tenant"] = tenant
        return str(tenant)

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def level(self, tenant: str) -> float:
        """Service used for ordering: settled plus provisional charges."""
        return self.service.get(tenant, 0.0) + self.provisional.get(tenant, 0.0)

    def join(self, tenant: str, busy: Iterable[str]) -> None:
        """``tenant`` becomes busy while ``busy`` tenants are: start it at their least
        service, or keep its own if that is higher."""
        others = [self.service.get(t, 0.0) for t in busy if t != tenant]
        if others:
            self.service[tenant] = max(self.service.get(tenant, 0.0), min(others))

    def charge(self, tenant: str, num_tokens: int, provisional: bool = False) -> None:
        table = self.provisional if provisional else self.service
        table[tenant] = table.get(tenant, 0.0) + num_tokens / self.weight(tenant)

    def settle(self) -> None:
        """Drop the provisional charges (the step's real tokens are charged instead)."""
        self.provisional.clear()

"""Registers the ``fair-share`` scheduler (importing nothing heavy)."""

from typing import Literal

from lmkit.api import Spec, hookimpl
from pydantic import BaseModel, ConfigDict, Field

LMKIT_PLUGIN_API = ">=1.0,<2"


class FairShareOptions(BaseModel):
    """Options of the ``fair-share`` scheduler."""

    model_config = ConfigDict(extra="forbid")

    tenant_from: Literal["cache_salt", "priority"] = Field(
        "cache_salt", description="Which request field names its tenant: 'cache_salt' (the "
        "per-tenant prefix-cache isolation key) or 'priority' (one tenant per priority "
        "value). A request's extra['tenant'], when an embedding program sets it, wins.")
    weights: dict[str, float] = Field(
        default_factory=dict, description="Share weight per tenant (default 1.0): a tenant of "
        "weight 2 gets twice the tokens of a tenant of weight 1 when both are busy.")
    default_tenant: str = Field(
        "default", description="The tenant of requests that carry no tenant key.")

    def model_post_init(self, context: object) -> None:
        bad = {k: v for k, v in self.weights.items() if not v > 0}
        if bad:
            raise ValueError(f"weights must be positive, got {bad}")


SPEC = Spec(
    name="fair-share",
    target="lmkit_fair_scheduler.scheduler:FairShareScheduler",
    priority=10,
    options=FairShareOptions,
    description="Per-tenant fair share of scheduled tokens (weighted, start-time fair).",
)


@hookimpl
def register_schedulers(register):
    register(SPEC)

"""lmkit's scheduler conformance suite, with default and weighted options."""

import pytest
from lmkit.testing.scheduler import SchedulerConformance
from lmkit_fair_scheduler.plugin import SPEC


class TestFairShare(SchedulerConformance):
    @pytest.fixture(params=[{}, {"tenant_from": "priority", "weights": {"0": 2.0}}],
                    ids=["defaults", "weighted-by-priority"])
    def scheduler(self, request):
        return SPEC, request.param

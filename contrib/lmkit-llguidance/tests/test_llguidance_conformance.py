"""lmkit's structured-output conformance suite, with compact and flexible JSON."""

import pytest
from lmkit.testing.structured_output import StructuredOutputConformance
from lmkit_llguidance.plugin import SPEC


class TestLLGuidance(StructuredOutputConformance):
    @pytest.fixture(params=[{}, {"whitespace_flexible": True}], ids=["compact", "flexible"])
    def structured_output_backend(self, request):
        return SPEC, request.param

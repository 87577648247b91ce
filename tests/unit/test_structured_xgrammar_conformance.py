"""The ``xgrammar`` backend against lmkit's structured-output conformance suite
(bitmask against accept_tokens for every token at every state, rollback, termination,
the language of each constraint kind), compact and flexible JSON."""

import pytest
from lmkit.testing.structured_output import StructuredOutputConformance

pytest.importorskip("xgrammar")

from lmkit_plugins.structured import SPEC  # noqa: E402


class TestXGrammar(StructuredOutputConformance):
    @pytest.fixture(params=[{}, {"whitespace_flexible": True}], ids=["compact", "flexible"])
    def structured_output_backend(self, request):
        return SPEC, request.param

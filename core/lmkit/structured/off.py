"""The structured-output phase of an engine without a backend: constrained requests
are refused with an error that says how to turn structured output on."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmkit.engine.phases import StepPhase
from lmkit.errors import InvalidRequestError
from lmkit.structured.constraint import PARAM

if TYPE_CHECKING:
    from lmkit.api.request import Request
    from lmkit.config.schema import LMKitConfig


class StructuredOutputOff(StepPhase):
    """The structured-output phase of an engine without a backend: refuses
    constrained requests with an error that says how to turn it on."""

    def __init__(self, config: LMKitConfig) -> None:
        self.config = config

    def add_request(self, request: Request) -> None:
        """Raises :class:`InvalidRequestError` for a constrained request."""
        if request.sampling_params.structured_outputs is not None:
            raise structured_output_off_error(self.config)


def structured_output_off_error(config: LMKitConfig) -> InvalidRequestError:
    """The error for a constrained request to an engine with structured output off."""
    backend = config.structured_output.backend
    why = ("structured_output.backend is 'none'" if backend == "none" else
           "no structured-output backend is installed (pip install 'lmkit[xgrammar]')")
    return InvalidRequestError(
        f"this engine cannot constrain output: {why}; start it with a structured-output "
        "backend, or send the request without structured_outputs / response_format",
        param=PARAM, code="structured_output_unavailable")

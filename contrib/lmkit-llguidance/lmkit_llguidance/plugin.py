"""Registers the ``llguidance`` structured-output backend (importing nothing heavy)."""

from lmkit.api import Caps, Spec, hookimpl
from pydantic import BaseModel, ConfigDict, Field

LMKIT_PLUGIN_API = ">=1.0,<2"


class LLGuidanceOptions(BaseModel):
    """Options of the ``llguidance`` structured-output backend."""

    model_config = ConfigDict(extra="forbid")

    whitespace_flexible: bool = Field(
        False, description="Let JSON output contain any whitespace between tokens; default: "
        "compact separators only (fewer wasted tokens, no runaway whitespace).")


SPEC = Spec(
    name="llguidance",
    target="lmkit_llguidance.backend:LLGuidanceBackend",
    requires=("llguidance",),
    priority=20,
    options=LLGuidanceOptions,
    caps=Caps({"json_schema", "json_object", "regex", "grammar", "choice"}),
    description="Constrained decoding with llguidance (JSON schema, regex, Lark/GBNF, choice).",
)


@hookimpl
def register_structured_output_backends(register):
    register(SPEC)

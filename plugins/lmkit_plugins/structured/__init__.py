"""Built-in structured-output backends: ``xgrammar``.

Registered only (nothing heavy is imported here): the backend module imports xgrammar
when the engine first compiles a constraint. With ``structured_output.backend: auto``
(the default) the backend is on whenever the ``xgrammar`` package is installed
(``pip install 'lmkit[xgrammar]'``).
"""

from lmkit.api import Caps, Spec, hookimpl
from pydantic import BaseModel, ConfigDict, Field

LMKIT_PLUGIN_API = ">=1.0,<2"


class XGrammarOptions(BaseModel):
    """Options of the ``xgrammar`` structured-output backend."""

    model_config = ConfigDict(extra="forbid")

    whitespace_flexible: bool = Field(
        False, description="Let JSON output contain any whitespace between tokens; default: "
        "compact separators only (fewer tokens, no runaway whitespace from small models).")
    compiler_threads: int = Field(
        1, gt=0, le=64, description="Threads xgrammar uses inside one compilation (the "
        "engine runs structured_output.num_compile_threads compilations at once).")
    fill_threads: int | None = Field(
        None, gt=0, le=256, description="Threads filling one step's token masks in parallel; "
        "default: a quarter of the CPU cores, 1 to 8 (more competes with the model's CPU "
        "threads).")


SPEC = Spec(
    name="xgrammar",
    target="lmkit_plugins.structured.xgrammar_backend:XGrammarBackend",
    requires=("xgrammar",),
    priority=50,
    options=XGrammarOptions,
    caps=Caps(frozenset({"json_schema", "json_object", "regex", "grammar", "choice",
                         "structural_tag"})),
    description="Constrained decoding with xgrammar (JSON schema, regex, EBNF/Lark, choice, "
                "structural tags); CUDA bitmask kernel on GPU.",
)


@hookimpl
def register_structured_output_backends(register):
    register(SPEC)

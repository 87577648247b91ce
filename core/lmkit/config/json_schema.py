"""The JSON Schema of :class:`LMKitConfig`, completed with what installed plugins accept.

For each pluggable section, ``backend`` lists the registered names and ``options`` is
checked against the chosen implementation's options model (``if backend == NAME then
options must match NAME's schema``), so an editor can validate and complete a config
file for the plugins installed here.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from lmkit.config.schema import LMKitConfig
from lmkit.plugin_host.kinds import OPTIONAL_KINDS, STACK_KINDS

if TYPE_CHECKING:
    from lmkit.plugin_host.manager import PluginHost

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def config_json_schema(host: PluginHost | None = None) -> dict[str, Any]:
    """The config's JSON Schema; with ``host``, including every registered spec's options.

    The result is deterministic for a given set of plugins (names sorted), so that the
    generated reference docs only change when a schema does.
    """
    schema = LMKitConfig.model_json_schema()
    schema["$schema"] = SCHEMA_DIALECT
    if host is None:
        return schema
    defs = schema.setdefault("$defs", {})
    for kind in STACK_KINDS:
        section = kind  # the config section of a stack kind has its name
        regs = sorted(host.registry.all(kind), key=lambda r: r.name)
        if not regs:
            continue
        section_def = defs[_section_def_name(schema, section)]
        backend = section_def["properties"]["backend"]
        special = ["none", "auto"] if kind in OPTIONAL_KINDS else ["auto"]
        backend["enum"] = special + [r.name for r in regs]
        rules = []
        for reg in regs:
            ref = _add_options_schema(defs, f"{section}.{reg.name}", reg.spec.options)
            rules.append({
                "if": {"properties": {"backend": {"const": reg.name}}, "required": ["backend"]},
                "then": {"properties": {"options": {"$ref": ref}}},
            })
        section_def["allOf"] = rules
    return schema


def _section_def_name(schema: dict[str, Any], section: str) -> str:
    ref = schema["properties"][section]
    ref = ref.get("$ref") or ref["allOf"][0]["$ref"]
    return str(ref).rsplit("/", 1)[-1]


def _add_options_schema(defs: dict[str, Any], key: str, model: Any) -> str:
    """Put ``model``'s schema (and its own definitions, renamed under ``key``) into
    ``defs``; return the ``$ref`` to it."""
    prefix = re.sub(r"[^A-Za-z0-9_.-]", "_", key) + "."
    sub = model.model_json_schema(ref_template=f"#/$defs/{prefix}{{model}}")
    for name, definition in sub.pop("$defs", {}).items():
        defs[prefix + name] = definition
    defs[prefix + "options"] = sub
    return f"#/$defs/{prefix}options"

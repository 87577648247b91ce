"""JSON-schema keywords the xgrammar backend would silently ignore.

xgrammar compiles most of JSON Schema into its grammar, but some keywords and
combinations it does not enforce are dropped with at most a warning on stderr
(measured on xgrammar 0.2.8): ``uniqueItems``, ``not``, ``if``/``then``/``else``,
``dependentRequired``, ``allOf`` with several subschemas, a ``required`` name that the
same subschema's ``properties`` do not declare, ``minLength``/``maxLength``
next to ``pattern`` or ``format``, and ``multipleOf`` anywhere but on a plain
``integer`` without bounds. A request using them could get output that does not
validate, so the backend refuses them up front, naming the keyword and where it is in
the schema. ``format`` values xgrammar does not know are let through: JSON Schema
treats ``format`` as an annotation unless a validator opts in.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# keyword -> why it is refused
UNSUPPORTED = {
    "not": "negated subschemas are not enforced",
    "if": "conditional subschemas (if/then/else) are not enforced",
    "then": "conditional subschemas (if/then/else) are not enforced",
    "else": "conditional subschemas (if/then/else) are not enforced",
    "dependentRequired": "dependent required properties are not enforced",
}

# where subschemas live: name -> how they are held
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("additionalProperties", "items", "contains", "propertyNames",
                  "unevaluatedProperties", "unevaluatedItems", "not", "if", "then", "else")


def unsupported_keywords(schema: Any) -> list[tuple[str, str, str]]:
    """Every ``(keyword, JSON pointer, reason)`` in ``schema`` the backend cannot enforce."""
    return list(_walk(schema, "#"))


def _undeclared_required(schema: dict[str, Any], path: str) -> Iterator[tuple[str, str, str]]:
    """``required`` names missing from the same subschema's ``properties``: xgrammar
    enforces only declared properties (``{"type": "object", "required": ["b"]}`` would
    accept ``{}`` and refuse ``{"b": 1}``)."""
    required = schema.get("required")
    if not isinstance(required, list):
        return
    props = schema.get("properties")
    declared = props if isinstance(props, dict) else {}
    missing = [name for name in required if isinstance(name, str) and name not in declared]
    if missing:
        yield "required", path, (f"required property {missing[0]!r} is not declared in "
                                 "'properties' next to it, and only declared properties are "
                                 "enforced; declare it there")


def _walk(schema: Any, path: str) -> Iterator[tuple[str, str, str]]:
    if not isinstance(schema, dict):
        return
    for keyword, reason in UNSUPPORTED.items():
        if keyword in schema:
            yield keyword, path, reason
    if schema.get("uniqueItems") is True:
        yield "uniqueItems", path, "unique array items are not enforced"
    lengths = [k for k in ("minLength", "maxLength") if k in schema]
    for other in ("pattern", "format"):
        if lengths and other in schema:
            yield lengths[0], path, f"string length bounds are not enforced next to {other!r}"
    if "multipleOf" in schema and (schema.get("type") != "integer" or any(
            k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"))):
        yield "multipleOf", path, "multipleOf is only enforced on an integer without bounds"
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        yield "allOf", path, "only a single allOf subschema is supported"
    yield from _undeclared_required(schema, path)
    for name in _SCHEMA_MAPS:
        sub = schema.get(name)
        if isinstance(sub, dict):
            for key, value in sub.items():
                yield from _walk(value, f"{path}/{name}/{key}")
    for name in _SCHEMA_LISTS:
        sub = schema.get(name)
        if isinstance(sub, list):
            for i, value in enumerate(sub):
                yield from _walk(value, f"{path}/{name}/{i}")
    for name in _SCHEMA_VALUES:
        sub = schema.get(name)
        if isinstance(sub, list):  # draft-4 tuple "items"
            for i, value in enumerate(sub):
                yield from _walk(value, f"{path}/{name}/{i}")
        else:
            yield from _walk(sub, f"{path}/{name}")

"""A JSON-schema rewrite that keeps the language and makes xgrammar's masks cheaper.

xgrammar enforces ``minLength``/``maxLength`` on strings with a mechanism whose token
masks it cannot precompute: inside such a string a mask fill scans the vocabulary
(about 3 ms per token for ``maxLength: 12`` with a 49k vocabulary, measured on
xgrammar 0.2.8), against a few microseconds for the same bound written as a pattern.
For short bounds the backend therefore compiles ``{"maxLength": n, "minLength": m}`` as
``{"pattern": "^[\\s\\S]{m,n}$"}``, which accepts the same strings (both bounds count
characters of the decoded string, escapes included as one). Long bounds keep the
keywords: there the pattern's automaton is the slower one.

The patterns cost compile time instead (about 0.4 s each for ``maxLength: 64``, a 49k
vocabulary, xgrammar 0.2.9): a schema of 100 such strings compiled for 42 s, holding a
compile thread past the timeout. So only the first strings, in schema order, whose upper
bounds add up to :data:`REWRITE_BUDGET` are rewritten; the rest keep their keywords.
"""

from __future__ import annotations

from typing import Any

SHORT_STRING_MAX = 64  # maxLength up to this becomes a pattern
REWRITE_BUDGET = 256  # the most maxLength, summed over the strings rewritten, per schema

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("additionalProperties", "items", "contains", "propertyNames",
                  "unevaluatedProperties", "unevaluatedItems")


def rewrite_short_strings(schema: Any, budget: int = REWRITE_BUDGET) -> Any:
    """A copy of ``schema`` with short string length bounds as patterns (see the module
    docstring), while their upper bounds add up to at most ``budget``; subschemas that
    also have ``pattern`` or ``format`` are left alone."""
    return _rewrite(schema, [budget])


def _rewrite(schema: Any, left: list[int]) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    high = schema.get("maxLength")
    if (isinstance(high, int) and 0 <= high <= min(SHORT_STRING_MAX, left[0])
            and "pattern" not in schema and "format" not in schema):
        low = schema.get("minLength", 0)
        if isinstance(low, int) and 0 <= low <= high:
            del out["maxLength"]
            out.pop("minLength", None)
            out["pattern"] = f"^[\\s\\S]{{{low},{high}}}$"
            left[0] -= high
    for name in _SCHEMA_MAPS:
        if isinstance(schema.get(name), dict):
            out[name] = {k: _rewrite(v, left) for k, v in schema[name].items()}
    for name in (*_SCHEMA_LISTS, *_SCHEMA_VALUES):
        sub = schema.get(name)
        if isinstance(sub, list):
            out[name] = [_rewrite(v, left) for v in sub]
        elif isinstance(sub, dict):
            out[name] = _rewrite(sub, left)
    return out

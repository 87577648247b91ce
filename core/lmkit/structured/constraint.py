"""Constraints: ``SamplingParams.structured_outputs`` parsed and validated.

The request side names a constraint with one key (``{"json": schema}``,
``{"regex": "..."}``, ``{"grammar": "..."}``, ``{"choice": [...]}``,
``{"json_object": True}``, ``{"structural_tag": ...}``). Validation here is
backend-independent (shape and types, a size bound, and JSON schemas no finite value
satisfies), so the frontend refuses a malformed request before it reaches the engine;
whether the constraint compiles is the backend's to say.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lmkit.errors import InvalidRequestError

# constraint kind -> the backend capability (Caps feature) it needs
KIND_FEATURES = {
    "json": "json_schema",
    "json_object": "json_object",
    "regex": "regex",
    "grammar": "grammar",
    "choice": "choice",
    "structural_tag": "structural_tag",
}
PARAM = "structured_outputs"
# deepest nesting of objects and arrays in a json / structural_tag spec: deeper ones
# overflow Python's recursion in the JSON encoder and the backends' schema walks (and
# take xgrammar tens of seconds at ~900 levels)
MAX_NESTING = 200


@dataclass(frozen=True)
class Constraint:
    """One request's constraint: ``kind`` (a key of :data:`KIND_FEATURES`), its
    ``spec``, and ``key``, the canonical text that identifies it in the grammar cache
    (JSON with the spec's own key order: property order matters to the output)."""

    kind: str
    spec: Any
    key: str

    @property
    def feature(self) -> str:
        """The backend capability this constraint needs."""
        return KIND_FEATURES[self.kind]

    def describe(self, limit: int = 80) -> str:
        """``kind`` plus the start of the spec, for messages."""
        text = self.key.split(":", 1)[1]
        return f"{self.kind} {text[:limit]}{'...' if len(text) > limit else ''}"


def _bad(message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=PARAM, code="invalid_value")


def parse_constraint(structured_outputs: Mapping[str, Any]) -> Constraint:
    """The :class:`Constraint` of a request's ``structured_outputs``.

    Raises:
        InvalidRequestError: not exactly one known kind, or a spec of the wrong type.
    """
    if not isinstance(structured_outputs, Mapping):
        raise _bad(f"structured_outputs must be an object such as {{\"json\": SCHEMA}}, got "
                   f"{type(structured_outputs).__name__}")
    kinds = [k for k, v in structured_outputs.items() if v is not None]
    unknown = [k for k in kinds if k not in KIND_FEATURES]
    if unknown:
        raise _bad(f"unknown structured_outputs kind {unknown[0]!r}; use one of "
                   f"{', '.join(KIND_FEATURES)}")
    if len(kinds) != 1:
        raise _bad(f"structured_outputs must name exactly one constraint (one of "
                   f"{', '.join(KIND_FEATURES)}), got {len(kinds)}: {kinds}")
    kind = kinds[0]
    spec = _check_spec(kind, structured_outputs[kind])
    _check_nesting(kind, spec)
    try:
        text = json.dumps(spec, separators=(",", ":"), allow_nan=False)
    except ValueError:
        raise _bad(f"the {kind} constraint contains a number that is not finite (inf or nan, "
                   "e.g. 1e400); JSON has no such numbers") from None
    except TypeError as e:
        raise _bad(f"the {kind} constraint is not JSON data: {e}") from None
    return Constraint(kind, spec, f"{kind}:{text}")


def _check_nesting(kind: str, spec: Any) -> None:
    """Refuse a spec nested deeper than :data:`MAX_NESTING` (walked without recursion)."""
    stack = [(spec, 1)]
    while stack:
        node, depth = stack.pop()
        children = (node.values() if isinstance(node, dict)
                    else node if isinstance(node, (list, tuple)) else ())
        if depth > MAX_NESTING:
            raise _bad(f"the {kind} constraint is nested more than {MAX_NESTING} levels deep "
                       "(objects and arrays); flatten it")
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list, tuple)))


def _loads(label: str, text: str) -> Any:
    """``json.loads`` of a spec given as text, its errors as invalid requests."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise _bad(f"the {label} is not valid JSON: {e}") from None
    except RecursionError:
        raise _bad(f"the {label} is nested more than {MAX_NESTING} levels deep (objects "
                   "and arrays); flatten it") from None


def _check_spec(kind: str, spec: Any) -> Any:
    if kind == "json":
        if isinstance(spec, str):
            spec = _loads("json schema", spec)
        if not isinstance(spec, (dict, bool)):
            raise _bad(f"a json constraint must be a JSON schema (an object), got "
                       f"{type(spec).__name__}")
        return spec
    if kind == "json_object":
        if spec is not True:
            raise _bad(f"json_object takes true, got {spec!r}")
        return True
    if kind in ("regex", "grammar"):
        if not isinstance(spec, str) or not spec.strip():
            raise _bad(f"a {kind} constraint must be a non-empty string, got {spec!r:.80}")
        return spec
    if kind == "choice":
        if not (isinstance(spec, (list, tuple)) and spec
                and all(isinstance(c, str) and c for c in spec)):
            raise _bad(f"a choice constraint must be a non-empty list of non-empty strings, "
                       f"got {spec!r:.80}")
        return list(spec)
    # structural_tag: the backend's own format
    if isinstance(spec, str):
        spec = _loads("structural_tag", spec)
    if not isinstance(spec, dict):
        raise _bad(f"a structural_tag constraint must be an object, got {type(spec).__name__}")
    return spec


def validate_structured_outputs(structured_outputs: Mapping[str, Any] | None,
                                max_chars: int | None = None) -> None:
    """The frontend's check of a request's constraint (``None`` is fine: no constraint).

    Beyond :func:`parse_constraint`'s shape checks: ``max_chars`` bounds the spec's size
    as compact JSON text (compile time grows faster than the size), and a JSON schema
    must have a finite instance (:mod:`lmkit.structured.schema_check`).

    Raises:
        InvalidRequestError: the constraint is malformed, too long, or can never end.
    """
    if structured_outputs is None:
        return
    constraint = parse_constraint(structured_outputs)
    size = len(constraint.key) - len(constraint.kind) - 1
    if max_chars is not None and size > max_chars:
        raise InvalidRequestError(
            f"the {constraint.kind} constraint is {size} characters long (as compact JSON); "
            f"this server compiles constraints of at most {max_chars} characters "
            "(structured_output.max_constraint_chars), because compile time grows faster "
            "than the size; shorten the constraint or raise the limit",
            param=PARAM, code="constraint_too_large")
    if constraint.kind == "json":
        from lmkit.structured.schema_check import endless_schema_error

        endless = endless_schema_error(constraint.spec)
        if endless is not None:
            raise _bad(endless)

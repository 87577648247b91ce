"""Constraints: ``SamplingParams.structured_outputs`` parsed and validated.

The request side names a constraint with one key (``{"json": schema}``,
``{"regex": "..."}``, ``{"grammar": "..."}``, ``{"choice": [...]}``,
``{"json_object": True}``, ``{"structural_tag": ...}``). Validation here is
backend-independent (shape and types, a size bound, bounded counted repetitions in
regexes, and JSON schemas no finite value satisfies), so the frontend refuses a
malformed or explosive request before it reaches the engine; whether the constraint
compiles is the backend's to say.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
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
# Counted repetitions (``{m,n}``) in regexes (a regex constraint, JSON-schema patterns):
# compilers expand them, so a 20-character pattern can compile for minutes (measured
# with xgrammar 0.2.9 and a 49k vocabulary on a CPU: the schema pattern
# ``^[a-z]{0,30000}$`` took 370 s, ``^([a-z]{1,30}){1,30}$`` 22 s, 400 properties with
# ``[a-z]{3,30}[0-9]{2,20}`` patterns 36 s; a compilation that overruns its time limit
# keeps its thread busy until it ends, which starves the other requests' compilations).
MAX_REPEAT = 1000  # largest count of one repetition (``.{0,1000}``: 2 s)
MAX_NESTED_REPEAT = 100  # largest product of nested counts (``(a{1,10}){1,10}``: 1.5 s)
MAX_REPEAT_TOTAL = 4096  # all the counts of one constraint's regexes together
_COUNTED = re.compile(r"\{(\d*)(,?)(\d*)\}")
_NOT_SCHEMAS = frozenset({"enum", "const", "default", "examples"})  # JSON values, not schemas
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                          "dependentSchemas"})  # names -> schemas


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


def parse_constraint(structured_outputs: Mapping[str, Any],
                     max_chars: int | None = None) -> Constraint:
    """The :class:`Constraint` of a request's ``structured_outputs``.

    ``max_chars`` bounds the spec's size as compact JSON text, checked right after the
    text is made, before anything else walks the spec.

    Raises:
        InvalidRequestError: not exactly one known kind, a spec of the wrong type, or
            one longer than ``max_chars`` (``constraint_too_large``).
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
    try:
        text = json.dumps(spec, separators=(",", ":"), allow_nan=False)
    except RecursionError:  # deeper than the interpreter's limit (above MAX_NESTING)
        raise _bad(f"the {kind} constraint is nested more than {MAX_NESTING} levels deep "
                   "(objects and arrays); flatten it") from None
    except ValueError:
        raise _bad(f"the {kind} constraint contains a number that is not finite (inf or nan, "
                   "e.g. 1e400); JSON has no such numbers") from None
    except TypeError as e:
        raise _bad(f"the {kind} constraint is not JSON data: {e}") from None
    if max_chars is not None and len(text) > max_chars:
        raise InvalidRequestError(
            f"the {kind} constraint is {len(text)} characters long (as compact JSON); "
            f"this server compiles constraints of at most {max_chars} characters "
            "(structured_output.max_constraint_chars), because compile time grows faster "
            "than the size; shorten the constraint or raise the limit",
            param=PARAM, code="constraint_too_large")
    _check_nesting(kind, spec)
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
    as compact JSON text (compile time grows faster than the size; checked first, so a
    huge spec is refused before the walks below), counted repetitions are bounded
    (:func:`check_repetitions`), and a JSON schema must have a finite instance
    (:mod:`lmkit.structured.schema_check`).

    Raises:
        InvalidRequestError: the constraint is malformed, too long, too costly to
            compile, or can never end.
    """
    if structured_outputs is None:
        return
    constraint = parse_constraint(structured_outputs, max_chars)
    check_repetitions(constraint)
    if constraint.kind == "json":
        from lmkit.structured.schema_check import endless_schema_error

        endless = endless_schema_error(constraint.spec)
        if endless is not None:
            raise _bad(endless)


def check_repetitions(constraint: Constraint) -> None:
    """Refuse counted repetitions that make a regex (a ``regex`` constraint, or a
    ``pattern`` / ``patternProperties`` key of a JSON schema or structural tag) costly to
    compile: a count above :data:`MAX_REPEAT`, nested counts whose product is above
    :data:`MAX_NESTED_REPEAT`, or counts above :data:`MAX_REPEAT_TOTAL` in all.

    Raises:
        InvalidRequestError: ``constraint_too_complex``, naming the pattern and the count.
    """
    if constraint.kind == "regex":
        patterns: Iterator[str] = iter([constraint.spec])
    elif constraint.kind in ("json", "structural_tag"):
        patterns = _schema_patterns(constraint.spec)
    else:
        return
    total = 0
    for pattern in patterns:
        for quantifier, count, product in counted_repetitions(pattern):
            shown = f"{pattern[:60]!r}{'...' if len(pattern) > 60 else ''}"
            if count > MAX_REPEAT:
                raise _too_complex(
                    f"the {constraint.kind} constraint's pattern {shown} repeats {quantifier}: "
                    f"a counted repetition may repeat at most {MAX_REPEAT} times")
            if product > MAX_NESTED_REPEAT and product > count:
                raise _too_complex(
                    f"the {constraint.kind} constraint's pattern {shown} nests counted "
                    f"repetitions ({quantifier} of a group that repeats inside) to "
                    f"{product} repetitions; nested counts may multiply to at most "
                    f"{MAX_NESTED_REPEAT}")
            total += product
    if total > MAX_REPEAT_TOTAL:
        raise _too_complex(
            f"the {constraint.kind} constraint's patterns repeat {total} times in all (the "
            f"sum of their counted repetitions); at most {MAX_REPEAT_TOTAL} are allowed")


def _too_complex(message: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"{message}, because compilers expand counted repetitions and compile time grows "
        "faster than the count; use smaller counts, or + / * (with maxLength / maxItems "
        "in a JSON schema)", param=PARAM, code="constraint_too_complex")


def counted_repetitions(pattern: str) -> list[tuple[str, int, int]]:
    """Every counted repetition of a regex: ``(quantifier, count, product)``, where
    ``count`` is its largest bound (``{2,5}``: 5; ``{3,}``: 3) and ``product`` that
    count times the counts nested inside what it repeats (``(a{1,10}){1,10}``: 100).
    ``*``, ``+`` and ``?`` do not multiply (they expand to a loop, not to copies)."""
    found: list[tuple[str, int, int]] = []
    enclosing: list[int] = []  # per open group: the largest product inside it so far
    inside = 1  # the largest product inside the current group
    last: int | None = None  # what a quantifier here would repeat (its product inside)
    i, end = 0, len(pattern)
    while i < end:
        char = pattern[i]
        if char == "\\":
            last, i = 1, i + 2
        elif char == "[":
            last, i = 1, _class_end(pattern, i)
        elif char == "(":
            enclosing.append(inside)
            inside, last, i = 1, None, i + 1
        elif char == ")" and enclosing:
            last = inside
            inside, i = max(enclosing.pop(), inside), i + 1
        elif char == "{" and (m := _COUNTED.match(pattern, i)) and (m[1] or m[3]):
            if last is not None:
                count = max(_count(m[1]), _count(m[3]))
                product = last * count
                found.append((m[0], count, product))
                inside = max(inside, product)
            last, i = None, m.end()
        elif char in "*+?|":
            last, i = None, i + 1
        else:
            last, i = 1, i + 1
    return found


def _count(digits: str) -> int:
    """A quantifier's bound (0 when absent); more than 18 digits count as 10**18, as
    ``int()`` refuses strings of 4,300 digits and more."""
    if not digits:
        return 0
    return int(digits) if len(digits) <= 18 else 10**18


def _class_end(pattern: str, start: int) -> int:
    """The index just past the character class that opens at ``pattern[start]``."""
    i = start + 1
    if pattern.startswith("^", i):
        i += 1
    if pattern.startswith("]", i):  # a ']' first is a literal
        i += 1
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1


def _schema_patterns(spec: Any) -> Iterator[str]:
    """The regexes of a JSON schema (or structural tag): every string ``pattern`` and
    every ``patternProperties`` key, outside ``enum`` / ``const`` / ``default`` values."""
    stack: list[tuple[Any, bool]] = [(spec, False)]  # (node, a map of names to schemas)
    while stack:
        node, named = stack.pop()
        if isinstance(node, dict) and named:  # "properties" etc.: any name, even "enum"
            stack.extend((value, False) for value in node.values())
        elif isinstance(node, dict):
            for key, value in node.items():
                if key == "pattern" and isinstance(value, str):
                    yield value
                elif key not in _NOT_SCHEMAS:
                    if key == "patternProperties" and isinstance(value, dict):
                        yield from (k for k in value if isinstance(k, str))
                    stack.append((value, key in _SCHEMA_MAPS))
        elif isinstance(node, list):
            stack.extend((item, False) for item in node)

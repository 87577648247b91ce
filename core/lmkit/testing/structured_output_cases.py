"""The constraints the structured-output suite compiles, each with an oracle: a
predicate on complete strings and, when the language is finite, the whole language."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Case:
    """A constraint, its kind's feature name, and an oracle for complete strings."""

    feature: str
    kind: str
    spec: Any
    accepts: Callable[[str], bool]
    language: frozenset[str] | None = None  # the whole language, when finite
    alphabet: str = ""  # characters the walks favour (the rest are tried rarely)

    def describe(self) -> str:
        return f"{self.kind} constraint {json.dumps(self.spec)}"


def _regex_language(pattern: str, alphabet: str, max_len: int) -> frozenset[str]:
    words, frontier = set(), [""]
    for _ in range(max_len):
        frontier = [w + c for w in frontier for c in alphabet]
        words.update(w for w in frontier if re.fullmatch(pattern, w))
    return frozenset(words)


REGEX = r"(ab|c)[0-3]{1,2}"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok"], "additionalProperties": False}


def _matches_schema(text: str) -> bool:
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    return (isinstance(doc, dict) and isinstance(doc.get("ok"), bool) and set(doc) <= {"ok", "n"}
            and (("n" not in doc) or (type(doc["n"]) is int and 0 <= doc["n"] <= 9)))


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


CASES = (
    Case("choice", "choice", ["yes", "no", "maybe"], lambda s: s in ("yes", "no", "maybe"),
         frozenset({"yes", "no", "maybe"})),
    Case("regex", "regex", REGEX, lambda s: re.fullmatch(REGEX, s) is not None,
         _regex_language(REGEX, "abc0123", 4)),
    Case("json_schema", "json", SCHEMA, _matches_schema, alphabet='{}":,oktruefalsn0123456789'),
    Case("json_object", "json_object", None, _is_object, alphabet='{}":,abc123'),
)
INVALID = {"regex": ("regex", "a(b"), "json_schema": ("json", {"type": "no-such-type"})}

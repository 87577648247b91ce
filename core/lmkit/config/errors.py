"""Turning pydantic validation errors into messages a user can act on."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ValidationError


def _path(loc: Iterable[Any], prefix: str = "") -> str:
    parts = [prefix] if prefix else []
    parts += [str(p) for p in loc]
    return ".".join(parts) or "(root)"


def format_validation_error(err: ValidationError, prefix: str = "",
                            model: type[BaseModel] | None = None) -> str:
    """One line per problem: the field path, the bad value, what was expected, and for an
    unknown field the closest known one."""
    lines = []
    for e in err.errors():
        path = _path(e["loc"], prefix)
        value = e.get("input")
        if e["type"] == "extra_forbidden":
            known = _known_fields(model, e["loc"][:-1]) if model else []
            hint = difflib.get_close_matches(str(e["loc"][-1]), known, n=1, cutoff=0.6)
            msg = f"{path}: unknown field"
            if hint:
                msg += f"; did you mean {'.'.join([*path.split('.')[:-1], hint[0]])!r}?"
            elif known:
                msg += f"; known fields: {', '.join(known)}"
            lines.append(msg)
        else:
            shown = repr(value) if not isinstance(value, dict) else "{...}"
            lines.append(f"{path}: {e['msg']} (got {shown})")
    return "\n".join(lines)


def _known_fields(model: type[BaseModel] | None, loc: Iterable[Any]) -> list[str]:
    cur: Any = model
    for part in loc:
        if cur is None or not (isinstance(cur, type) and issubclass(cur, BaseModel)):
            return []
        field = cur.model_fields.get(str(part))
        if field is None:
            return []
        cur = field.annotation
    if isinstance(cur, type) and issubclass(cur, BaseModel):
        return list(cur.model_fields)
    return []

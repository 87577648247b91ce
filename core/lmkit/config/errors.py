"""Turning pydantic validation errors into messages a user can act on.

Every line names the field path, the bad value, what was expected, the closest known
name when a name was mistyped, and where the value came from when that is known
(``config file lmkit.yaml, line 4``, ``environment variable LMKIT_...``, ``--attention``).
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

# dotted path -> where its value came from, or None when it is a default
OriginOf = Callable[[str], "str | None"]


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name closest to ``name`` (a likely typo), or ``None``."""
    match = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return match[0] if match else None


def join_path(loc: Iterable[Any], prefix: str = "") -> str:
    """``("scheduler", "max_num_seqs")`` -> ``"scheduler.max_num_seqs"``."""
    parts = [prefix] if prefix else []
    parts += [str(p) for p in loc]
    return ".".join(parts) or "(root)"


def format_validation_error(err: ValidationError, prefix: str = "",
                            model: type[BaseModel] | None = None,
                            origin: OriginOf | None = None) -> str:
    """One line per problem in ``err``.

    :param prefix: dotted path of the validated model inside the whole config
        (``"attention.options"`` when validating a spec's options).
    :param model: the validated model class, used to list and suggest known fields.
    :param origin: maps a full dotted path to where its value came from.
    """
    lines = [_format_one(e, prefix, model) for e in err.errors()]
    if origin is not None:
        lines = [
            _with_origin(line, origin(join_path(e["loc"], prefix)))
            for line, e in zip(lines, err.errors(), strict=True)
        ]
    return "\n".join(lines)


def _with_origin(line: str, where: str | None) -> str:
    return f"{line} [set by {where}]" if where else line


def _format_one(e: Any, prefix: str, model: type[BaseModel] | None) -> str:
    loc: Sequence[Any] = e["loc"]
    path = join_path(loc, prefix)
    if e["type"] == "extra_forbidden":
        known = known_fields(model, loc[:-1]) if model else []
        hint = closest(str(loc[-1]), known)
        msg = f"{path}: unknown field"
        if hint:
            msg += f"; did you mean {join_path([*loc[:-1], hint], prefix)!r}?"
        elif known:
            msg += f"; known fields: {', '.join(known)}"
        return msg
    value = e.get("input")
    shown = "{...}" if isinstance(value, dict) else repr(value)
    if e["type"] == "literal_error":
        allowed = _literal_values(model, loc) if model else []
        msg = f"{path}: {e['msg']} (got {shown})"
        hint = closest(str(value), [str(a) for a in allowed]) if isinstance(value, str) else None
        return msg + (f"; did you mean {hint!r}?" if hint else "")
    if e["type"] == "missing":
        return f"{path}: required field is missing"
    msg = e["msg"].removeprefix("Value error, ")  # a validator's own words
    return f"{path}: {msg} (got {shown})"


def field_annotation(model: type[BaseModel] | None, loc: Iterable[Any]) -> Any:
    """The annotation of the field at ``loc`` inside ``model`` (``None`` if unknown)."""
    cur: Any = model
    for part in loc:
        cur = _unwrap_model(cur)
        if cur is None:
            return None
        field = cur.model_fields.get(str(part))
        if field is None:
            return None
        cur = field.annotation
    return cur


def _unwrap_model(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside ``annotation`` (``Model`` or ``Model | None``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def known_fields(model: type[BaseModel] | None, loc: Iterable[Any]) -> list[str]:
    """Field names of the model found at ``loc`` inside ``model`` (root when ``loc`` is
    empty); empty if there is no model there."""
    loc = list(loc)
    inner = _unwrap_model(field_annotation(model, loc) if loc else model)
    return list(inner.model_fields) if inner else []


def _literal_values(model: type[BaseModel] | None, loc: Sequence[Any]) -> list[Any]:
    annotation = field_annotation(model, loc)
    values: list[Any] = []
    for arg in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(arg) is typing.Literal:
            values += list(typing.get_args(arg))
    return values


def origin_in(origins: dict[str, tuple[str, str]], path: str) -> tuple[str, str] | None:
    """The ``(layer, label)`` that set ``path``: the path itself, else the nearest enclosing
    path that was set as a whole, else any value set inside it."""
    if path in origins:
        return origins[path]
    parts = path.split(".")
    for n in range(len(parts) - 1, 0, -1):
        found = origins.get(".".join(parts[:n]))
        if found is not None:
            return found
    inner = [p for p in origins if p.startswith(path + ".")]
    return origins[max(inner, key=lambda p: _LAYER_RANK.get(origins[p][0], 0))] if inner else None


_LAYER_RANK = {"file": 1, "env": 2, "cli": 3}

"""JSON schemas that no finite JSON value satisfies: self-reference without a way out.

``{"$ref": "#"}``, or an object whose *required* property refers back to the object,
describes only infinitely deep values. A grammar compiled from such a schema accepts no
complete output: the request would fail in the engine (the mask allows nothing) or
generate until ``max_tokens`` without ever closing its JSON. :func:`endless_schema_error`
finds these schemas in the frontend, before the engine sees them, by computing which
subschemas can produce a finite value (the least fixpoint, as for the productive
nonterminals of a grammar), with a worklist so the cost stays linear in the schema.

A schema without ``type`` is read the way grammar backends compile it (measured on
xgrammar 0.2.8): ``properties`` (or ``additionalProperties``/``patternProperties``)
makes it an object, ``items``/``prefixItems`` an array, anything else allows every
type. References outside the document (``$id``, anchors, URLs) are left to the
backend, which names them when it cannot resolve them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

Path = tuple[str, ...]

# where subschemas live: name -> how they are held
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("additionalProperties", "items", "contains", "propertyNames",
                  "unevaluatedProperties", "unevaluatedItems", "not", "if", "then", "else")
_OBJECT_KEYWORDS = ("properties", "additionalProperties", "patternProperties")
_ARRAY_KEYWORDS = ("items", "prefixItems")


def endless_schema_error(schema: Any) -> str | None:
    """Why no finite JSON value satisfies ``schema`` (a message naming the ``$ref`` that
    never ends), or ``None`` when some value can (or the check cannot tell)."""
    nodes = dict(_walk(schema, ()))
    if not nodes:
        return None
    productive = _productive(nodes)
    if productive.get((), True):
        return None
    loop = next((p for p, node in nodes.items() if isinstance(node, dict)
                 and isinstance(node.get("$ref"), str) and not productive[p]), None)
    if loop is None:
        return ("the JSON schema accepts no value (a required part of it is the schema "
                "false); remove that requirement")
    return (f"the JSON schema describes only infinitely deep values: the $ref "
            f"{nodes[loop]['$ref']!r} at {_pointer(loop)} leads back to itself with no way "
            "out, so no finite JSON satisfies it; make the self-reference optional (not "
            "required, in an anyOf with a non-recursive alternative, or in an array that "
            "may be empty)")


def _walk(schema: Any, path: Path) -> Iterator[tuple[Path, Any]]:
    """Every subschema (dict or bool) with its path, parents before children."""
    stack = [(path, schema)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, bool):
            yield path, node
            continue
        if not isinstance(node, dict):
            continue
        yield path, node
        for name in _SCHEMA_MAPS:
            sub = node.get(name)
            if isinstance(sub, dict):
                stack.extend(((*path, name, str(k)), v) for k, v in sub.items())
        for name in (*_SCHEMA_LISTS, *_SCHEMA_VALUES):
            sub = node.get(name)
            if isinstance(sub, list):  # also draft-4 tuple "items"
                stack.extend(((*path, name, str(i)), v) for i, v in enumerate(sub))
            elif name not in _SCHEMA_LISTS:
                stack.append(((*path, name), sub))


def _productive(nodes: dict[Path, Any]) -> dict[Path, bool]:
    """Which subschemas have a finite instance: start from none, mark a node once what
    it needs is marked, and re-examine only the nodes that depend on a newly marked one."""
    productive = dict.fromkeys(nodes, False)
    dependents: dict[Path, list[Path]] = {p: [] for p in nodes}
    for path, node in nodes.items():
        if isinstance(node, dict):
            for dep in _needs(node, path):
                if dep in dependents:
                    dependents[dep].append(path)
    work = list(nodes)
    while work:
        path = work.pop()
        if productive[path] or not _is_productive(nodes[path], path, productive):
            continue
        productive[path] = True
        work.extend(dependents[path])
    return productive


def _needs(node: dict[str, Any], path: Path) -> Iterator[Path]:
    """The subschemas whose productivity ``node``'s depends on."""
    ref = _ref_path(node.get("$ref"))
    if ref is not None:
        yield ref
    for name in ("allOf", "anyOf", "oneOf", "prefixItems"):
        sub = node.get(name)
        if isinstance(sub, list):
            yield from ((*path, name, str(i)) for i in range(len(sub)))
    props = node.get("properties")
    if isinstance(props, dict):
        yield from ((*path, "properties", str(k)) for k in props)
    items = node.get("items")
    if isinstance(items, list):
        yield from ((*path, "items", str(i)) for i in range(len(items)))
    elif items is not None:
        yield (*path, "items")


def _is_productive(node: Any, path: Path, productive: dict[Path, bool]) -> bool:
    if isinstance(node, bool):
        return node

    def ok(p: Path) -> bool:
        return productive.get(p, True)  # not a local subschema: the backend's to judge

    ref = _ref_path(node.get("$ref"))
    if ref is not None and not ok(ref):
        return False
    for name, need_all in (("allOf", True), ("anyOf", False), ("oneOf", False)):
        sub = node.get(name)
        if isinstance(sub, list) and sub:
            found = [ok((*path, name, str(i))) for i in range(len(sub))]
            if not (all(found) if need_all else any(found)):
                return False
    if "const" in node or "enum" in node:
        return True
    return any(_type_has_instance(t, node, path, ok) for t in _types(node))


def _types(node: dict[str, Any]) -> list[str]:
    declared = node.get("type")
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list) and declared:
        return [t for t in declared if isinstance(t, str)]
    if any(k in node for k in _OBJECT_KEYWORDS):
        return ["object"]
    if any(k in node for k in _ARRAY_KEYWORDS):
        return ["array"]
    return ["any"]


def _type_has_instance(kind: str, node: dict[str, Any], path: Path, ok: Any) -> bool:
    if kind == "object":
        props = node.get("properties")
        required = node.get("required")
        if not (isinstance(props, dict) and isinstance(required, list)):
            return True
        return all(ok((*path, "properties", name)) for name in required
                   if isinstance(name, str) and name in props)
    if kind == "array":
        min_items = node.get("minItems")
        if not isinstance(min_items, int) or isinstance(min_items, bool) or min_items <= 0:
            return True
        items = node.get("items")
        prefix_name = "items" if isinstance(items, list) else "prefixItems"
        prefix = node.get(prefix_name)
        num_prefix = len(prefix) if isinstance(prefix, list) else 0
        if not all(ok((*path, prefix_name, str(i))) for i in range(min(min_items, num_prefix))):
            return False
        if min_items > num_prefix and isinstance(items, (dict, bool)):
            return ok((*path, "items"))
        return True
    return True


def _ref_path(ref: Any) -> Path | None:
    """The path of a local JSON-pointer ``$ref`` (``#`` or ``#/a/b``); None otherwise."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    from urllib.parse import unquote

    parts = ref[2:].split("/") if ref != "#" else []
    return tuple(unquote(p).replace("~1", "/").replace("~0", "~") for p in parts)


def _pointer(path: Path) -> str:
    return "#" + "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in path)

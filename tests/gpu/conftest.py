"""Fixtures shared by the GPU tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2(request, tmp_path_factory) -> Path:
    """The converted SmolLM2-135M-Instruct directory: ``LMKIT_TEST_SMOLLM2`` (its GGUF
    file or converted directory; the GPU machine has no network) or the ``smollm2_dir``
    fixture (fetched through the default alias)."""
    path = os.environ.get("LMKIT_TEST_SMOLLM2")
    if not path:
        return request.getfixturevalue("smollm2_dir")
    path = Path(path)
    if path.is_dir():
        return path
    from lmkit.loading.resolve import resolve_model
    from lmkit.plugin_host.manager import PluginHost

    host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
    return resolve_model(str(path), host, cache_dir=tmp_path_factory.mktemp("cache"),
                         progress=False)

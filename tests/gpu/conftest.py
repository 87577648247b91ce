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


@pytest.fixture(scope="module")
def hf_refs():
    """Per model directory: (bf16 model, float32 model) of transformers, loaded once;
    freed at the end (:func:`teacher_forcing.check_against_hf` takes them)."""
    import torch
    from teacher_forcing import DEVICE, hf_model  # this folder is on sys.path (prepend)

    cache: dict[Path, tuple] = {}

    def get(model_dir: Path):
        if model_dir not in cache:
            cache.clear()
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
            cache[model_dir] = (hf_model(model_dir, torch.bfloat16),
                                hf_model(model_dir, torch.float32))
        return cache[model_dir]

    yield get
    cache.clear()

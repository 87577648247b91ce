"""A model directory without a tokenizer is refused before anything of the model loads
(before: only after the weights loaded and the KV cache was allocated, when the frontend
loaded the tokenizer); the engine core alone, which needs no tokenizer, still builds."""

from __future__ import annotations

import pytest
from lmkit.errors import ModelLoadError
from lmkit.loading.tokenizer import TOKENIZER_FILES


@pytest.fixture
def no_tokenizer(tmp_path):
    from lmkit.testing.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path / "tiny")
    for name in TOKENIZER_FILES:
        (path / name).unlink(missing_ok=True)
    return path


def test_llm_refuses_a_model_without_a_tokenizer_before_loading_it(no_tokenizer,
                                                                   monkeypatch):
    import lmkit.loading.model_facts as model_facts
    from lmkit import LLM

    def loaded(*args, **kwargs):
        raise AssertionError("the model's facts were read before the tokenizer check")

    monkeypatch.setattr(model_facts, "load_model_facts", loaded)
    with pytest.raises(ModelLoadError, match="has no tokenizer"):
        LLM(str(no_tokenizer), device="cpu", dtype="float32", progress=False)


def test_the_engine_core_alone_needs_no_tokenizer(no_tokenizer):
    from lmkit.config.schema import LMKitConfig
    from lmkit.engine.core import EngineCore

    config = LMKitConfig.model_validate({
        "model": {"model": str(no_tokenizer), "dtype": "float32", "max_model_len": 64},
        "executor": {"backend": "uniproc", "device": "cpu"}})
    engine = EngineCore(config, progress=False)
    try:
        assert engine.model_dir == no_tokenizer
    finally:
        engine.shutdown()

"""Shutting an engine down gives its memory back: nothing the runner built (model, KV
caches, graphs of every kind, a draft head) outlives ``LLM.shutdown()``, so a second
engine in the same process gets the device to itself (on a GPU, a leaked KV cache left
the next engine no room for its CUDA graphs)."""

from __future__ import annotations

import weakref

import pytest
import torch
from lmkit.api import SamplingParams
from lmkit.frontend.llm import LLM
from lmkit.testing.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-release"))


class Holder:
    """Stands in for the graph runners and the draft head: holds a KV cache tensor and
    the model in a reference cycle, as captured graphs and their buffers do."""

    def __init__(self, runner):
        self.kv = runner.kv_caches
        self.model = runner.model
        self.me = self


def test_shutdown_releases_everything_the_runner_holds(model_dir):
    llm = LLM(str(model_dir), device="cpu", dtype="float32", attention="torch",
              progress=False)
    out = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
    runner = llm.engine.executor.runner
    for name in ("cuda_graphs", "piecewise", "lookahead", "drafter"):
        setattr(runner, name, Holder(runner))  # what CUDA builds; CPU builds none
    refs = {"kv cache": weakref.ref(runner.kv_caches[0]), "model": weakref.ref(runner.model),
            "runner": weakref.ref(runner),
            **{name: weakref.ref(getattr(runner, name))
               for name in ("cuda_graphs", "piecewise", "lookahead", "drafter")}}
    del runner
    llm.shutdown()
    alive = [name for name, ref in refs.items() if ref() is not None]
    assert alive == []
    llm.shutdown()  # twice is fine


def test_release_drops_each_holder():
    from lmkit.worker.model_runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)  # only the attributes release() touches
    runner.requests = {"r": object()}
    for name in ("lookahead", "cuda_graphs", "piecewise", "drafter", "offload", "model"):
        setattr(runner, name, object())
    runner.kv_caches = [torch.zeros(1)]
    runner.release()
    assert runner.kv_caches == [] and runner.requests == {}
    assert all(getattr(runner, name) is None for name in
               ("lookahead", "cuda_graphs", "piecewise", "drafter", "offload", "model"))


@pytest.mark.parametrize("switch", [None, "0"])
def test_startup_heap_frozen_until_shutdown(model_dir, monkeypatch, switch):
    """The engine's startup objects leave the collected generations once it is up (no
    full collection walks them mid-run), and come back at shutdown so the model's
    cycles can be collected; ``LMKIT_GC_FREEZE=0`` leaves the collector alone."""
    import gc

    if switch is None:
        monkeypatch.delenv("LMKIT_GC_FREEZE", raising=False)
    else:
        monkeypatch.setenv("LMKIT_GC_FREEZE", switch)
    gc.unfreeze()
    llm = LLM(str(model_dir), device="cpu", dtype="float32", attention="torch",
              progress=False)
    try:
        frozen = gc.get_freeze_count()
        model = weakref.ref(llm.engine.executor.runner.model)
        assert (frozen > 1000) if switch is None else frozen == 0
        assert model() is not None
    finally:
        llm.shutdown()
    assert gc.get_freeze_count() == 0
    assert model() is None

"""A rank worker (``mp``/``ray`` executors) freezes its startup heap once its KV cache
and graphs exist, and gives it back to the collector when stopped -- as the engine
process does (lmkit.engine.gc_heap)."""

from __future__ import annotations

import gc

from lmkit_plugins.executors.mp_messages import Done, InitKVCache, Stop
from lmkit_plugins.executors.mp_worker import RankWorker


class FakeRunner:
    def __init__(self):
        self.blocks = None

    def initialize_kv_cache(self, num_blocks):
        self.blocks = num_blocks


def test_worker_freezes_after_kv_init_and_unfreezes_at_stop(monkeypatch):
    monkeypatch.delenv("LMKIT_GC_FREEZE", raising=False)
    gc.unfreeze()
    worker = RankWorker({"rank": 1, "world_size": 2})
    worker.runner = runner = FakeRunner()
    assert worker.handle(InitKVCache(seq=3, num_blocks=42)) == Done(1, 3)
    try:
        assert runner.blocks == 42 and gc.get_freeze_count() > 1000
    finally:
        assert worker.handle(Stop(seq=4)) == Done(1, 4)
    assert gc.get_freeze_count() == 0 and worker.runner is None


def test_worker_leaves_the_collector_alone_when_switched_off(monkeypatch):
    monkeypatch.setenv("LMKIT_GC_FREEZE", "0")
    gc.unfreeze()
    worker = RankWorker({"rank": 0, "world_size": 1})
    worker.runner = FakeRunner()
    worker.handle(InitKVCache(seq=1, num_blocks=8))
    assert gc.get_freeze_count() == 0
    worker.handle(Stop(seq=2))

"""bench/gpu_run_watch.py on the CPU: the garbage collector's pauses during a block,
and the slowest engine steps of a run."""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gpu_run_watch as watch  # noqa: E402


def test_gc_pauses_count_collections_by_generation():
    before = len(gc.callbacks)
    with watch.gc_pauses() as pauses:
        gc.collect(0)
        gc.collect(2)
    assert len(gc.callbacks) == before  # the callback is removed again
    assert pauses["gen0"]["count"] >= 1 and pauses["gen2"]["count"] >= 1
    assert pauses["gen2"]["max_s"] > 0 and pauses["gen2"]["s"] >= pauses["gen2"]["max_s"]
    gc.collect(2)  # after the block: not counted
    assert pauses["gen2"]["count"] == 1


def test_slowest_steps_are_ranked_with_what_ran():
    def so(tokens, new=0):
        return SimpleNamespace(num_scheduled_tokens={f"r{i}": t for i, t in enumerate(tokens)},
                               scheduled_new_reqs=[object()] * new)

    steps = [(0.040, so([512, 512], new=2)), (0.005, so([1, 1])), (0.250, so([1, 1])),
             (0.006, None)]
    top = watch.slowest_steps(steps, top=2)
    assert top == [{"step": 2, "ms": 250.0, "tokens": 2, "reqs": 2, "new_reqs": 0},
                   {"step": 0, "ms": 40.0, "tokens": 1024, "reqs": 2, "new_reqs": 2}]

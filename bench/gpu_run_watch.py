"""What stalls a timed benchmark run, recorded while it runs (``bench/gpu_engine.py``'s
lmkit side): Triton compiles (with the variant's full specialisation key), the garbage
collector's pauses by generation, and the slowest engine steps."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from typing import Any


def watch_jit_compiles() -> list[str]:
    """Triton kernels compiled from now on (name, launch options and the specialisation
    key: argument types, alignments, constexprs), as a list that grows; empty if this
    Triton has no compile hook. A compile in a timed run costs up to a second of it."""
    events: list[str] = []
    try:
        from triton import knobs

        def hook(*, repr: str, key: Any = None, **_: Any) -> bool:
            events.append(f"{repr.split('](')[0]}] key={str(key)[:900]}")
            return False  # compile as usual

        knobs.runtime.jit_cache_hook = hook
    except (ImportError, AttributeError):
        pass
    return events


@contextlib.contextmanager
def gc_pauses() -> Iterator[dict[str, Any]]:
    """Python's garbage-collector pauses while the block runs, by generation: count,
    total and longest seconds (a full collection over a large heap stalls the step
    loop, and with it the GPU)."""
    stats: dict[str, Any] = {f"gen{g}": {"count": 0, "s": 0.0, "max_s": 0.0} for g in range(3)}
    started: list[float] = []

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            dt = time.perf_counter() - started.pop()
            slot = stats[f"gen{info['generation']}"]
            slot["count"] += 1
            slot["s"] += dt
            slot["max_s"] = max(slot["max_s"], dt)

    gc.callbacks.append(callback)
    try:
        yield stats
    finally:
        gc.callbacks.remove(callback)


def slowest_steps(steps: list[tuple[float, Any]], top: int = 5) -> list[dict[str, Any]]:
    """The ``top`` longest engine steps of a run: index, ms, scheduled tokens and
    requests, and whether new requests were in it."""
    rows = []
    for i, (dt, so) in enumerate(steps):
        tokens = sum(so.num_scheduled_tokens.values()) if so is not None else 0
        rows.append({"step": i, "ms": round(1e3 * dt, 2), "tokens": tokens,
                     "reqs": len(so.num_scheduled_tokens) if so is not None else 0,
                     "new_reqs": len(so.scheduled_new_reqs) if so is not None else 0})
    return sorted(rows, key=lambda r: -r["ms"])[:top]

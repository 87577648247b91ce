"""Running one benchmark side in its own process, so memory peaks do not mix."""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_module
import resource
import sys
from collections.abc import Callable
from typing import Any


def peak_memory() -> dict[str, float]:
    """Peak resident memory of this process (and peak CUDA memory if torch used it)."""
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"peak_rss_gb": rss_kb * (1 if sys.platform == "darwin" else 1024) / 2**30}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        out["peak_cuda_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def _child(fn: Callable[..., dict[str, Any]], args: tuple, queue: Any) -> None:
    try:
        result = fn(*args)
        result.update(peak_memory())
        queue.put(("ok", result))
    except BaseException as e:  # report to the parent, which prints it
        import traceback

        queue.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_isolated(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """Run ``fn(*args)`` in a fresh (spawned) process; return its result dict."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(fn, args, queue))
    proc.start()
    while True:  # a side that dies without a result (a crash, the OOM killer) must not hang
        try:
            status, payload = queue.get(timeout=1.0)
            break
        except queue_module.Empty:
            if not proc.is_alive() and queue.empty():
                raise RuntimeError(f"benchmark process {fn.__name__} exited with code "
                                   f"{proc.exitcode} without a result") from None
    proc.join()
    if status != "ok":
        raise RuntimeError(f"benchmark process failed: {payload}")
    return payload

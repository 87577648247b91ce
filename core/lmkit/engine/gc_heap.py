"""Keeping Python's garbage collector off the engine's startup heap.

An engine process holds hundreds of thousands of long-lived objects from startup
(modules, the model's parameters and buffers, CUDA graphs, the KV block pool). A full
(generation-2) collection walks all of them, and it comes when enough new objects have
survived -- in the middle of a run, as one stall of the step loop (and of the GPU
behind it). After startup :func:`freeze_startup_heap` collects once and moves every
object then alive to the permanent generation (:func:`gc.freeze`), so later
collections walk only what the run itself made; :func:`unfreeze_heap` gives them back
at shutdown, so that reference cycles among them (modules, graphs holding device
memory) can be collected then. vLLM's engine does the same after its startup. The
``mp``/``ray`` executors' rank workers do it too, once their KV cache and graphs exist
(through ``lmkit.api``), and unfreeze when stopped.
``LMKIT_GC_FREEZE=0`` turns it off (the A/B switch).
"""

from __future__ import annotations

import gc

from lmkit.platform import switched_off

ENV = "LMKIT_GC_FREEZE"


def freeze_startup_heap() -> bool:
    """Collect, then freeze every object alive (unless ``LMKIT_GC_FREEZE=0``); returns
    whether it froze."""
    if switched_off(ENV):
        return False
    gc.collect()
    gc.freeze()
    return True


def unfreeze_heap() -> None:
    """Move frozen objects back to the collected generations (at shutdown: cycles among
    them are collected again). Objects frozen by another engine in this process are
    unfrozen too, which costs only later collections' time."""
    gc.unfreeze()

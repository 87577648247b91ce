"""Cheap facts about this machine, answered without importing torch or CUDA libraries."""

from __future__ import annotations

import ctypes
import functools
import os


@functools.cache
def cuda_device_count() -> int:
    """Number of usable CUDA devices, asked of the driver through ``libcuda`` directly.

    Importing torch just to answer this would cost a second on every ``lmkit`` command.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return 0
    for lib in ("libcuda.so.1", "libcuda.so"):
        try:
            cuda = ctypes.CDLL(lib)
        except OSError:
            continue
        if cuda.cuInit(0) != 0:
            return 0
        count = ctypes.c_int(0)
        if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return 0
        return count.value
    return 0

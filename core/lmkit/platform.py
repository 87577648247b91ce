"""Cheap facts about this machine, answered without importing torch or CUDA libraries."""

from __future__ import annotations

import ctypes
import functools
import os
import sys

# Runs a module as `python -m` does, but with the working directory off sys.path: `-m`
# and `-c` put it first, so a stray `zmq.py` or `pip.py` there would run in the child.
# Python 3.11+ has -P for this; 3.10 needs the launcher to drop the entry itself.
_RUN_MODULE = ("import sys, runpy\n"
               "if not getattr(sys.flags, 'safe_path', False): del sys.path[0]\n"
               "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)\n")


def switched_off(variable: str) -> bool:
    """Whether the environment turns an optimisation off: ``variable`` set to ``0``,
    ``false``, ``off`` or ``no`` (any case; unset: on). The engine's A/B switches
    (``LMKIT_DECODE_LOOKAHEAD``, ``LMKIT_PIECEWISE_GRAPHS``) read it this way."""
    return os.environ.get(variable, "1").strip().lower() in ("0", "false", "off", "no")


def python_module_command(module: str, *args: str) -> list[str]:
    """The command line of ``python -m MODULE ARGS`` in this interpreter, for a child
    process that must not import from the working directory."""
    return [sys.executable, "-c", _RUN_MODULE, module, *args]


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


@functools.cache
def cuda_compute_capability(index: int = 0) -> tuple[int, int] | None:
    """``(major, minor)`` of CUDA device ``index`` (after ``CUDA_VISIBLE_DEVICES``), asked
    of the driver through ``libcuda`` like :func:`cuda_device_count`; ``None`` when there
    is no such device."""
    if index >= cuda_device_count():
        return None
    for lib in ("libcuda.so.1", "libcuda.so"):
        try:
            cuda = ctypes.CDLL(lib)
        except OSError:
            continue
        device = ctypes.c_int(0)
        if cuda.cuDeviceGet(ctypes.byref(device), index) != 0:
            return None
        major, minor = ctypes.c_int(0), ctypes.c_int(0)
        # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75, _MINOR = 76
        if (cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, device) != 0
                or cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, device) != 0):
            return None
        return major.value, minor.value
    return None


_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


@functools.cache
def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware: its ``/proc/cpuinfo`` flags name
    AMX-BF16 or AVX512-BF16 (Sapphire Rapids and later Xeons, AMD Zen 4 and later).
    oneDNN then runs torch's bfloat16 matmuls on those units (with AMX, MiniLM's
    projections ran 7x faster than in float32). ``False`` where the flags cannot be read
    (not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[-1].split())
                    return any(flag in flags for flag in _BF16_CPU_FLAGS)
    except OSError:
        pass
    return False

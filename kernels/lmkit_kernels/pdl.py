"""Programmatic dependent launch (PDL) for the small kernels of a decode step.

A batch-1 decode step is a chain of ~200-300 short kernels (GEMVs of 5-45 us, attention,
RoPE, norms). Between two of them the GPU normally drains the first kernel completely,
then launches and ramps up the second: a few microseconds per boundary in which HBM
sits idle. On Hopper and later, a kernel launched with PDL may start while its
predecessor's last programs still run; it then *waits* (``griddepcontrol.wait``) until
the predecessor has completed and its writes are visible, before touching anything the
predecessor wrote. The launch, the program scheduling and whatever a program does before
its wait (a GEMV can ask for its first weight slices, which no kernel of the step
writes) overlap the predecessor's tail.

The contract every PDL-launched kernel here keeps, so that the chain stays exactly as
ordered as without PDL:

* every program calls :func:`pdl_wait` before it reads anything an earlier kernel of the
  stream may have written and before it writes anything -- including programs that
  have no work (a kernel must never complete before its predecessor);
* :func:`pdl_wait` also lets the *next* kernel launch (``griddepcontrol.
  launch_dependents``): only after this program's own wait, so at most two kernels of
  the chain are ever in flight, and the next one's programs take SM slots only once
  every program of this one has been scheduled.

So before its wait a program may read whatever the kernels *two or more* places
earlier in the stream wrote (and the host's copies at the start of the step: block
tables, sequence lengths, slot mappings), never what the previous kernel writes;
and it may prefetch any line into L2 (:func:`prefetch_l2`: L2 is coherent).

A kernel launched without PDL after one launched with it is ordered as usual (it starts
after the whole predecessor completes), and a PDL kernel after a torch/cuBLAS kernel
waits for it to complete, so PDL kernels mix freely with others. Under CUDA-graph
capture the launches become programmatic graph edges.

``LMKIT_PDL=0`` turns PDL off (every kernel then launches as before, and
``pdl_wait`` compiles to nothing). It is on by default on GPUs of compute capability 9.0
and later with a Triton that has ``launch_pdl``; never in Triton's CPU interpreter.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl

from lmkit_kernels.checks import is_interpreting

__all__ = ["ENV", "PREFETCH_ENV", "count_setting", "pdl_enabled", "pdl_launch_args", "pdl_wait", "switch_on",
           "prefetch_args", "prefetch_depth", "prefetch_enabled", "prefetch_l2",
           "prefetch_weight_rows"]

#: the switch: ``0`` turns programmatic dependent launch off
ENV = "LMKIT_PDL"
#: how many ``block_k`` slices of its weight rows a GEMV program prefetches before its
#: wait (a power of two; default 1); ``0`` keeps PDL without any prefetch
PREFETCH_ENV = "LMKIT_PDL_PREFETCH"

try:  # griddepcontrol in Triton >= 3.4 (the GPU machine has 3.6)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _HAS_GDC = True
except ImportError:  # pragma: no cover - old Triton: PDL stays off
    _HAS_GDC = False


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait until the previous kernel of the stream has completed (its writes visible),
    then let the next PDL-launched kernel start. Compiles to nothing unless
    ``USE_PDL``. Call it in every program, before its first dependent read or write."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask for the cache lines holding ``ptrs`` to be brought into L2, without waiting
    for them or loading anything into registers (one pointer per 128-byte line is
    enough). L2 is shared by all SMs, so a line prefetched before a later write still
    reads the written value afterwards: prefetching is always safe; it only pays for
    data that is read soon after."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                              [ptrs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_weight_rows(w_ptr, rows, N, K, stride_wn, PF_LINE: tl.constexpr,
                         PF_LINES: tl.constexpr):
    """Prefetch into L2 the first ``PF_LINES`` 128-byte lines (``PF_LINE`` elements each)
    of weight rows ``rows`` (clamped to ``N`` rows, ``K`` columns): what a
    weight-streaming program does before :func:`pdl_wait`, so its first weight slice
    arrives while the previous kernel finishes. Compiles to nothing when ``PF_LINES``
    is 0 (see :func:`prefetch_args`)."""
    if PF_LINES > 0:
        safe_rows = tl.minimum(rows, N - 1).to(tl.int64)
        offs = tl.minimum(tl.arange(0, PF_LINES) * PF_LINE, K - 1)
        prefetch_l2(w_ptr + safe_rows[:, None] * stride_wn + offs[None, :])


def switch_on(name: str) -> bool:
    """Environment switch ``name``: on unless set to 0/false/no/off (any case).

    :raises ValueError: set to anything else.
    """
    value = os.environ.get(name, "1").strip().lower()
    if value in ("1", "true", "yes", "on", ""):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r}: expected 1 (on, the default) or 0 (off)")


@functools.cache
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: a CUDA device of compute capability
    9.0 or later, a Triton with griddepcontrol, not the interpreter, ``LMKIT_PDL`` not 0.

    :raises ValueError: ``LMKIT_PDL`` set to something other than 0/1.
    """
    if device.type != "cuda" or not _HAS_GDC or is_interpreting() or not switch_on(ENV):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_supports(index)


def pdl_launch_args(device: torch.device) -> dict[str, Any]:
    """Keyword arguments for a launch of a kernel whose programs call :func:`pdl_wait`
    (its constexpr parameter named ``USE_PDL``): ``USE_PDL`` and Triton's
    ``launch_pdl``, both on exactly when :func:`pdl_enabled`."""
    if pdl_enabled(device):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


def count_setting(name: str, allowed: tuple[int, ...], what: str) -> int:
    """Environment setting ``name``: one of the counts ``allowed`` (unset or empty: 1,
    the default), e.g. how many slices or tiles a kernel prefetches.

    :raises ValueError: set to anything else, naming the setting, the counts it takes
        and ``what`` they count."""
    value = os.environ.get(name, "1").strip() or "1"
    if value.isdigit() and int(value) in allowed:
        return int(value)
    named = [str(n) + (" (the default)" if n == 1 else "") for n in allowed]
    choices = ", ".join(named[:-1]) + " or " + named[-1]
    raise ValueError(f"{name}={value!r}: expected {choices} {what}")


def _prefetch_slices() -> int:
    return count_setting(PREFETCH_ENV, (0, 1, 2, 4, 8), "weight slices (0: no prefetch)")


def prefetch_depth(device: torch.device) -> int:
    """How many ``block_k`` weight slices a GEMV program prefetches before its PDL wait:
    ``LMKIT_PDL_PREFETCH`` (default 1) when PDL is on for ``device``, else 0.

    :raises ValueError: ``LMKIT_PDL_PREFETCH`` not one of 0, 1, 2, 4, 8.
    """
    return _prefetch_slices() if pdl_enabled(device) else 0


def prefetch_enabled(device: torch.device) -> bool:
    """Whether kernels prefetch into L2 before their PDL wait (:func:`prefetch_depth`
    above 0)."""
    return prefetch_depth(device) > 0


def prefetch_args(weight: torch.Tensor, block_k: int) -> dict[str, int]:
    """``PF_LINE`` / ``PF_LINES`` for :func:`prefetch_weight_rows`: the lines of the first
    :func:`prefetch_depth` ``block_k`` slices of ``weight``'s rows (``PF_LINES=0``: no
    prefetch)."""
    line = max(1, 128 // weight.element_size())
    depth = prefetch_depth(weight.device)
    return {"PF_LINE": line, "PF_LINES": max(1, depth * block_k // line) if depth else 0}

"""``x @ weight.T + bias`` for a few float32 rows on the CPU: the C row-GEMV kernel.

At decode time a projection's input has one row per sequence (one for a single
stream), and the product is bound by reading the weight. ``row_gemv.c`` splits the
weight's ``[out, in]`` rows into one contiguous slice per thread, so each thread reads
one sequential stream; on a 2-core AMD EPYC (AVX-512) it reads a model's 538 MB of
float32 projections at 39-40 GB/s where oneDNN reaches 30 GB/s (``bench/cpu_gemv.py``).
Each output element is one dot product in a fixed order, so a row's result is the same
whatever else shares the call and however many threads run it.

The library holds two builds, one for AVX-512F and one for AVX2 + FMA (x86-64 CPUs
without AVX-512, such as AMD Zen 2/3); the best one this CPU runs is used
(:func:`row_gemv_isa`; ``LMKIT_CPU_ISA=avx2`` pins one, e.g. to compare them), and each
is self-checked against torch before first use.

:func:`row_gemv_linear` is used for inputs of at most :data:`MAX_ROWS` rows (decode
batches: from 1 to 32 rows it is 30% faster to within 8% slower than oneDNN on the
``[in, out]`` layout, and faster than oneDNN on this ``[out, in]`` one); callers keep
oneDNN for larger ones (prefill), which it runs as fast as either layout.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from pathlib import Path

import torch

from lmkit_kernels.cpu.build import KernelUnavailable, bind_kernel_library
from lmkit_kernels.cpu.checks import require_float32_cpu, require_kernel

__all__ = ["ISAS", "MAX_ROWS", "row_gemv_available", "row_gemv_isa", "row_gemv_linear",
           "row_gemv_unavailable_reason", "row_gemv_variants", "unchecked_row_gemv"]

MAX_ROWS = 32  # inputs up to this many rows take the kernel (decode batches)
SOURCE = Path(__file__).with_name("row_gemv.c")
ABI = 2
ISAS = ("avx512f", "avx2")  # the library's builds, best first
ISA_ENV = "LMKIT_CPU_ISA"  # pins one build

_P, _L = ctypes.c_void_p, ctypes.c_long
_SIGNATURE = ([_P, _L, _P, _L, _P, _P, _L, _L, _L, _L, ctypes.c_int], None)


@functools.cache
def _variants() -> tuple[dict[str, ctypes._CFuncPtr], str]:  # type: ignore[name-defined]
    """The builds this CPU runs, best first, each self-checked; or ``{}`` and the reason."""
    lib, reason = bind_kernel_library(
        SOURCE, "lmkit_row_gemv_abi", ABI, what="CPU row-GEMV kernel",
        fallback="torch's linear", check=_check,
        functions={f"lmkit_row_gemv_{isa}": _SIGNATURE for isa in ISAS}
        | {"lmkit_row_gemv_isa_supported": ([ctypes.c_char_p], ctypes.c_int)})
    if lib is None:
        return {}, reason
    return {isa: getattr(lib, f"lmkit_row_gemv_{isa}") for isa in _usable(lib)}, ""


def _usable(lib: ctypes.CDLL) -> list[str]:
    """The builds to use, best first: those this CPU runs, or the one ``LMKIT_CPU_ISA``
    names. Raises :class:`KernelUnavailable` when there is none."""
    supported = [isa for isa in ISAS if lib.lmkit_row_gemv_isa_supported(isa.encode())]
    pin = os.environ.get(ISA_ENV, "").strip().lower()
    if not pin:
        if not supported:
            raise KernelUnavailable("this CPU runs neither AVX-512F nor AVX2 + FMA code")
        return supported
    if pin not in ISAS:
        raise KernelUnavailable(f"{ISA_ENV}={pin!r} is not one of {', '.join(ISAS)}")
    if pin not in supported:
        raise KernelUnavailable(f"{ISA_ENV}={pin} but this CPU does not run {pin} code")
    return [pin]


def _check(lib: ctypes.CDLL) -> None:
    for isa in _usable(lib):
        _self_check(getattr(lib, f"lmkit_row_gemv_{isa}"), isa)


def _self_check(fn: ctypes._CFuncPtr, isa: str) -> None:  # type: ignore[name-defined]
    # odd sizes cover the masked k tail, single-row tails, partial x blocks and a bias
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 37, generator=gen)
    w = torch.randn(21, 37, generator=gen)
    b = torch.randn(21, generator=gen)
    out = _call(fn, x, w, b)
    if not torch.allclose(out, torch.addmm(b, x, w.t()), rtol=1e-5, atol=1e-5):
        raise KernelUnavailable(f"the compiled {isa} kernel failed its self-check against torch")


def _kernel() -> tuple[ctypes._CFuncPtr | None, str]:  # type: ignore[name-defined]
    """The best build's function, or ``None`` and the reason."""
    variants, reason = _variants()
    return (next(iter(variants.values())), "") if variants else (None, reason)


def row_gemv_available() -> bool:
    """Whether the kernel is compiled, loaded and usable on this machine."""
    return _kernel()[0] is not None


def row_gemv_isa() -> str:
    """The build in use (one of :data:`ISAS`), or ``""`` when the kernel is not available."""
    return next(iter(_variants()[0]), "")


def row_gemv_unavailable_reason() -> str:
    """Why the kernel is not used (empty when it is)."""
    return _kernel()[1]


def _call(fn: ctypes._CFuncPtr, x: torch.Tensor, weight: torch.Tensor,  # type: ignore[name-defined]
          bias: torch.Tensor | None) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    fn(x.data_ptr(), x.stride(0), weight.data_ptr(), weight.stride(0),
       None if bias is None else bias.data_ptr(), out.data_ptr(), n, m, n, k,
       torch.get_num_threads())
    return out


LinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def unchecked_row_gemv() -> LinearFn | None:
    """The kernel (best build) without per-call checks, for a model's hot path; ``None``
    when not available.

    The caller guarantees what :func:`row_gemv_linear` checks for ``weight`` and
    ``bias`` (once, when it builds the layer) and passes at most :data:`MAX_ROWS` rows
    of a float32 CPU ``x``; ``x`` is made contiguous along ``in`` if it is not.
    """
    fn = _kernel()[0]
    return None if fn is None else _unchecked(fn)


def row_gemv_variants() -> dict[str, LinearFn]:
    """Every build this CPU runs, by ISA name (best first), as :func:`unchecked_row_gemv`
    functions; empty when the kernel is not available. For benchmarks and tests."""
    return {isa: _unchecked(fn) for isa, fn in _variants()[0].items()}


def _unchecked(fn: ctypes._CFuncPtr) -> LinearFn:  # type: ignore[name-defined]
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
               ) -> torch.Tensor:
        return _call(fn, x if x.stride(1) == 1 else x.contiguous(), weight, bias)

    return linear


def row_gemv_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                    ) -> torch.Tensor:
    """``x [m, in] @ weight[out, in].T + bias [out]`` in float32 on the CPU.

    ``weight`` must have unit stride along ``in`` (rows may be further apart), ``x``
    at most :data:`MAX_ROWS` rows; ``bias`` contiguous or ``None``. Raises
    ``RuntimeError`` when the kernel is not available (check
    :func:`row_gemv_available`) and ``ValueError`` for inputs it does not take.
    """
    fn = require_kernel(_kernel()[0], "CPU row-GEMV kernel", row_gemv_unavailable_reason())
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"row_gemv_linear: x {tuple(x.shape)} and weight "
                         f"{tuple(weight.shape)} are not [m, in] and [out, in]")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"row_gemv_linear takes at most {MAX_ROWS} rows, got {x.shape[0]}")
    require_float32_cpu("row_gemv_linear", x=x, weight=weight, bias=bias)
    if weight.stride(1) != 1:
        raise ValueError("row_gemv_linear: weight rows must be contiguous (unit stride "
                         "along in)")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]
                             or bias.stride(0) != 1):
        raise ValueError(f"row_gemv_linear: bias must be a contiguous [{weight.shape[0]}]")
    if x.stride(1) != 1:
        x = x.contiguous()
    return _call(fn, x, weight, bias)

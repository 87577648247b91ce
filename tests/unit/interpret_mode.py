"""The preamble of every test module that runs lmkit's Triton kernels in Triton's CPU
interpreter (``TRITON_INTERPRET=1``).

Call :func:`require_triton_interpreter` at the top of the module, before importing
anything that imports triton. It skips the whole module when triton is missing, when
CUDA is available (the compiled kernels are tested in tests/gpu) unless
``TRITON_INTERPRET=1`` is set for the session, and when triton was imported before the
interpreter could be switched on (its kernels would then be compiled, not interpreted).
tests/conftest.py sets ``TRITON_INTERPRET=1`` on CPU-only machines before any import.
"""

from __future__ import annotations

import os

import pytest

CUDA_REASON = ("CUDA is available: the compiled kernels are tested in tests/gpu (set "
               "TRITON_INTERPRET=1 to run the interpreter tests here)")


def require_triton_interpreter(cuda_reason: str = CUDA_REASON) -> None:
    """Switch Triton to its interpreter or skip the calling module (see the module doc)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(cuda_reason, allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
    pytest.importorskip("triton", reason="triton is not installed (pip install 'lmkit[test]')")
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.zeros, InterpretedFunction):
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; run this module "
                    "with TRITON_INTERPRET=1 in the environment", allow_module_level=True)


def interpreted_spec(spec, **values):
    """``spec`` (a CUDA-only kernel backend's registered Spec) re-declared for the CPU,
    where its kernels run in the interpreter: ``device: cpu``, no CUDA needed, no
    ``cuda_graphs``; ``values`` replace other caps values (e.g. ``head_size``). Register
    it (a test plugin's hookimpl) or hand it to a conformance kit."""
    import dataclasses

    from lmkit.api import Caps

    caps = Caps(spec.caps.features - {"cuda_graphs"},
                {**spec.caps.values, "device": {"cpu"}, **values})
    return dataclasses.replace(spec, name=f"{spec.name}_interpreted", needs_cuda=False,
                               caps=caps)


def assert_ulps_apart(got, want, max_ulps: int = 1) -> None:
    """``got`` equals ``want`` (same shape and half-precision dtype) up to ``max_ulps``
    units in the last place per element: the interpreter's ``tl.dot`` is numpy's matmul,
    whose OpenBLAS kernels sum in an order that depends on the operands' shapes on some
    CPUs (seen on an AVX-512 AMD EPYC: the same columns of ``x @ w`` differ in the last
    bit between ``w`` and a slice of it), so two kernels that tile a product differently
    can round an element one ulp apart where the compiled kernels (tests/gpu) agree bit
    for bit."""
    import torch

    assert got.shape == want.shape and got.dtype == want.dtype
    a, b = got.view(torch.int16).int(), want.view(torch.int16).int()
    # the half's bits as a monotonic integer line (negatives mirrored below zero)
    a, b = (torch.where(t < 0, -(t & 0x7FFF), t) for t in (a, b))
    ulps = (a - b).abs()
    assert int(ulps.max()) <= max_ulps, (
        f"{int((ulps > max_ulps).sum())} elements more than {max_ulps} ulp apart "
        f"(at most {int(ulps.max())})")

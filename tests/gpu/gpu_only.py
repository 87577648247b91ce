"""The guard every GPU test module starts with."""

from __future__ import annotations

import os

import pytest


def require_cuda_and_triton() -> None:
    """Skip the calling test module unless a CUDA device is present and Triton kernels
    run compiled (``TRITON_INTERPRET=1`` would run them in the interpreter)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device", allow_module_level=True)
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 would run the kernels in the interpreter; unset it",
                    allow_module_level=True)
    pytest.importorskip("triton")

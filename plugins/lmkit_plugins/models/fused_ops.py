"""Which layer operations run as lmkit's fused Triton kernels instead of torch ops.

On CUDA in half precision the per-layer elementwise work (residual add + RMSNorm,
q/k norm + RoPE, SiLU-and-multiply) is memory- and launch-bound; as torch ops it is
about 25 kernels per decoder layer, which at batch 1 costs as much time as reading
the weights. :mod:`lmkit_kernels` does each in one kernel (three to four per layer).

Float32 and CPU models keep the torch ops (which match Hugging Face bit for bit on
the CPU). ``LMKIT_FUSED_OPS=0`` turns the kernels off everywhere (for A/B checks).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)


def fused_ops_enabled(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether a layer built for ``device`` and ``dtype`` should use the fused kernels:
    CUDA, float16/bfloat16, Triton installed, and ``LMKIT_FUSED_OPS`` not ``0``."""
    if os.environ.get("LMKIT_FUSED_OPS", "1").strip() in ("0", "false", "no", "off"):
        return False
    return (torch.device(device).type == "cuda" and dtype in HALF_DTYPES
            and importlib.util.find_spec("triton") is not None)


def rms_norm_kernel() -> Callable[..., Any]:
    """``(x, weight, eps, residual=None)``: :func:`lmkit_kernels.norm.rms_norm`."""
    from lmkit_kernels.norm import rms_norm

    return rms_norm


def silu_and_mul_kernel() -> Callable[[torch.Tensor], torch.Tensor]:
    """``gate_up -> silu(gate) * up``: :func:`lmkit_kernels.activation.silu_and_mul`."""
    from lmkit_kernels.activation import silu_and_mul

    return silu_and_mul


def rotary_qk_kernel() -> Callable[..., None]:
    """In-place q/k norm + RoPE on a fused QKV output: :func:`lmkit_kernels.rotary.rotary_qk_`."""
    from lmkit_kernels.rotary import rotary_qk_

    return rotary_qk_

"""Argument checks shared by the checked entry points of the CPU kernels
(``row_gemv_linear``, ``add_rms_norm``, ``paged_decode_attention``)."""

from __future__ import annotations

from typing import TypeVar

import torch

F = TypeVar("F")


def require_kernel(fn: F | None, what: str, reason: str) -> F:
    """``fn``, or ``RuntimeError`` saying ``what`` is not available and why."""
    if fn is None:
        raise RuntimeError(f"the {what} is not available: {reason}")
    return fn


def require_float32_cpu(caller: str, **tensors: torch.Tensor | None) -> None:
    """``ValueError`` naming the first of ``tensors`` (``None`` skipped) that is not a
    float32 CPU tensor."""
    for name, t in tensors.items():
        if t is not None and (t.dtype != torch.float32 or t.device.type != "cpu"):
            raise ValueError(f"{caller}: {name} must be a float32 CPU tensor, "
                             f"got {t.dtype} on {t.device}")

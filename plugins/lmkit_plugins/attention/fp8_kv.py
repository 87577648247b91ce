"""FP8 (e4m3) KV cache storage in plain torch, for the reference backends.

An FP8 cache stores ``clamp(k * (1 / k_scale), -448, 448)`` as ``torch.float8_e4m3fn``
(round to nearest even, as the Triton cache write does) and is read back as the stored
value times the scale. The CPU has no ``index_copy_`` for float8, so stores go through
the cache's byte view.
"""

from __future__ import annotations

import torch
from lmkit.api import FP8_KV_MAX


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x * (1 / scale)`` in float32 (as the Triton cache write computes it), saturated
    to +-:data:`lmkit.api.FP8_KV_MAX`, as ``torch.float8_e4m3fn``."""
    y = x.float() if scale == 1.0 else x.float() * (1.0 / scale)
    return y.clamp_(-FP8_KV_MAX, FP8_KV_MAX).to(torch.float8_e4m3fn)


def store_kv(kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             k_scale: float, v_scale: float) -> None:
    """Write ``k``, ``v`` (``[n, num_kv_heads, head_size]``) quantized into the FP8
    cache ``[2, num_blocks, block_size, num_kv_heads, head_size]`` at ``slots``."""
    _, _, _, hkv, d = kv_cache.shape
    kv = torch.stack((quantize(k, k_scale), quantize(v, v_scale)))
    kv_cache.view(torch.uint8).view(2, -1, hkv, d).index_copy_(1, slots, kv.view(torch.uint8))


def dequantize_kv(kv: torch.Tensor, dtype: torch.dtype, k_scale: float,
                  v_scale: float) -> torch.Tensor:
    """Gathered FP8 K/V ``[2, ...]`` (keys, values) in ``dtype``, times their scales."""
    out = kv.to(dtype)
    if k_scale != 1.0:
        out[0].mul_(k_scale)
    if v_scale != 1.0:
        out[1].mul_(v_scale)
    return out

"""Rotary position embeddings (RoPE) in the "rotate half" (GPT-NeoX) layout.

The inverse frequencies follow the checkpoint's ``rope_parameters`` (transformers 5.x)
or ``rope_theta`` + ``rope_scaling`` (4.x): ``default``, ``linear`` and ``llama3``
scaling are supported. cos/sin are computed once per step from the positions (no
table of ``max_position_embeddings`` rows) exactly as HF does, in float32, and applied
with HF's rounding, so logits match HF bit for bit up to the attention kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from lmkit.api import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """What determines the rotary frequencies of a model."""

    theta: float
    rope_type: str
    params: dict[str, Any]
    rotary_dim: int


def rope_config_from_hf(hf_config: Any, head_dim: int) -> RopeConfig:
    """Read the RoPE settings of an HF config (transformers 4.x or 5.x attribute names).

    Raises:
        ModelLoadError: the checkpoint uses a RoPE type lmkit does not implement.
    """
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    params = dict(params or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        # per-layer-type parameters ({"full_attention": {...}, ...}): one kind only
        kinds = sorted(params)
        if len(kinds) != 1:
            raise ModelLoadError(
                f"this model uses different RoPE parameters per layer type ({', '.join(kinds)}); "
                "lmkit's Llama-family implementation supports one RoPE setting for all layers.")
        params = dict(params[kinds[0]])
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None)) or 10000.0
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported RoPE scaling type {rope_type!r} in the model's config "
            f"(rope_parameters/rope_scaling); lmkit supports: {', '.join(SUPPORTED_ROPE_TYPES)}. "
            "Use a checkpoint with one of those, or add a model plugin that implements it.")
    partial = float(params.get("partial_rotary_factor")
                    or getattr(hf_config, "partial_rotary_factor", None) or 1.0)
    rotary_dim = int(head_dim * partial)
    return RopeConfig(float(theta), rope_type, params, rotary_dim)


def inverse_frequencies(rope: RopeConfig) -> torch.Tensor:
    """float32 ``[rotary_dim // 2]`` inverse frequencies, with scaling applied."""
    dim = rope.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type == "linear":
        inv_freq = inv_freq / float(rope.params["factor"])
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_scaling(inv_freq, rope.params)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths divided by ``factor``,
    short ones kept, the band between interpolated smoothly."""
    try:
        factor = float(p["factor"])
        low = float(p["low_freq_factor"])
        high = float(p["high_freq_factor"])
        old_len = float(p["original_max_position_embeddings"])
    except KeyError as e:
        raise ModelLoadError(f"llama3 RoPE scaling needs {e.args[0]!r} in rope_parameters") from e
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Applies RoPE to query and key heads at given positions."""

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rope.rotary_dim
        self.register_buffer("inv_freq", inverse_frequencies(rope).to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [n]`` -> ``(cos, sin)``, each ``[n, 1, rotary_dim]`` in ``dtype``.

        ``sin`` carries the sign of "rotate half" (``[-sin, sin]``), so that
        :meth:`apply` is one multiply and one fused multiply-add. Computed once per
        step and shared by every layer.
        """
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        cos = torch.cat((cos, cos), dim=-1).to(dtype)[:, None, :]
        sin = torch.cat((-sin, sin), dim=-1).to(dtype)[:, None, :]
        return cos, sin

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x: [n, heads, head_dim]`` (any strides); returns a new contiguous tensor.

        ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2, x1]``, as three
        ops rounded to ``x``'s dtype each, like transformers' ``apply_rotary_pos_emb``
        (a fused multiply-add rounds once and differs from it in half precision).
        """
        dim, half = self.rotary_dim, self.rotary_dim // 2
        if dim == self.head_dim:
            swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
            return (x * cos).add_(swapped * sin)
        rot = x[..., :dim]
        swapped = torch.cat((rot[..., half:], rot[..., :half]), dim=-1)
        return torch.cat(((rot * cos).add_(swapped * sin), x[..., dim:]), dim=-1)

"""DeepSeek-V2/V3 rotary embeddings: default or YaRN frequencies over the
``qk_rope_head_dim`` part of each query head and the shared RoPE key, in the pair
layout of each family, exactly as Hugging Face transformers computes them.

* YaRN (``rope_type: yarn``): inverse frequencies blended between interpolation
  (divided by ``factor``) and extrapolation over a linear ramp set by ``beta_fast`` /
  ``beta_slow``; cos and sin are multiplied by ``attention_factor`` (by default
  ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``); the softmax scale by
  ``mscale(factor, mscale_all_dim) ** 2`` (:func:`softmax_scale`).
* Pair layout: DeepSeek-V2 rotates interleaved pairs ``(x0, x1), (x2, x3), ...`` as
  complex numbers and keeps them interleaved; DeepSeek-V3 with ``rope_interleave``
  (the default) rotates the same pairs but returns the halves layout (all first
  members, then all second members); V3 without it rotates halves (``rotate_half``).
  The layout of ``k_pe`` in the cache differs between them, but queries and keys
  share it, so the scores are the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from lmkit.api import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "yarn")
#: pair layouts (see the module doc)
COMPLEX, INTERLEAVED_TO_HALVES, HALVES = "complex", "interleaved_to_halves", "halves"


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_parameters(cfg: Any) -> dict[str, Any]:
    """The config's RoPE parameters (transformers 5.x ``rope_parameters`` or 4.x
    ``rope_theta`` + ``rope_scaling``), with ``rope_theta`` and ``rope_type`` filled in."""
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
                  or {})
    params.setdefault("rope_theta", getattr(cfg, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"unsupported RoPE type {params['rope_type']!r} for a DeepSeek model "
            f"(rope_parameters/rope_scaling); lmkit supports: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return params


def softmax_scale(cfg: Any) -> float:
    """``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times YaRN's
    ``mscale(factor, mscale_all_dim) ** 2`` when the RoPE is scaled and sets it."""
    scale = float(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    params = rope_parameters(cfg)
    all_dim = params.get("mscale_all_dim", 0)
    if params["rope_type"] != "default" and all_dim:
        m = _mscale(float(params["factor"]), float(all_dim))
        scale = scale * m * m
    return scale


@dataclass(frozen=True)
class DeepseekRope:
    """Inverse frequencies, the cos/sin factor and the pair layout of a DeepSeek model."""

    inv_freq: torch.Tensor  # float32 [qk_rope_head_dim // 2]
    attention_factor: float
    layout: str

    @classmethod
    def from_hf(cls, cfg: Any) -> DeepseekRope:
        """From a ``deepseek_v2`` / ``deepseek_v3`` config."""
        params = rope_parameters(cfg)
        dim = int(int(cfg.qk_rope_head_dim) * float(params.get("partial_rotary_factor", 1.0)))
        base = float(params["rope_theta"])
        pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim)
        factor_attn = 1.0
        inv_freq = 1.0 / pos_freqs
        if params["rope_type"] == "yarn":
            inv_freq, factor_attn = _yarn(cfg, params, dim, base, pos_freqs)
        if getattr(cfg, "model_type", None) == "deepseek_v2":
            layout = COMPLEX
        else:
            layout = INTERLEAVED_TO_HALVES if getattr(cfg, "rope_interleave", True) else HALVES
        return cls(inv_freq, factor_attn, layout)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [n]`` -> ``(cos, sin)``, each ``[n, 1, rope_dim // 2]``, times
        ``attention_factor``: float32 for the complex layout (V2 rotates in float32),
        else ``dtype`` (V3 rounds them to the model dtype)."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None]
        cos, sin = freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor
        if self.layout != COMPLEX:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos[:, None], sin[:, None]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x: [n, heads, rope_dim]``; returns a new tensor in ``x``'s dtype."""
        if self.layout == HALVES:
            half = x.shape[-1] // 2
            c, s = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
            rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
            return x * c + rotated * s
        if self.layout == COMPLEX:
            xf = x.float()
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
            return out.flatten(-2).to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _yarn(cfg: Any, p: dict[str, Any], dim: int, base: float, pos_freqs: torch.Tensor
          ) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies and cos/sin factor (transformers'
    ``_compute_yarn_parameters``)."""
    try:
        original = float(p["original_max_position_embeddings"])
    except KeyError as e:
        raise ModelLoadError("yarn RoPE scaling needs 'original_max_position_embeddings' in "
                             "rope_parameters") from e
    factor = p.get("factor")
    factor = float(factor) if factor is not None else float(cfg.max_position_embeddings) / original
    attention_factor = p.get("attention_factor")
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
        else:
            attention_factor = _mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)

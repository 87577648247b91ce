"""Rotary position embeddings (RoPE) in the "rotate half" (GPT-NeoX) layout.

The inverse frequencies follow the checkpoint's ``rope_parameters`` (transformers 5.x)
or ``rope_theta`` + ``rope_scaling`` (4.x): ``default``, ``linear`` and ``llama3``
scaling are supported. cos/sin are computed once per step from the positions exactly
as HF does, in float32 (on the CPU, rows of a table grown to the largest position seen,
computed by the same ops), and applied with HF's rounding, so logits match HF bit for
bit up to the attention kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from lmkit.api import ModelLoadError

from lmkit_plugins.models.fused_ops import fused_ops_enabled

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """What determines the rotary frequencies of a model."""

    theta: float
    rope_type: str
    params: dict[str, Any]
    rotary_dim: int


def rope_config_from_hf(hf_config: Any, head_dim: int, layer_type: str | None = None
                        ) -> RopeConfig:
    """Read the RoPE settings of an HF config (transformers 4.x or 5.x attribute names).

    ``layer_type`` (``"full_attention"``, ``"sliding_attention"``) picks that kind's
    entry of per-layer-type ``rope_parameters`` (Gemma-3: a local base for sliding
    layers); without it such a config must have one kind only.

    Raises:
        ModelLoadError: the checkpoint uses a RoPE type lmkit does not implement, or its
            ``rope_theta`` / ``partial_rotary_factor`` is not a positive number (at most 1).
    """
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    params = dict(params or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        # per-layer-type parameters ({"full_attention": {...}, ...}): one kind only
        kinds = sorted(params)
        if layer_type is not None and layer_type in params:
            kinds = [layer_type]
        elif len(kinds) != 1:
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
    partial = _positive("partial_rotary_factor", params.get("partial_rotary_factor")
                        or getattr(hf_config, "partial_rotary_factor", None) or 1.0)
    if partial > 1:
        raise ModelLoadError(f"config.json's partial_rotary_factor={partial!r} must be at "
                             "most 1 (the fraction of each head that rotates).")
    rotary_dim = int(head_dim * partial)
    return RopeConfig(_positive("rope_theta", theta), rope_type, params, rotary_dim)


def _positive(name: str, value: Any) -> float:
    """``value`` as a finite positive float, or a :class:`ModelLoadError` naming ``name``."""
    try:
        number = math.nan if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not (math.isfinite(number) and number > 0):
        raise ModelLoadError(f"config.json's RoPE setting {name}={value!r} must be a "
                             "positive number.")
    return number


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
        # CPU: dtype -> float [2, num_positions, 1, rotary_dim] (cos, sin) of positions 0..
        self._cpu_tables: dict[torch.dtype, torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [n]`` -> ``(cos, sin)``, each ``[n, 1, rotary_dim]`` in ``dtype``.

        ``sin`` carries the sign of "rotate half" (``[-sin, sin]``). Computed once per
        step and shared by every layer. On the CPU the rows come from a table (one
        ``index_select`` instead of about ten small ops per step); on CUDA with the fused
        kernels (half precision) from one kernel
        (:func:`lmkit_kernels.rotary_cos_sin.rotary_cos_sin`, the same bits).
        """
        if positions.device.type == "cpu" and positions.numel():
            table = self._cpu_table(int(positions.max()) + 1, dtype)
            rows = table.index_select(1, positions)  # [2, n, 1, rotary_dim]
            return rows[0], rows[1]
        if fused_ops_enabled(positions.device, dtype):  # one kernel for the ~nine ops
            from lmkit_kernels.rotary_cos_sin import rotary_cos_sin  # (imports triton)

            return rotary_cos_sin(positions.contiguous(), self.inv_freq, dtype)
        return self._compute_cos_sin(positions, dtype)

    def _cpu_table(self, num_positions: int, dtype: torch.dtype) -> torch.Tensor:
        """The CPU table covering positions ``[0, num_positions)``, grown by doubling.

        Rows come from :meth:`_compute_cos_sin` (the same elementwise ops as the direct
        path), in chunks small enough that torch runs each op in one pass.
        """
        table = self._cpu_tables.get(dtype)
        if table is not None and table.shape[1] >= num_positions:
            return table
        size = max(num_positions, 256, 2 * table.shape[1] if table is not None else 0)
        chunks = [torch.stack(self._compute_cos_sin(torch.arange(s, min(s + 128, size)), dtype))
                  for s in range(0, size, 128)]
        table = torch.cat(chunks, dim=1)
        self._cpu_tables[dtype] = table
        return table

    def _compute_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                         ) -> tuple[torch.Tensor, torch.Tensor]:
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
            # halves as an axis: flip(2) swaps them ([x1, x2] -> [x2, x1]) in one op
            n, heads = x.shape[0], x.shape[1]
            x2 = x.view(n, heads, 2, half)
            out = (x2 * cos.view(-1, 1, 2, half)).add_(x2.flip(2) * sin.view(-1, 1, 2, half))
            return out.view(n, heads, dim)
        rot = x[..., :dim]
        swapped = torch.cat((rot[..., half:], rot[..., :half]), dim=-1)
        return torch.cat(((rot * cos).add_(swapped * sin), x[..., dim:]), dim=-1)


CPU_ROPE_MAX_ROWS = 32  # lmkit_kernels.cpu.rope.MAX_ROWS (decode batches)


def cpu_rope_kernel(rotary: RotaryEmbedding, device: torch.device | str, dtype: torch.dtype
                    ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], None] | None:
    """lmkit's C in-place RoPE (:mod:`lmkit_kernels.cpu.rope`: ``fn(x, cos, sin,
    num_heads)`` rotates the first ``num_heads`` heads of ``x [n, heads, head_dim]``, ``n <=`` :data:`CPU_ROPE_MAX_ROWS`, the same
    numbers as :meth:`RotaryEmbedding.apply`) for a float32 CPU layer rotating whole
    heads, when it builds on this machine; else ``None`` (torch ops). At batch 1 it
    saves the torch ops' dispatch, about 20 us per layer."""
    if (torch.device(device).type != "cpu" or dtype != torch.float32
            or rotary.rotary_dim != rotary.head_dim):
        return None
    from lmkit_kernels.cpu.rope import MAX_ROWS, rope_kernel

    assert MAX_ROWS >= CPU_ROPE_MAX_ROWS
    return rope_kernel()


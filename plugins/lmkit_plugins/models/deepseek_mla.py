"""DeepSeek's multi-head latent attention layer (MLA) over an MLA attention backend.

Per token: queries from ``q_proj`` (no q-LoRA) or ``q_b_proj(q_a_layernorm(q_a_proj(x)))``
(q-LoRA), split per head into ``q_nope`` and ``q_pe``; the compressed KV
``kv_a_proj_with_mqa(x)`` split into the latent ``c_kv`` (normed by
``kv_a_layernorm``) and one RoPE key ``k_pe`` shared by all heads. RoPE rotates
``q_pe`` and ``k_pe``; the backend stores ``[c_kv | k_pe]`` and attends with
``kv_b_proj``'s weight (:meth:`lmkit.api.MLAAttentionBackend.run_mla`); ``o_proj``
maps the heads' values back. ``q_a_proj`` (or ``q_proj``) and ``kv_a_proj_with_mqa``
read the same input and run as one fused projection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from lmkit.api import MLAAttentionBackend
from torch import nn

from lmkit_plugins.models.deepseek_rope import DeepseekRope
from lmkit_plugins.models.layers import Linear, RMSNorm

#: HF builds q_a_layernorm and kv_a_layernorm with RMSNorm's default epsilon, not
#: the config's rms_norm_eps
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MLADims:
    """The attention shapes of a DeepSeek-V2/V3 config."""

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool

    @classmethod
    def from_hf(cls, cfg: Any) -> MLADims:
        q_lora = getattr(cfg, "q_lora_rank", None)
        return cls(hidden_size=int(cfg.hidden_size), num_heads=int(cfg.num_attention_heads),
                   q_lora_rank=int(q_lora) if q_lora else None,
                   kv_lora_rank=int(cfg.kv_lora_rank),
                   qk_nope_head_dim=int(cfg.qk_nope_head_dim),
                   qk_rope_head_dim=int(cfg.qk_rope_head_dim), v_head_dim=int(cfg.v_head_dim),
                   attention_bias=bool(getattr(cfg, "attention_bias", False)))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """One cache entry: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim


class DeepseekMLA(nn.Module):
    """One layer's MLA (see the module doc); the tokens are packed along one axis."""

    def __init__(self, dims: MLADims, layer_idx: int, rope: DeepseekRope, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.dims, self.layer_idx, self.rope = dims, layer_idx, rope
        kw = {"dtype": dtype, "device": device}
        heads = dims.num_heads
        self.q_width = dims.q_lora_rank or heads * dims.qk_head_dim
        # [q_a | kv_a] (q-LoRA) or [q | kv_a]: one GEMM over the layer input
        self.qkv_a_proj = Linear(dims.hidden_size, {"q": self.q_width, "kv_a": dims.latent_width},
                                 bias=dims.attention_bias, **kw)
        self.q_a_layernorm = (RMSNorm(dims.q_lora_rank, LATENT_NORM_EPS, **kw)
                              if dims.q_lora_rank else None)
        self.q_b_proj = (Linear(dims.q_lora_rank, {"weight": heads * dims.qk_head_dim},
                                bias=False, **kw) if dims.q_lora_rank else None)
        self.kv_a_layernorm = RMSNorm(dims.kv_lora_rank, LATENT_NORM_EPS, **kw)
        # kv_b_proj is never run as a linear here: the backend applies it (decompress)
        # or folds it into the query and output (absorb); [heads * (nope + v), rank]
        self.kv_b_proj = nn.Parameter(torch.empty(
            heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank, **kw),
            requires_grad=False)
        self.o_proj = Linear(heads * dims.v_head_dim, {"weight": dims.hidden_size},
                             bias=dims.attention_bias, **kw)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: MLAAttentionBackend, kv_cache: torch.Tensor) -> torch.Tensor:
        """``hidden [n, hidden_size]`` -> ``[n, hidden_size]``."""
        d = self.dims
        n = hidden.shape[0]
        qkv_a = self.qkv_a_proj.forward(hidden)  # [n, q_width + rank + rope]
        q = qkv_a[:, :self.q_width]
        if self.q_b_proj is not None:
            assert self.q_a_layernorm is not None
            q = self.q_b_proj.forward(self.q_a_layernorm.forward(q.contiguous()))
        q = q.view(n, d.num_heads, d.qk_head_dim)
        q_nope, q_pe = q[..., :d.qk_nope_head_dim], q[..., d.qk_nope_head_dim:]
        kv_a = qkv_a[:, self.q_width:]
        kv_c = self.kv_a_layernorm.forward(kv_a[:, :d.kv_lora_rank].contiguous())
        k_pe = kv_a[:, None, d.kv_lora_rank:]  # [n, 1, rope]
        q_pe, k_pe = self.rope.apply(q_pe, cos, sin), self.rope.apply(k_pe, cos, sin)
        out = attn.run_mla(self.layer_idx, q_nope, q_pe, kv_c, k_pe[:, 0], kv_cache,
                           self.kv_b_proj)  # [n, heads, v_head_dim]
        return self.o_proj.forward(out.reshape(n, d.num_heads * d.v_head_dim))

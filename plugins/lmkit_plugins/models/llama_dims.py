"""The shapes and variant switches of a Llama-family model, read once from its HF
config (``LlamaDims``), and the attention window its layers share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmkit.api import ModelLoadError


@dataclass(frozen=True)
class LlamaDims:
    """Shapes and variant switches of a Llama-family model, read from its HF config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None

    @classmethod
    def from_hf(cls, cfg: Any) -> LlamaDims:
        model_type = getattr(cfg, "model_type", "llama")
        num_heads = int(cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads)
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        qkv_bias, o_bias = attention_bias, attention_bias
        if model_type == "qwen2":  # Qwen2 always has q/k/v bias and no o_proj bias
            qkv_bias, o_bias = True, False
        if model_type == "mistral":
            qkv_bias = o_bias = False
        return cls(
            vocab_size=int(cfg.vocab_size),
            hidden_size=int(cfg.hidden_size),
            intermediate_size=int(cfg.intermediate_size),
            num_layers=int(cfg.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.rms_norm_eps),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=sliding_window_of(cfg),
        )


def sliding_window_of(cfg: Any) -> int | None:
    """The attention window all layers share, or None for full attention."""
    window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "use_sliding_window", None) is False or not window:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if not layer_types:
        return int(window)  # Mistral: every layer slides
    kinds = set(layer_types)
    if kinds == {"sliding_attention"}:
        return int(window)
    if "sliding_attention" in kinds:
        raise ModelLoadError(
            "this model mixes sliding-window and full-attention layers (layer_types); lmkit's "
            "Llama-family implementation needs one attention kind for all layers. Set "
            "use_sliding_window=false in config.json to run it with full attention.")
    return None

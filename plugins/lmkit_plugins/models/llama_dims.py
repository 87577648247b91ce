"""The shapes and variant switches of a Llama-family model, read once from its HF
config (``LlamaDims``), and each layer's attention window."""

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
    # the window every layer shares (None: full attention, or mixed; see layer_windows)
    sliding_window: int | None
    layer_windows: tuple[int | None, ...]

    @classmethod
    def from_hf(cls, cfg: Any) -> LlamaDims:
        """The dims of an HF config.

        Raises:
            ModelLoadError: ``rms_norm_eps`` is negative, or the attention windows are
                invalid (:func:`layer_windows`).
        """
        model_type = getattr(cfg, "model_type", "llama")
        num_heads = int(cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads)
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        qkv_bias, o_bias = attention_bias, attention_bias
        if model_type == "qwen2":  # Qwen2 always has q/k/v bias and no o_proj bias
            qkv_bias, o_bias = True, False
        if model_type == "mistral":
            qkv_bias = o_bias = False
        windows = layer_windows(cfg)
        eps = float(cfg.rms_norm_eps)
        if not eps >= 0:  # a negative epsilon makes the RMSNorm of a small row NaN
            raise ModelLoadError(f"config.json's rms_norm_eps={cfg.rms_norm_eps!r} must be a "
                                 "non-negative number (typically 1e-5 or 1e-6).")
        return cls(
            vocab_size=int(cfg.vocab_size),
            hidden_size=int(cfg.hidden_size),
            intermediate_size=int(cfg.intermediate_size),
            num_layers=int(cfg.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or num_heads),
            head_dim=head_dim,
            rms_norm_eps=eps,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=shared_window(windows),
            layer_windows=windows,
        )


def layer_windows(cfg: Any) -> tuple[int | None, ...]:
    """Each layer's attention window (``None``: full attention), from the config's
    ``sliding_window`` (off when ``use_sliding_window`` is false) and, when it lists
    them, its ``layer_types`` (``sliding_attention`` / ``full_attention`` per layer, as
    Qwen2/Qwen3 configs with ``max_window_layers`` set them). Without ``layer_types``
    every layer slides (Mistral).

    Raises:
        ModelLoadError: ``sliding_window`` is not a positive integer, or ``layer_types``
            does not list one known kind per layer.
    """
    num_layers = int(cfg.num_hidden_layers)
    window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "use_sliding_window", None) is False or not window:
        return (None,) * num_layers
    whole = isinstance(window, int) or (isinstance(window, float) and window.is_integer())
    if isinstance(window, bool) or not whole or window < 1:
        raise ModelLoadError(
            f"config.json's sliding_window={window!r} must be a positive number of tokens; "
            "set it to null (or use_sliding_window: false) for full attention.")
    layer_types = getattr(cfg, "layer_types", None)
    if not layer_types:
        return (int(window),) * num_layers  # Mistral: every layer slides
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if len(layer_types) != num_layers or unknown:
        raise ModelLoadError(
            f"config.json's layer_types must list 'sliding_attention' or 'full_attention' "
            f"for each of the {num_layers} layers; it has {len(layer_types)} entries"
            + (f" and unknown kinds {unknown}" if unknown else "")
            + ". Fix layer_types, or remove it to use one attention kind for all layers.")
    return tuple(int(window) if kind == "sliding_attention" else None for kind in layer_types)


def shared_window(windows: tuple[int | None, ...]) -> int | None:
    """The window every layer shares; ``None`` for full attention or mixed layers."""
    return windows[0] if windows and len(set(windows)) == 1 else None

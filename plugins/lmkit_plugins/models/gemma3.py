"""Gemma-3 text models (``Gemma3ForCausalLM``): sliding-window and full-attention layers
interleaved (``layer_types``), as two KV cache groups.

What differs from the Llama family (whose attention and MLP modules it reuses):

* Embeddings scaled by ``sqrt(hidden_size)`` (in the model dtype, as HF rounds it).
* RMSNorms scale by ``1 + w``: the checkpoint's ``w`` is loaded as ``1 + w`` (computed
  in float32), so lmkit's norms (and the fused q/k-norm + RoPE kernel) apply it as is.
* Each block norms the attention and MLP outputs too (``post_attention_layernorm``,
  ``post_feedforward_layernorm``) and the MLP input (``pre_feedforward_layernorm``).
* RMSNorm over each query and key head before RoPE; RoPE base ``rope_local_base_freq``
  on sliding layers and the global base (with its scaling) on full layers.
* Attention scale ``query_pre_attn_scalar ** -0.5``; GELU (tanh) gated MLP.
* Optional final logit soft-capping (``tanh(logits / cap) * cap``).
* Optional attention-score soft-capping (``attn_logit_softcapping``; set in Gemma-2,
  null in Gemma-3 checkpoints): the model then needs the ``logits_soft_cap`` feature,
  so stack resolution picks (or refuses, naming it) a backend by whether it declares it.

Gemma-2 (:class:`Gemma2ForCausalLM`) is the same decoder without q/k norms and with one
RoPE base. Bidirectional attention is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from lmkit.api import (
    AttentionBackend,
    CausalLM,
    ForwardContext,
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheSpec,
    ModelBuildContext,
    ModelLoadError,
    Needs,
    SlidingWindowSpec,
    build_kv_cache_groups,
)
from torch import nn

from lmkit_plugins.models.checkpoint_load import load_named_weights
from lmkit_plugins.models.fused_ops import fused_ops_enabled
from lmkit_plugins.models.layers import Linear, RMSNorm, VocabEmbedding, whole_weight_loader
from lmkit_plugins.models.llama_dims import LlamaDims, layer_windows
from lmkit_plugins.models.llama_layers import LlamaAttention, LlamaMLP
from lmkit_plugins.models.rotary import RotaryEmbedding, rope_config_from_hf

_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
          "post_feedforward_layernorm")


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` for a fused ``[n, 2 * intermediate]`` gate-up projection
    (HF's ``gelu_pytorch_tanh``)."""
    size = gate_up.shape[-1] // 2
    return F.gelu(gate_up[..., :size], approximate="tanh").mul_(gate_up[..., size:])


def gemma_dims(cfg: Any, qk_norm: bool = True) -> LlamaDims:
    """The Llama-family shapes of a Gemma-2 / Gemma-3 text config (no biases; q/k norms
    on Gemma-3 only).

    Raises:
        ModelLoadError: the config asks for what lmkit does not implement (bidirectional
            attention, an activation other than ``gelu_pytorch_tanh``).
    """
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ModelLoadError(
            "this Gemma config sets use_bidirectional_attention; lmkit runs Gemma as a "
            "causal decoder only. Set it to false in config.json.")
    act = getattr(cfg, "hidden_activation", None) or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(
            f"Gemma hidden_activation {act!r} is not supported; lmkit implements "
            "gelu_pytorch_tanh (what Gemma-2 and Gemma-3 checkpoints use).")
    return replace(LlamaDims.from_hf(cfg), qk_norm=qk_norm, qkv_bias=False, o_bias=False,
                   mlp_bias=False)


def attn_soft_cap(cfg: Any) -> float | None:
    """The config's attention-score soft cap (``attn_logit_softcapping``), if set."""
    cap = getattr(cfg, "attn_logit_softcapping", None)
    return None if cap is None else float(cap)


class Gemma3DecoderLayer(nn.Module):
    """Pre- and post-normed attention and MLP blocks around a residual stream."""

    def __init__(self, dims: LlamaDims, layer_idx: int, rotary: RotaryEmbedding,
                 dtype: torch.dtype, device: torch.device, quant: Any = None) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        for name in _NORMS:
            setattr(self, name, RMSNorm(dims.hidden_size, dims.rms_norm_eps, **kw))
        self.self_attn = LlamaAttention(dims, layer_idx, rotary, dtype, device, None, quant)
        self.mlp = LlamaMLP(dims, dtype, device, None, quant, act=gelu_tanh_and_mul)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, attn: AttentionBackend, kv_cache: torch.Tensor,
                kv_slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # the residual stream is added in by the next norm (fused), as in the Llama layers
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm.forward(hidden)
        else:
            hidden, residual = self.input_layernorm.forward(hidden, residual)
        hidden = self.self_attn.forward(hidden, cos, sin, attn, kv_cache, kv_slots)
        hidden = self.post_attention_layernorm.forward(hidden)
        hidden, residual = self.pre_feedforward_layernorm.forward(hidden, residual)
        hidden = self.post_feedforward_layernorm.forward(self.mlp.forward(hidden))
        return hidden, residual


class Gemma3ForCausalLM(nn.Module, CausalLM):
    """Gemma-3's text decoder over packed tokens; its sliding and full layers are two
    KV cache groups, each with its own attention backend (built with its window)."""

    #: RMSNorm over each query and key head (Gemma-3; not Gemma-2)
    qk_norm = True

    @classmethod
    def attention_needs(cls, hf_config: Any) -> Needs:
        """The head size, ``sliding_window`` when a layer slides and
        ``logits_soft_cap`` when attention scores are soft-capped."""
        dims = gemma_dims(hf_config, cls.qk_norm)
        features = {"sliding_window"} if any(dims.layer_windows) else set()
        if attn_soft_cap(hf_config) is not None:
            features.add("logits_soft_cap")
        return Needs(features=frozenset(features), values={"head_size": dims.head_dim})

    @classmethod
    def kv_cache_specs(cls, hf_config: Any) -> tuple[KVCacheSpec, ...] | None:
        """Per layer: sliding window (``sliding_attention``) or full attention."""
        return tuple(FullAttentionSpec() if w is None else SlidingWindowSpec(window=w)
                     for w in layer_windows(hf_config))

    def __init__(self, hf_config: Any, ctx: ModelBuildContext) -> None:
        super().__init__()
        dims = gemma_dims(hf_config, self.qk_norm)
        self.dims = dims
        dtype, device = ctx.dtype, torch.device(ctx.device)
        quant = ctx.quantization
        # one RoPE per layer kind: the local base on sliding layers, the global on full
        # ones (Gemma-3); one shared RoPE when both kinds have the same (Gemma-2)
        local, full = (rope_config_from_hf(hf_config, dims.head_dim, kind)
                       for kind in ("sliding_attention", "full_attention"))
        full_rotary = RotaryEmbedding(full, dims.head_dim, device)
        self.rotary = {"full_attention": full_rotary, "sliding_attention": full_rotary
                       if local == full else RotaryEmbedding(local, dims.head_dim, device)}
        self._layer_kind = ["full_attention" if w is None else "sliding_attention"
                            for w in dims.layer_windows]
        self.embed_tokens = VocabEmbedding(dims.vocab_size, dims.hidden_size, dtype=dtype,
                                           device=device, quantization=quant)
        # HF multiplies by sqrt(hidden) rounded to the weights' dtype
        self._embed_scale = torch.tensor(dims.hidden_size ** 0.5, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(dims, i, self.rotary[self._layer_kind[i]], dtype, device, quant)
            for i in range(dims.num_layers))
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, dtype=dtype, device=device)
        self.lm_head = None if dims.tie_word_embeddings else Linear(
            dims.hidden_size, {"weight": dims.vocab_size}, bias=False, dtype=dtype,
            device=device, quantization=quant)
        self.final_logit_softcapping = getattr(hf_config, "final_logit_softcapping", None)
        self._model_writes_kv = fused_ops_enabled(device, dtype) and ctx.model_may_write_kv()
        scale = float(getattr(hf_config, "query_pre_attn_scalar", dims.head_dim)) ** -0.5
        # only backends declaring logits_soft_cap take it (the needs say so when set)
        soft_cap = attn_soft_cap(hf_config)
        cap_kw = {} if soft_cap is None else {"logits_soft_cap": soft_cap}

        def make_backend(spec: KVCacheSpec) -> AttentionBackend:
            return ctx.attention_cls(
                num_heads=dims.num_heads, num_kv_heads=dims.num_kv_heads,
                head_size=dims.head_dim, scale=scale, dtype=dtype, device=device,
                block_size=ctx.block_size, options=ctx.attention_options,
                kv_cache_dtype=ctx.kv_cache_dtype,
                sliding_window=spec.window if isinstance(spec, SlidingWindowSpec) else None,
                **cap_kw)

        specs = self.kv_cache_specs(hf_config)
        assert specs is not None
        self._kv_groups = build_kv_cache_groups(specs, make_backend)
        self.attn: AttentionBackend = self._kv_groups[0].attn
        by_layer = {i: g.attn for g in self._kv_groups for i in g.layers}
        self._layer_attn = [by_layer[i] for i in range(dims.num_layers)]

    def kv_cache_groups(self, num_layers: int) -> tuple[KVCacheGroup, ...]:
        """The sliding and full groups built from :meth:`kv_cache_specs`."""
        return self._kv_groups

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """``input_ids``, ``positions``: ``[num_tokens]`` -> hidden ``[num_tokens, hidden]``."""
        hidden = self.embed_tokens(input_ids) * self._embed_scale
        by_rotary = {id(r): r.cos_sin(positions, hidden.dtype) for r in self.rotary.values()}
        cos_sin = {kind: by_rotary[id(rotary)] for kind, rotary in self.rotary.items()}
        kv_slots = ctx.attn.kv_write_slots() if self._model_writes_kv else None
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            cos, sin = cos_sin[self._layer_kind[i]]
            hidden, residual = layer.forward(hidden, residual, cos, sin, self._layer_attn[i],
                                             ctx.kv_caches[i], kv_slots)
        hidden, _ = self.norm.forward(hidden, residual)
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> float32 logits ``[n, vocab_size]`` (soft-capped when the
        config sets ``final_logit_softcapping``)."""
        if self.lm_head is None:
            logits = self.embed_tokens.logits(hidden_states)
        else:
            logits = self.lm_head(hidden_states).float().contiguous()
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # ------------------------------------------------------------------ loading

    def _weight_targets(self) -> dict[str, Callable[[torch.Tensor], None]]:
        """HF checkpoint name -> how to load it (fused QKV and gate-up; norms as 1 + w)."""
        targets: dict[str, Callable[[torch.Tensor], None]] = {
            "model.embed_tokens.weight": self.embed_tokens.load,
            "model.norm.weight": _one_plus(self.norm.weight, "model.norm.weight"),
        }
        if self.lm_head is not None:
            lm_head = self.lm_head
            targets["lm_head.weight"] = lambda t: lm_head.load_shard("weight", weight=t)

        def shards(prefix: str, linear: Linear, parts: dict[str, str]) -> None:
            for hf_name, part in parts.items():
                targets[f"{prefix}.{hf_name}.weight"] = (
                    lambda t, part=part: linear.load_shard(part, weight=t))

        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}"
            attn = layer.self_attn
            shards(f"{p}.self_attn", attn.qkv_proj, {"q_proj": "q", "k_proj": "k", "v_proj": "v"})
            shards(f"{p}.self_attn", attn.o_proj, {"o_proj": "weight"})
            shards(f"{p}.mlp", layer.mlp.gate_up_proj, {"gate_proj": "gate", "up_proj": "up"})
            shards(f"{p}.mlp", layer.mlp.down_proj, {"down_proj": "weight"})
            for name in _NORMS:
                targets[f"{p}.{name}.weight"] = _one_plus(getattr(layer, name).weight,
                                                          f"{p}.{name}.weight")
            for name in ("q_norm", "k_norm") if self.qk_norm else ():
                targets[f"{p}.self_attn.{name}.weight"] = _one_plus(
                    getattr(attn, name).weight, f"{p}.self_attn.{name}.weight")
        return targets

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; return the names used. A tied model ignores a
        checkpoint's ``lm_head.weight`` (it is the embedding).

        Raises:
            ModelLoadError: tensors are missing or unexpected, or a shape does not match.
        """
        targets = self._weight_targets()
        return load_named_weights(
            targets, weights, lambda name: name,
            lambda key: key == "lm_head.weight" and self.lm_head is None)


def _one_plus(param: torch.Tensor, name: str) -> Callable[[torch.Tensor], None]:
    """Load a Gemma norm weight ``w`` as the scale ``1 + w`` (added in float32)."""
    load = whole_weight_loader(param, name)
    return lambda t: load((t.float() + 1.0).to(param.dtype))


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma-2: Gemma-3's decoder without q/k norms, one RoPE base for every layer (its
    config has no per-layer-type RoPE parameters), sliding and full layers alternating,
    attention scores and final logits soft-capped (``attn_logit_softcapping``,
    ``final_logit_softcapping``)."""

    qk_norm = False

"""DeepSeek-V2 and DeepSeek-V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``).

Pre-norm decoder layers of multi-head latent attention
(:mod:`lmkit_plugins.models.deepseek_mla`, served by an MLA attention backend over a
latent cache) and an MLP: dense SwiGLU (:class:`~lmkit_plugins.models.llama.LlamaMLP`,
``intermediate_size``) on the first ``first_k_dense_replace`` layers, a mixture of
experts elsewhere (:class:`~lmkit_plugins.models.moe.SparseMoE`: ``n_routed_experts``
of width ``moe_intermediate_size``, DeepSeek-V2's softmax or V3's bias-corrected
sigmoid grouped routing, ``n_shared_experts`` shared experts). RoPE (default or YaRN,
each family's pair layout) in :mod:`lmkit_plugins.models.deepseek_rope`.

Loads HF safetensors names (``model.layers.N.self_attn.kv_a_proj_with_mqa``,
``...mlp.experts.E.gate_proj``, ...); V3's multi-token-prediction layers (layer
indices from ``num_hidden_layers`` on) are not used and skipped. Not supported, and
refused before the weights load: tensor parallelism (no head sharding yet),
speculative draft heads, quantized weights.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from lmkit.api import (
    CausalLM,
    ForwardContext,
    MLAAttentionBackend,
    ModelBuildContext,
    ModelLoadError,
    Needs,
)
from lmkit.api.mla_attention import MLA
from torch import nn

from lmkit_plugins.models.checkpoint_load import load_named_weights
from lmkit_plugins.models.deepseek_mla import DeepseekMLA, MLADims
from lmkit_plugins.models.deepseek_rope import DeepseekRope, softmax_scale
from lmkit_plugins.models.layers import Linear, RMSNorm, VocabEmbedding, whole_weight_loader
from lmkit_plugins.models.llama_dims import LlamaDims
from lmkit_plugins.models.llama_layers import LlamaMLP
from lmkit_plugins.models.moe import DEEPSEEK_EXPERT_NAMES, SparseMoE
from lmkit_plugins.models.moe_routing import MoERouting

Loader = Callable[[torch.Tensor], None]
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _mlp_dims(cfg: Any) -> LlamaDims:
    """The dense MLP's shapes as :class:`LlamaDims` (what LlamaMLP and SparseMoE read)."""
    return LlamaDims(
        vocab_size=int(cfg.vocab_size), hidden_size=int(cfg.hidden_size),
        intermediate_size=int(cfg.intermediate_size), num_layers=int(cfg.num_hidden_layers),
        num_heads=int(cfg.num_attention_heads), num_kv_heads=1,
        head_dim=int(cfg.qk_nope_head_dim) + int(cfg.qk_rope_head_dim),
        rms_norm_eps=float(cfg.rms_norm_eps),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False, sliding_window=None,
            layer_windows=(None,) * int(cfg.num_hidden_layers))


class DeepseekDecoderLayer(nn.Module):
    """Pre-norm MLA and MLP (dense or mixture of experts) around the residual stream."""

    def __init__(self, attn_dims: MLADims, mlp: nn.Module, layer_idx: int, rope: DeepseekRope,
                 eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.input_layernorm = RMSNorm(attn_dims.hidden_size, eps, **kw)
        self.self_attn = DeepseekMLA(attn_dims, layer_idx, rope, dtype, device)
        self.post_attention_layernorm = RMSNorm(attn_dims.hidden_size, eps, **kw)
        self.mlp = mlp

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, attn: MLAAttentionBackend, kv_cache: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm.forward(hidden)
        else:
            hidden, residual = self.input_layernorm.forward(hidden, residual)
        hidden = self.self_attn.forward(hidden, cos, sin, attn, kv_cache)
        hidden, residual = self.post_attention_layernorm.forward(hidden, residual)
        return self.mlp.forward(hidden), residual


class DeepseekModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``model.`` prefix)."""

    def __init__(self, cfg: Any, rope: DeepseekRope, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        dims, attn_dims = _mlp_dims(cfg), MLADims.from_hf(cfg)
        first_moe = int(getattr(cfg, "first_k_dense_replace", None) or 0)
        routing = MoERouting.from_hf(cfg)
        moe_dims = LlamaDims(**{**dims.__dict__,
                                "intermediate_size": int(cfg.moe_intermediate_size)})
        shared = int(cfg.moe_intermediate_size) * int(getattr(cfg, "n_shared_experts", None) or 0)

        def mlp(i: int) -> nn.Module:
            if i < first_moe:
                return LlamaMLP(dims, dtype, device)
            return SparseMoE(moe_dims, routing, dtype, device, shared_intermediate_size=shared)

        self.embed_tokens = VocabEmbedding(dims.vocab_size, dims.hidden_size, dtype=dtype,
                                           device=device)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(attn_dims, mlp(i), i, rope, dims.rms_norm_eps, dtype, device)
            for i in range(dims.num_layers))
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, dtype=dtype, device=device)


class DeepseekV2ForCausalLM(nn.Module, CausalLM):
    """A DeepSeek-V2 (or, as :class:`DeepseekV3ForCausalLM`, V3) causal LM over packed
    tokens, on an MLA attention backend (see the module doc)."""

    @classmethod
    def attention_needs(cls, hf_config: Any) -> Needs:
        """An MLA backend whose latent entries are ``kv_lora_rank + qk_rope_head_dim`` wide."""
        dims = MLADims.from_hf(hf_config)
        return Needs(values={"attention_kind": MLA, "head_size": dims.latent_width})

    def __init__(self, hf_config: Any, ctx: ModelBuildContext) -> None:
        super().__init__()
        if ctx.quantization is not None:
            raise ModelLoadError(
                f"quantized weights ({type(ctx.quantization).__name__}) are not supported for "
                "DeepSeek models yet; use --quantization none (dense safetensors weights).")
        if not issubclass(ctx.attention_cls, MLAAttentionBackend):
            raise ModelLoadError(
                f"DeepSeek models need an MLA attention backend (attention_kind 'mla', e.g. "
                f"mla_torch); {ctx.attention_cls.__name__} is not an MLAAttentionBackend.")
        dims = self.dims = _mlp_dims(hf_config)
        attn_dims = MLADims.from_hf(hf_config)
        dtype, device = ctx.dtype, torch.device(ctx.device)
        self.rope = DeepseekRope.from_hf(hf_config, device)
        self.model = DeepseekModel(hf_config, self.rope, dtype, device)
        self.lm_head = None if dims.tie_word_embeddings else Linear(
            dims.hidden_size, {"weight": dims.vocab_size}, bias=False, dtype=dtype,
            device=device)
        self.attn: MLAAttentionBackend = ctx.attention_cls(
            num_heads=attn_dims.num_heads, num_kv_heads=1, head_size=attn_dims.latent_width,
            scale=softmax_scale(hf_config), dtype=dtype, device=device,
            block_size=ctx.block_size, options=ctx.attention_options,
            kv_cache_dtype=ctx.kv_cache_dtype, kv_lora_rank=attn_dims.kv_lora_rank,
            qk_nope_head_dim=attn_dims.qk_nope_head_dim,
            qk_rope_head_dim=attn_dims.qk_rope_head_dim, v_head_dim=attn_dims.v_head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """``input_ids``, ``positions``: ``[num_tokens]`` -> hidden ``[num_tokens, hidden]``."""
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = self.rope.cos_sin(positions, hidden.dtype)
        residual: torch.Tensor | None = None
        # its MLA backend (or the piecewise graphs' stand-in for it: no isinstance check)
        attn = cast(MLAAttentionBackend, ctx.attn)
        for i, layer in enumerate(self.model.layers):
            hidden, residual = layer.forward(hidden, residual, cos, sin, attn, ctx.kv_caches[i])
        hidden, _ = self.model.norm.forward(hidden, residual)
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> float32 logits ``[n, vocab_size]``."""
        return self._logits(hidden_states, float32=True)

    def compute_greedy_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> the LM head's logits in its own dtype (see
        :meth:`lmkit.api.CausalLM.compute_greedy_logits`)."""
        return self._logits(hidden_states, float32=False)

    def _logits(self, hidden_states: torch.Tensor, float32: bool) -> torch.Tensor:
        if self.lm_head is None:
            return self.model.embed_tokens.logits(hidden_states, float32)
        logits = self.lm_head(hidden_states)
        return (logits.float() if float32 else logits).contiguous()

    # ------------------------------------------------------------------ loading

    def _weight_targets(self) -> dict[str, Loader]:
        """HF checkpoint name -> how to load it."""
        whole = whole_weight_loader

        def part(linear: Linear, shard: str, kind: str = "weight") -> Loader:
            if kind == "weight":
                return lambda t: linear.load_shard(shard, weight=t)
            return lambda t: linear.load_shard(shard, bias=t)

        embed = self.model.embed_tokens
        targets: dict[str, Loader] = {
            "model.embed_tokens.weight": embed.load,
            "model.norm.weight": whole(self.model.norm.weight, "model.norm.weight")}
        if self.lm_head is not None:
            targets["lm_head.weight"] = part(self.lm_head, "weight")
        for i, layer in enumerate(self.model.layers):
            p = f"model.layers.{i}"
            a = layer.self_attn
            kinds = ("weight", "bias") if a.dims.attention_bias else ("weight",)
            q_name = "q_a_proj" if a.q_b_proj is not None else "q_proj"
            for kind in kinds:
                targets[f"{p}.self_attn.{q_name}.{kind}"] = part(a.qkv_a_proj, "q", kind)
                targets[f"{p}.self_attn.kv_a_proj_with_mqa.{kind}"] = part(a.qkv_a_proj, "kv_a",
                                                                           kind)
                targets[f"{p}.self_attn.o_proj.{kind}"] = part(a.o_proj, "weight", kind)
            if not a.dims.q_lora_rank and a.dims.attention_bias:
                del targets[f"{p}.self_attn.q_proj.bias"]  # HF's q_proj has no bias
            if a.q_b_proj is not None and a.q_a_layernorm is not None:
                targets[f"{p}.self_attn.q_b_proj.weight"] = part(a.q_b_proj, "weight")
                targets[f"{p}.self_attn.q_a_layernorm.weight"] = whole(
                    a.q_a_layernorm.weight, f"{p}.self_attn.q_a_layernorm.weight")
            targets[f"{p}.self_attn.kv_a_layernorm.weight"] = whole(
                a.kv_a_layernorm.weight, f"{p}.self_attn.kv_a_layernorm.weight")
            targets[f"{p}.self_attn.kv_b_proj.weight"] = whole(
                a.kv_b_proj, f"{p}.self_attn.kv_b_proj.weight")
            for norm in ("input_layernorm", "post_attention_layernorm"):
                targets[f"{p}.{norm}.weight"] = whole(getattr(layer, norm).weight,
                                                      f"{p}.{norm}.weight")
            mlp = layer.mlp
            if isinstance(mlp, SparseMoE):
                targets.update(mlp.weight_targets(f"{p}.mlp", DEEPSEEK_EXPERT_NAMES))
            else:
                targets[f"{p}.mlp.gate_proj.weight"] = part(mlp.gate_up_proj, "gate")
                targets[f"{p}.mlp.up_proj.weight"] = part(mlp.gate_up_proj, "up")
                targets[f"{p}.mlp.down_proj.weight"] = part(mlp.down_proj, "weight")
        return targets

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors (q_a/q and kv_a fused); return the names used.

        Skipped: ``rotary_emb.inv_freq`` buffers, a tied model's ``lm_head.weight``, and
        layers from ``num_hidden_layers`` on (V3's multi-token-prediction modules).

        Raises:
            ModelLoadError: tensors are missing or unknown, or a shape does not match.
        """
        num_layers = self.dims.num_layers

        def ignored(key: str) -> bool:
            layer = _LAYER.match(key)
            return (key.endswith("rotary_emb.inv_freq")
                    or (key == "lm_head.weight" and self.lm_head is None)
                    or (layer is not None and int(layer.group(1)) >= num_layers))

        return load_named_weights(self._weight_targets(), weights, lambda name: name, ignored)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3: V2's structure with sigmoid, bias-corrected grouped routing and the
    V3 RoPE pair layout (both read from the config's ``model_type``)."""

"""The Llama family: Llama 2/3, Mistral, Qwen2, Qwen3 and SmolLM2 in one implementation.

The variants differ only in data read from the HF config:

* Qwen2: bias on the q/k/v projections.
* Qwen3: RMSNorm over each query and key head before RoPE; explicit ``head_dim``.
* Mistral (and Qwen with ``use_sliding_window``): a sliding attention window; a config
  whose ``layer_types`` mix sliding and full layers (Qwen2/Qwen3 ``max_window_layers``)
  gets two KV cache groups, each with its own attention backend.
* Llama 3.x: ``llama3`` RoPE scaling; SmolLM2 and small Qwen: tied embeddings.

Tokens are packed along one axis (no batch axis). Projections are fused (QKV and
gate-up); :meth:`LlamaForCausalLM.load_weights` maps the HF checkpoint names onto them.
The layers are in :mod:`lmkit_plugins.models.llama_layers`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from lmkit.api import (
    KV_SCALE_SUFFIXES,
    AttentionBackend,
    CausalLM,
    ForwardContext,
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheSpec,
    Model,
    ModelBuildContext,
    Needs,
    PoolingModel,
    SlidingWindowSpec,
    build_kv_cache_groups,
)
from torch import nn

from lmkit_plugins.models.checkpoint_load import load_named_weights
from lmkit_plugins.models.cpu_decode_stack import CpuDecodeStack, build_cpu_decode_stack
from lmkit_plugins.models.fused_ops import fused_ops_enabled
from lmkit_plugins.models.layers import Linear, RMSNorm, VocabEmbedding, whole_weight_loader
from lmkit_plugins.models.llama_dims import LlamaDims, layer_windows
from lmkit_plugins.models.llama_layers import LlamaDecoderLayer
from lmkit_plugins.models.rotary import RotaryEmbedding, rope_config_from_hf
from lmkit_plugins.models.tensor_parallel import TensorParallel, VocabParallelEmbedding

logger = logging.getLogger(__name__)

# checkpoint tensors that carry no weights of ours (older exports save RoPE buffers; the
# runner reads KV-cache scales itself)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", *KV_SCALE_SUFFIXES)


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``model.`` prefix)."""

    def __init__(self, dims: LlamaDims, rotary: RotaryEmbedding, dtype: torch.dtype,
                 device: torch.device, tp: TensorParallel | None = None,
                 quant: Any = None, make_mlp: Callable[[int], nn.Module] | None = None
                 ) -> None:
        super().__init__()
        self.embed_tokens = (
            VocabEmbedding(dims.vocab_size, dims.hidden_size, dtype=dtype, device=device,
                           quantization=quant)
            if tp is None else VocabParallelEmbedding(dims.vocab_size, dims.hidden_size, tp,
                                                      dtype=dtype, device=device))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(dims, i, rotary, dtype, device, tp, quant,
                              None if make_mlp is None else make_mlp(i))
            for i in range(dims.num_layers))
        self.norm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, dtype=dtype, device=device)


class LlamaStack(nn.Module, Model):
    """The Llama family over packed tokens, up to the final norm: what
    :class:`LlamaForCausalLM` (with its language-model head) and
    :class:`LlamaEmbeddingModel` (without one) share.

    Splits over a tensor-parallel group when the build context has ``tp_size > 1``
    (:mod:`lmkit_plugins.models.tensor_parallel`): each rank builds and loads only its
    shard, and its attention backend (hence its KV cache) holds only its KV heads.
    """

    supports_tensor_parallel = True
    supports_uneven_tensor_parallel = True
    #: whether the model has a language-model head (tied to the embedding or its own)
    has_lm_head: ClassVar[bool] = True

    @classmethod
    def attention_needs(cls, hf_config: Any) -> Needs:
        """What this model needs of the attention backend, known from its config alone
        (so that stack resolution can refuse or avoid a backend before weights load)."""
        slides = any(layer_windows(hf_config))
        return Needs(features={"sliding_window"} if slides else set(),
                     values={"head_size": LlamaDims.from_hf(hf_config).head_dim})

    @classmethod
    def kv_cache_specs(cls, hf_config: Any) -> tuple[KVCacheSpec, ...] | None:
        """Per layer, sliding window or full attention when ``layer_types`` mixes them;
        ``None`` (one group, ``self.attn``) when every layer attends alike."""
        windows = layer_windows(hf_config)
        if len(set(windows)) == 1:
            return None
        return tuple(FullAttentionSpec() if w is None else SlidingWindowSpec(window=w)
                     for w in windows)

    def __init__(self, hf_config: Any, ctx: ModelBuildContext) -> None:
        super().__init__()
        dims = LlamaDims.from_hf(hf_config)
        self.dims = dims
        self.tp = tp = TensorParallel.from_context(ctx)
        dtype, device = ctx.dtype, torch.device(ctx.device)
        self.rotary = RotaryEmbedding(rope_config_from_hf(hf_config, dims.head_dim),
                                      dims.head_dim, device)
        quant = ctx.quantization  # a QuantizationMethod, or None for dense weights
        self._quant = quant
        # lmkit's C decode-stack executor, built when the weights are loaded (if it applies)
        self._cpu_decode: CpuDecodeStack | None = None
        self.model = LlamaModel(dims, self.rotary, dtype, device, tp, quant,
                                self._mlp_builder(hf_config, dims, dtype, device))
        self._fused_ops = fused_ops_enabled(device, dtype)
        local_vocab = dims.vocab_size if tp is None else tp.local(dims.vocab_size)
        # fused kernels write K/V in the RoPE kernel when the backend declares it may
        self._model_writes_kv = self._fused_ops and ctx.model_may_write_kv()
        self.lm_head = None if dims.tie_word_embeddings or not self.has_lm_head else Linear(
            dims.hidden_size, {"weight": local_vocab}, bias=False, dtype=dtype, device=device,
            quantization=quant)

        attn0 = self.model.layers[0].self_attn

        def make_backend(window: int | None) -> AttentionBackend:
            return ctx.attention_cls(
                num_heads=attn0.num_heads, num_kv_heads=attn0.num_kv_heads,
                head_size=dims.head_dim, scale=dims.head_dim ** -0.5, dtype=dtype,
                device=device, block_size=ctx.block_size, sliding_window=window,
                options=ctx.attention_options, kv_cache_dtype=ctx.kv_cache_dtype)

        specs = self.kv_cache_specs(hf_config)
        # several KV cache groups (mixed layer_types): each layer runs its group's backend
        self._kv_groups: tuple[KVCacheGroup, ...] | None = None
        self._layer_attn: list[AttentionBackend] | None = None
        if specs is None:
            self.attn: AttentionBackend = make_backend(dims.sliding_window)
        else:
            self._kv_groups = build_kv_cache_groups(specs, lambda spec: make_backend(
                spec.window if isinstance(spec, SlidingWindowSpec) else None))
            self.attn = self._kv_groups[0].attn
            by_layer = {i: g.attn for g in self._kv_groups for i in g.layers}
            self._layer_attn = [by_layer[i] for i in range(dims.num_layers)]

    def kv_cache_groups(self, num_layers: int) -> tuple[KVCacheGroup, ...]:
        """One group per attention kind when ``layer_types`` mixes them, else one."""
        if self._kv_groups is not None:
            return self._kv_groups
        return super().kv_cache_groups(num_layers)

    def _mlp_builder(self, hf_config: Any, dims: LlamaDims, dtype: torch.dtype,
                     device: torch.device) -> Callable[[int], nn.Module] | None:
        """``layer index -> its MLP module`` for layers without the dense
        :class:`LlamaMLP` (a subclass's mixture of experts), else ``None`` (all dense)."""
        return None

    def _add_mlp_targets(self, targets: dict[str, Callable[[torch.Tensor], None]],
                         prefix: str, mlp: nn.Module, linear_names: Callable[..., None]
                         ) -> None:
        """Add the loaders of layer ``prefix``'s MLP weights to ``targets``; the dense
        :class:`LlamaMLP`'s through ``linear_names`` (fused and sharded)."""
        linear_names(f"{prefix}.mlp", mlp.gate_up_proj, {"gate_proj": "gate", "up_proj": "up"})
        linear_names(f"{prefix}.mlp", mlp.down_proj, {"down_proj": "weight"}, split=1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """``input_ids``, ``positions``: ``[num_tokens]`` -> hidden ``[num_tokens, hidden]``."""
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        if self._cpu_decode is not None:  # a CPU decode step in one C call, where it applies
            out = self._cpu_decode.run(hidden, cos, sin, ctx)
            if out is not None:
                return out
        kv_slots = ctx.attn.kv_write_slots() if self._model_writes_kv else None
        residual: torch.Tensor | None = None
        aux = ctx.aux_hidden_layers
        taps: dict[int, torch.Tensor] = {}
        layer_attn = self._layer_attn
        for i, layer in enumerate(self.model.layers):
            if aux and i in aux:  # a draft head reads the stream entering layer i
                taps[i] = hidden if residual is None else hidden + residual
            attn = ctx.attn if layer_attn is None else layer_attn[i]
            hidden, residual = layer.forward(hidden, residual, cos, sin, attn,
                                             ctx.kv_caches[i], kv_slots)
        ctx.aux_hidden_states.extend(taps[i] for i in aux)
        hidden, _ = self.model.norm.forward(hidden, residual)
        return hidden

    # ------------------------------------------------------------------ loading

    def _weight_targets(self) -> dict[str, Callable[[torch.Tensor], None]]:
        """HF checkpoint name -> how to load it into the fused parameters."""
        targets: dict[str, Callable[[torch.Tensor], None]] = {}

        whole = whole_weight_loader

        tp = self.tp

        def shard(linear: Linear, part: str, kind: str, split: int | None = 0,
                  heads: range | None = None) -> Callable[[torch.Tensor], None]:
            # split: the axis of the weight divided over ranks (0: output rows, column-
            # parallel; 1: input columns, row-parallel, whose bias only rank 0 adds);
            # heads: cut at this rank's attention heads (whole KV groups, maybe uneven)
            # instead of an even share
            if tp is None or split is None:
                cut: Callable[[torch.Tensor], torch.Tensor | None] = lambda t: t  # noqa: E731
            elif kind == "bias" and split == 1:
                cut = lambda t: t if tp.rank == 0 else None  # noqa: E731
            elif heads is not None:
                axis, head_dim = (split if kind == "weight" else 0), self.dims.head_dim
                cut = lambda t: tp.shard_heads(t, axis, heads, head_dim)  # noqa: E731
            else:
                cut = lambda t: tp.shard(t, split if kind == "weight" else 0)  # noqa: E731
            if kind == "weight":
                return lambda t: linear.load_shard(part, weight=cut(t))
            return lambda t: linear.load_shard(part, bias=cut(t))

        def linear_names(prefix: str, linear: Linear, parts: dict[str, str],
                         split: int = 0, heads: dict[str, range] | None = None) -> None:
            kinds = ("weight", "bias") if linear.bias is not None else ("weight",)
            for hf_name, part in parts.items():
                for kind in kinds:
                    targets[f"{prefix}.{hf_name}.{kind}"] = shard(
                        linear, part, kind, split, heads[part] if heads else None)

        embed = self.model.embed_tokens
        embed_name = "model.embed_tokens.weight"
        targets[embed_name] = (embed.load if tp is None else
                               lambda t: whole(embed.weight, embed_name)(tp.shard(t, 0)))
        targets["model.norm.weight"] = whole(self.model.norm.weight, "model.norm.weight")
        if self.lm_head is not None:
            targets["lm_head.weight"] = shard(self.lm_head, "weight", "weight")
        for i, layer in enumerate(self.model.layers):
            p = f"model.layers.{i}"
            attn = layer.self_attn
            q, kv = attn.q_heads, attn.kv_heads
            linear_names(f"{p}.self_attn", attn.qkv_proj, {"q_proj": "q", "k_proj": "k",
                                                           "v_proj": "v"},
                         heads={"q": q, "k": kv, "v": kv})
            linear_names(f"{p}.self_attn", attn.o_proj, {"o_proj": "weight"}, split=1,
                         heads={"weight": q})
            self._add_mlp_targets(targets, p, layer.mlp, linear_names)
            for norm in ("input_layernorm", "post_attention_layernorm"):
                targets[f"{p}.{norm}.weight"] = whole(getattr(layer, norm).weight,
                                                      f"{p}.{norm}.weight")
            if attn.q_norm is not None:
                targets[f"{p}.self_attn.q_norm.weight"] = whole(attn.q_norm.weight, "q_norm")
                targets[f"{p}.self_attn.k_norm.weight"] = whole(attn.k_norm.weight, "k_norm")
        return targets

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors, fusing q/k/v and gate/up; return the names used.

        A tied model ignores a checkpoint's ``lm_head.weight`` (it is the embedding).
        Names without the ``model.`` prefix (a bare ``Qwen3Model`` / ``LlamaModel``
        export, as Qwen3-Embedding ships) load as the prefixed ones.

        Raises:
            ModelLoadError: tensors the model needs are missing, the checkpoint has
                tensors this model does not know, or a shape does not match.
        """
        targets = self._weight_targets()

        def key_of(name: str) -> str:
            return f"model.{name}" if name not in targets and f"model.{name}" in targets \
                else name

        def ignored(key: str) -> bool:
            return key.endswith(_IGNORED_SUFFIXES) or (
                key == "lm_head.weight" and self.lm_head is None)

        used = load_named_weights(targets, weights, key_of, ignored)
        self._cpu_decode, reason = build_cpu_decode_stack(self, self._quant)
        if reason:
            logger.debug("the CPU decode-stack executor is not used: %s", reason)
        return used


class LlamaForCausalLM(LlamaStack, CausalLM):
    """A Llama-family causal LM over packed tokens. As an embedder (Qwen3-Embedding
    style) it pools the last token's hidden state (the default pooling). Draft heads
    (EAGLE) share its input embedding and read its final (normed) hidden states."""

    supports_draft_heads = True

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[n]`` -> ``[n, hidden]``: the input embedding (all ranks' rows)."""
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> float32 logits ``[n, vocab_size]``."""
        return self._logits(hidden_states, float32=True)

    def compute_greedy_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> the LM head's logits in its own dtype (see
        :meth:`lmkit.api.CausalLM.compute_greedy_logits`): the float32 logits are their
        exact conversion."""
        return self._logits(hidden_states, float32=False)

    def _logits(self, hidden_states: torch.Tensor, float32: bool) -> torch.Tensor:
        if self.lm_head is None:
            return self.model.embed_tokens.logits(hidden_states, float32)
        logits = self.lm_head(hidden_states)
        # contiguous: a CPU head whose vocabulary is a multiple of 512 returns a view
        logits = (logits.float() if float32 else logits).contiguous()
        return logits if self.tp is None else self.tp.gather_vocab(logits, self.dims.vocab_size)


class LlamaEmbeddingModel(LlamaStack, PoolingModel):
    """A Llama-family model exported without its language-model head (``Qwen3Model``,
    ``LlamaModel``, ...): embeddings only, by last-token pooling."""

    has_lm_head = False

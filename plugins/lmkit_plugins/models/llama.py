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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from lmkit.api import (
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
from lmkit_plugins.models.fused_ops import (
    fused_ops_enabled,
    rotary_qk_kernel,
    silu_and_mul_kernel,
)
from lmkit_plugins.models.layers import (
    Linear,
    RMSNorm,
    VocabEmbedding,
    silu_and_mul,
    whole_weight_loader,
)
from lmkit_plugins.models.llama_dims import LlamaDims, layer_windows
from lmkit_plugins.models.rotary import (
    CPU_ROPE_MAX_ROWS,
    RotaryEmbedding,
    cpu_rope_kernel,
    rope_config_from_hf,
)
from lmkit_plugins.models.tensor_parallel import TensorParallel, VocabParallelEmbedding

# checkpoint tensors that carry no weights of ours (older exports save RoPE buffers)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaAttention(nn.Module):
    """Fused QKV projection, optional q/k norm, RoPE, paged attention, output projection.

    Under tensor parallelism (``tp``) this rank holds ``num_heads / N`` query heads and
    ``num_kv_heads / N`` KV heads (column-parallel QKV) and a row-parallel o_proj whose
    partial sums are all-reduced.
    """

    def __init__(self, dims: LlamaDims, layer_idx: int, rotary: RotaryEmbedding,
                 dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel | None = None, quant: Any = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.tp = tp
        ranks = tp.size if tp is not None else 1
        self.num_heads, self.num_kv_heads, self.head_dim = (
            dims.num_heads // ranks, dims.num_kv_heads // ranks, dims.head_dim)
        self.q_size = self.num_heads * dims.head_dim
        self.kv_size = self.num_kv_heads * dims.head_dim
        self.rotary = rotary
        kw = {"dtype": dtype, "device": device}
        qkw = {**kw, "quantization": quant}
        self.qkv_proj = Linear(dims.hidden_size, {"q": self.q_size, "k": self.kv_size,
                                                  "v": self.kv_size}, bias=dims.qkv_bias, **qkw)
        self.o_proj = Linear(self.q_size, {"weight": dims.hidden_size}, bias=dims.o_bias, **qkw)
        self.q_norm = RMSNorm(dims.head_dim, dims.rms_norm_eps, **kw) if dims.qk_norm else None
        self.k_norm = RMSNorm(dims.head_dim, dims.rms_norm_eps, **kw) if dims.qk_norm else None
        # CUDA half precision: q/k norm + RoPE in one in-place kernel (fused_ops)
        self._rotary_qk = rotary_qk_kernel() if fused_ops_enabled(device, dtype) else None
        # CPU float32 decode: RoPE in place on the fused QKV output (lmkit's C kernel)
        self._cpu_rope = cpu_rope_kernel(rotary, device, dtype) if not dims.qk_norm else None
        self._head_counts = [self.num_heads, self.num_kv_heads, self.num_kv_heads]

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionBackend, kv_cache: torch.Tensor,
                kv_slots: torch.Tensor | None = None) -> torch.Tensor:
        """``kv_slots``: the backend's :meth:`~lmkit.api.AttentionBackend.kv_write_slots`;
        with the fused kernel, K/V then go to the cache in the RoPE kernel."""
        n = hidden.shape[0]
        qkv = self.qkv_proj.forward(hidden)  # [n, q_size + 2 * kv_size]
        kv_written = kv_slots is not None and self._rotary_qk is not None
        if self._cpu_rope is not None and n <= CPU_ROPE_MAX_ROWS:
            # CPU float32 decode: q and k heads rotated in place (qkv is this call's own
            # output), then all three as views of one split: few ops per layer
            heads = qkv.view(n, -1, self.head_dim)  # [n, num_heads + 2 * num_kv_heads, d]
            self._cpu_rope(heads, cos, sin, self.num_heads + self.num_kv_heads)
            q, k, v = heads.split_with_sizes(self._head_counts, 1)
        else:
            q, k, v = self._rotated_heads(qkv, cos, sin, kv_cache, kv_slots if kv_written
                                          else None)
        if kv_written:  # [n, num_heads, head_dim]
            out = attn.run(self.layer_idx, q, k, v, kv_cache, kv_written=True)
        else:
            out = attn.run(self.layer_idx, q, k, v, kv_cache)
        out = self.o_proj.forward(out.reshape(n, self.q_size))
        return out if self.tp is None else self.tp.all_reduce(out)

    def _rotated_heads(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       kv_cache: torch.Tensor, kv_slots: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q, k, v`` ``[n, heads, head_dim]`` of a fused QKV output, q/k normed (when
        the model has q/k norms) and rotated: the fused CUDA kernel (which also writes
        K/V to the cache when ``kv_slots`` is given), else torch ops."""
        n = qkv.shape[0]
        qk_end = self.q_size + self.kv_size
        v = qkv[:, qk_end:].view(n, self.num_kv_heads, self.head_dim)
        if self._rotary_qk is not None:
            self._rotary_qk(qkv, cos, sin, num_heads=self.num_heads,
                            num_kv_heads=self.num_kv_heads, head_size=self.head_dim,
                            q_norm=None if self.q_norm is None else self.q_norm.weight,
                            k_norm=None if self.k_norm is None else self.k_norm.weight,
                            eps=1e-6 if self.q_norm is None else self.q_norm.eps,
                            kv_cache=kv_cache if kv_slots is not None else None,
                            slot_mapping=kv_slots)
            q = qkv[:, :self.q_size].view(n, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size:qk_end].view(n, self.num_kv_heads, self.head_dim)
        elif self.q_norm is None:
            # rotate query and key heads together: [n, num_heads + num_kv_heads, head_dim]
            qk = self.rotary.apply(qkv[:, :qk_end].view(n, -1, self.head_dim), cos, sin)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        else:
            q = self.q_norm.forward(qkv[:, :self.q_size].view(n, self.num_heads, self.head_dim))
            k = self.k_norm.forward(
                qkv[:, self.q_size:qk_end].view(n, self.num_kv_heads, self.head_dim))
            q, k = self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin)
        return q, k, v


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward with a fused gate-up projection (column-parallel under
    ``tp``; down_proj row-parallel, all-reduced)."""

    def __init__(self, dims: LlamaDims, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel | None = None, quant: Any = None,
                 intermediate_size: int | None = None,
                 act: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        # intermediate_size: instead of dims.intermediate_size (e.g. a MoE's shared experts);
        # act: ``[n, 2 * size]`` gate-up -> ``[n, size]``, instead of SiLU-and-multiply
        super().__init__()
        kw = {"dtype": dtype, "device": device, "quantization": quant}
        self.tp = tp
        size = (intermediate_size or dims.intermediate_size) // (tp.size if tp is not None else 1)
        self.gate_up_proj = Linear(dims.hidden_size, {"gate": size, "up": size},
                                   bias=dims.mlp_bias, **kw)
        self.down_proj = Linear(size, {"weight": dims.hidden_size}, bias=dims.mlp_bias, **kw)
        self.act = act if act is not None else (
            silu_and_mul_kernel() if fused_ops_enabled(device, dtype) else silu_and_mul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj.forward(self.act(self.gate_up_proj.forward(x)))
        return out if self.tp is None else self.tp.all_reduce(out)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks around a residual stream. ``mlp`` replaces the
    dense :class:`LlamaMLP` (e.g. a mixture of experts): any module whose ``forward``
    maps ``[n, hidden]`` to ``[n, hidden]``."""

    def __init__(self, dims: LlamaDims, layer_idx: int, rotary: RotaryEmbedding,
                 dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel | None = None, quant: Any = None,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.input_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, **kw)
        self.self_attn = LlamaAttention(dims, layer_idx, rotary, dtype, device, tp, quant)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, dims.rms_norm_eps, **kw)
        self.mlp = mlp if mlp is not None else LlamaMLP(dims, dtype, device, tp, quant)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, attn: AttentionBackend, kv_cache: torch.Tensor,
                kv_slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # submodules' forward is called directly: nn.Module.__call__ (hooks, which
        # nothing here uses) costs ~0.5 ms per step over 30 layers on a CPU
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm.forward(hidden)
        else:
            hidden, residual = self.input_layernorm.forward(hidden, residual)
        hidden = self.self_attn.forward(hidden, cos, sin, attn, kv_cache, kv_slots)
        hidden, residual = self.post_attention_layernorm.forward(hidden, residual)
        return self.mlp.forward(hidden), residual


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
        ranks = tp.size if tp is not None else 1
        dtype, device = ctx.dtype, torch.device(ctx.device)
        self.rotary = RotaryEmbedding(rope_config_from_hf(hf_config, dims.head_dim),
                                      dims.head_dim, device)
        quant = ctx.quantization  # a QuantizationMethod, or None for dense weights
        self.model = LlamaModel(dims, self.rotary, dtype, device, tp, quant,
                                self._mlp_builder(hf_config, dims, dtype, device))
        self._fused_ops = fused_ops_enabled(device, dtype)
        local_vocab = dims.vocab_size if tp is None else tp.local(dims.vocab_size)
        # fused kernels write K/V in the RoPE kernel when the backend declares it may
        self._model_writes_kv = (self._fused_ops
                                 and ctx.attention_cls.supports_model_kv_write)
        self.lm_head = None if dims.tie_word_embeddings or not self.has_lm_head else Linear(
            dims.hidden_size, {"weight": local_vocab}, bias=False, dtype=dtype, device=device,
            quantization=quant)

        def make_backend(window: int | None) -> AttentionBackend:
            return ctx.attention_cls(
                num_heads=dims.num_heads // ranks, num_kv_heads=dims.num_kv_heads // ranks,
                head_size=dims.head_dim, scale=dims.head_dim ** -0.5, dtype=dtype,
                device=device, block_size=ctx.block_size, sliding_window=window,
                options=ctx.attention_options)

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

        def shard(linear: Linear, part: str, kind: str, split: int | None = 0
                  ) -> Callable[[torch.Tensor], None]:
            # split: the axis of the weight divided over ranks (0: output rows, column-
            # parallel; 1: input columns, row-parallel, whose bias only rank 0 adds)
            if tp is None or split is None:
                cut: Callable[[torch.Tensor], torch.Tensor | None] = lambda t: t  # noqa: E731
            elif kind == "bias" and split == 1:
                cut = lambda t: t if tp.rank == 0 else None  # noqa: E731
            else:
                cut = lambda t: tp.shard(t, split if kind == "weight" else 0)  # noqa: E731
            if kind == "weight":
                return lambda t: linear.load_shard(part, weight=cut(t))
            return lambda t: linear.load_shard(part, bias=cut(t))

        def linear_names(prefix: str, linear: Linear, parts: dict[str, str],
                         split: int = 0) -> None:
            kinds = ("weight", "bias") if linear.bias is not None else ("weight",)
            for hf_name, part in parts.items():
                for kind in kinds:
                    targets[f"{prefix}.{hf_name}.{kind}"] = shard(linear, part, kind, split)

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
            linear_names(f"{p}.self_attn", attn.qkv_proj, {"q_proj": "q", "k_proj": "k",
                                                           "v_proj": "v"})
            linear_names(f"{p}.self_attn", attn.o_proj, {"o_proj": "weight"}, split=1)
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

        return load_named_weights(targets, weights, key_of, ignored)


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
        if self.lm_head is None:
            return self.model.embed_tokens.logits(hidden_states)
        # contiguous: a CPU head whose vocabulary is a multiple of 512 returns a view
        logits = self.lm_head(hidden_states).float().contiguous()
        return logits if self.tp is None else self.tp.gather_vocab(logits, self.dims.vocab_size)


class LlamaEmbeddingModel(LlamaStack, PoolingModel):
    """A Llama-family model exported without its language-model head (``Qwen3Model``,
    ``LlamaModel``, ...): embeddings only, by last-token pooling."""

    has_lm_head = False

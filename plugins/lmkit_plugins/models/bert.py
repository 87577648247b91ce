"""BERT-style encoders (``BertModel``): bidirectional attention, absolute position
embeddings, post-norm layers; embeddings only (no language-model head).

all-MiniLM-L6-v2, BGE and E5 checkpoints are ``BertModel`` s. The model is a
:class:`lmkit.api.PoolingModel` (the engine refuses generation requests) and declares
``pooling = ModelPooling(causal=False, ...)``: the engine then selects an attention
backend with the ``non_causal`` feature and runs each prompt whole in one step (no
chunking, no prefix cache). Tokens are packed along
one axis (no batch axis, no padding); every token has token type 0 (one segment).
``BertForSequenceClassification`` adds the classification head (``[CLS]``, the pooler's
dense + tanh, the classifier): its default pooler is ``classify``, whose activation the
config's ``problem_type`` picks (:class:`~lmkit.api.pooling.ClassifierHead`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from lmkit.api import (
    AttentionBackend,
    ClassifierHead,
    ForwardContext,
    ModelBuildContext,
    ModelLoadError,
    PoolingModel,
)
from lmkit.api.pooling import ModelPooling
from torch import nn

from lmkit_plugins.models.checkpoint_load import load_named_weights
from lmkit_plugins.models.layers import Linear, whole_weight_loader

# checkpoint tensors that carry no weights of ours
_IGNORED = ("embeddings.position_ids",)
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu, "relu": F.relu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}
# activations Linear.forward_gelu fuses into the projection: name -> its `approximate`
_GELU_APPROXIMATE = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


@dataclass(frozen=True)
class BertDims:
    """Shapes of a BERT encoder, read from its HF config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_positions: int
    type_vocab_size: int
    layer_norm_eps: float
    act: str

    @classmethod
    def from_hf(cls, cfg: Any) -> BertDims:
        kind = getattr(cfg, "position_embedding_type", "absolute") or "absolute"
        if kind != "absolute":
            raise ModelLoadError(
                f"BERT position_embedding_type {kind!r} is not supported (only 'absolute'); "
                "use a checkpoint with absolute position embeddings")
        act = str(getattr(cfg, "hidden_act", "gelu"))
        if act not in _ACTIVATIONS:
            raise ModelLoadError(f"BERT hidden_act {act!r} is not supported; supported: "
                                 f"{', '.join(sorted(_ACTIVATIONS))}")
        return cls(int(cfg.vocab_size), int(cfg.hidden_size), int(cfg.intermediate_size),
                   int(cfg.num_hidden_layers), int(cfg.num_attention_heads),
                   int(cfg.max_position_embeddings), int(getattr(cfg, "type_vocab_size", 2)),
                   float(getattr(cfg, "layer_norm_eps", 1e-12)), act)


class LayerNorm(nn.Module):
    """``F.layer_norm`` with HF's parameter names (``weight``, ``bias``)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(size, dtype=dtype, device=device),
                                 requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class BertLayer(nn.Module):
    """Self-attention (fused QKV) and feed-forward, each followed by add & LayerNorm."""

    def __init__(self, dims: BertDims, layer_idx: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        h = dims.hidden_size
        self.layer_idx = layer_idx
        self.num_heads = dims.num_heads
        self.head_dim = h // dims.num_heads
        self.qkv = Linear(h, {"q": h, "k": h, "v": h}, bias=True, **kw)
        self.attn_out = Linear(h, {"weight": h}, bias=True, **kw)
        self.attn_norm = LayerNorm(h, dims.layer_norm_eps, **kw)
        self.intermediate = Linear(h, {"weight": dims.intermediate_size}, bias=True, **kw)
        self.out = Linear(dims.intermediate_size, {"weight": h}, bias=True, **kw)
        self.out_norm = LayerNorm(h, dims.layer_norm_eps, **kw)
        self.act = _ACTIVATIONS[dims.act]
        self.gelu_approximate = _GELU_APPROXIMATE.get(dims.act)

    def forward(self, hidden: torch.Tensor, attn: AttentionBackend,
                kv_cache: torch.Tensor) -> torch.Tensor:
        n, h = hidden.shape
        qkv = self.qkv.forward(hidden)  # [n, 3 * hidden]
        q, k, v = (qkv[:, i * h:(i + 1) * h].view(n, self.num_heads, self.head_dim)
                   for i in range(3))
        ctx = attn.run(self.layer_idx, q, k, v, kv_cache)  # [n, heads, head_dim]
        # (on the CPU the residual adds and the GELU run inside oneDNN's matmuls)
        hidden = self.attn_norm.forward(self.attn_out.forward_add(ctx.reshape(n, h), hidden))
        if self.gelu_approximate is not None:
            inter = self.intermediate.forward_gelu(hidden, self.gelu_approximate)
        else:
            inter = self.act(self.intermediate.forward(hidden))
        return self.out_norm.forward(self.out.forward_add(inter, hidden))


class BertModel(nn.Module, PoolingModel):
    """A BERT encoder over packed tokens; ``forward`` returns the last hidden states."""

    pooling = ModelPooling(default_pooler="cls", causal=False)
    has_head = False  # BertForSequenceClassification: the pooler and classifier are used

    def __init__(self, hf_config: Any, ctx: ModelBuildContext) -> None:
        super().__init__()
        dims = BertDims.from_hf(hf_config)
        self.dims = dims
        dtype, device = ctx.dtype, torch.device(ctx.device)
        kw = {"dtype": dtype, "device": device}
        self.word_embeddings = nn.Parameter(
            torch.zeros(dims.vocab_size, dims.hidden_size, **kw), requires_grad=False)
        self.position_embeddings = nn.Parameter(
            torch.zeros(dims.max_positions, dims.hidden_size, **kw), requires_grad=False)
        self.token_type_embeddings = nn.Parameter(
            torch.zeros(dims.type_vocab_size, dims.hidden_size, **kw), requires_grad=False)
        self.embed_norm = LayerNorm(dims.hidden_size, dims.layer_norm_eps, **kw)
        self.layers = nn.ModuleList(BertLayer(dims, i, dtype, device)
                                    for i in range(dims.num_layers))
        head_dim = dims.hidden_size // dims.num_heads
        self.attn: AttentionBackend = ctx.attention_cls(
            num_heads=dims.num_heads, num_kv_heads=dims.num_heads, head_size=head_dim,
            scale=head_dim ** -0.5, dtype=dtype, device=device, block_size=ctx.block_size,
            sliding_window=None, options=ctx.attention_options, causal=False,
            kv_cache_dtype=ctx.kv_cache_dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """``input_ids``, ``positions``: ``[num_tokens]`` -> hidden ``[num_tokens, hidden]``."""
        hidden = (self.word_embeddings[input_ids] + self.position_embeddings[positions]
                  + self.token_type_embeddings[0])
        hidden = self.embed_norm.forward(hidden)
        for i, layer in enumerate(self.layers):
            hidden = layer.forward(hidden, ctx.attn, ctx.kv_caches[i])
        return hidden

    # ------------------------------------------------------------------ loading

    def _weight_targets(self) -> dict[str, Callable[[torch.Tensor], None]]:
        """HF checkpoint name (without a ``bert.`` prefix) -> how to load it."""
        targets: dict[str, Callable[[torch.Tensor], None]] = {}

        whole = whole_weight_loader

        def linear(prefix: str, layer: Linear, part: str) -> None:
            targets[f"{prefix}.weight"] = lambda t: layer.load_shard(part, weight=t)
            targets[f"{prefix}.bias"] = lambda t: layer.load_shard(part, bias=t)

        def norm(prefix: str, ln: LayerNorm) -> None:
            targets[f"{prefix}.weight"] = whole(ln.weight, f"{prefix}.weight")
            targets[f"{prefix}.bias"] = whole(ln.bias, f"{prefix}.bias")

        for name in ("word_embeddings", "position_embeddings", "token_type_embeddings"):
            targets[f"embeddings.{name}.weight"] = whole(getattr(self, name), name)
        norm("embeddings.LayerNorm", self.embed_norm)
        for i, layer in enumerate(self.layers):
            p = f"encoder.layer.{i}"
            for hf, part in (("query", "q"), ("key", "k"), ("value", "v")):
                linear(f"{p}.attention.self.{hf}", layer.qkv, part)
            linear(f"{p}.attention.output.dense", layer.attn_out, "weight")
            norm(f"{p}.attention.output.LayerNorm", layer.attn_norm)
            linear(f"{p}.intermediate.dense", layer.intermediate, "weight")
            linear(f"{p}.output.dense", layer.out, "weight")
            norm(f"{p}.output.LayerNorm", layer.out_norm)
        return targets

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors (with or without the ``bert.`` prefix), fusing q/k/v;
        the ``pooler.*`` (next-sentence head) tensors are not used.

        Raises:
            ModelLoadError: tensors are missing or unknown, or a shape does not match.
        """
        targets = self._weight_targets()

        def ignored(key: str) -> bool:
            return key.endswith(_IGNORED) or (key.startswith("pooler.") and not self.has_head)

        return load_named_weights(targets, weights, lambda name: name.removeprefix("bert."),
                                  ignored)


class BertForSequenceClassification(BertModel):
    """A BERT encoder with its sequence-classification head: ``[CLS]`` -> dense + tanh
    (HF's ``bert.pooler``) -> ``classifier`` -> one logit per label.

    ``classifier_head`` (read by the ``classify`` pooler) holds ``num_labels`` and the
    config's ``problem_type``.

    Raises:
        ModelLoadError: the config's ``problem_type`` is not one transformers defines.
    """

    pooling = ModelPooling(default_pooler="classify", causal=False, classifier_pooler="cls")
    has_head = True

    def __init__(self, hf_config: Any, ctx: ModelBuildContext) -> None:
        head = ClassifierHead.from_hf(hf_config)  # checked before any tensor is allocated
        super().__init__(hf_config, ctx)
        self.classifier_head = head
        h = self.dims.hidden_size
        kw = {"dtype": ctx.dtype, "device": torch.device(ctx.device)}
        self.pooler_dense = Linear(h, {"weight": h}, bias=True, **kw)
        self.classifier = Linear(h, {"weight": head.num_labels}, bias=True, **kw)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` ([CLS] states) -> logits ``[n, num_labels]``."""
        return self.classifier.forward(torch.tanh(self.pooler_dense.forward(pooled)))

    def _weight_targets(self) -> dict[str, Callable[[torch.Tensor], None]]:
        targets = super()._weight_targets()
        for prefix, layer in (("pooler.dense", self.pooler_dense),
                              ("classifier", self.classifier)):
            targets[f"{prefix}.weight"] = lambda t, layer=layer: layer.load_shard(
                "weight", weight=t)
            targets[f"{prefix}.bias"] = lambda t, layer=layer: layer.load_shard("weight", bias=t)
        return targets

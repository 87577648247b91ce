"""The ``eagle`` proposer: an EAGLE-1/2 draft head, hosted in the model runner.

The head (Li et al. 2024, "EAGLE") is one (or a few) Llama decoder layers over
``fc(concat[embed(token after p), feature at p])``: the feature is the target's last
hidden state (after its final norm, what its language-model head reads; the EAGLE
reference and vLLM feed the same), and the head's output (before any norm) is both the
next step's feature and what the shared language-model head turns into logits. The
first layer has no input norm.

Checkpoint: a directory with an HF-style ``config.json`` (a Llama config:
``hidden_size``, ``num_hidden_layers``, heads, ``intermediate_size``, RoPE settings)
and ``*.safetensors`` with ``fc.weight`` (``[hidden, 2 * hidden]``, optional
``fc.bias``) and ``layers.N.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj,
post_attention_layernorm}`` (``input_layernorm`` from layer 1 on), optionally
``embed_tokens.weight`` and ``lm_head.weight`` (shared from the target when absent),
names optionally prefixed with ``model.``.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from lmkit.api import (
    ConfigError,
    DraftHeadContext,
    ForwardContext,
    LMKitConfig,
    RunnerProposer,
)
from torch import nn

from lmkit_plugins.models.layers import Linear, VocabEmbedding
from lmkit_plugins.models.llama_dims import LlamaDims
from lmkit_plugins.models.llama_layers import LlamaDecoderLayer, LlamaMLP
from lmkit_plugins.models.rotary import RotaryEmbedding, rope_config_from_hf
from lmkit_plugins.spec import EagleOptions
from lmkit_plugins.spec.head_checkpoint import (
    BLOCK_TENSORS,
    HeadCheckpoint,
    Loader,
    add_whole,
    block_targets,
    build_attention,
    linear_targets,
    load_named,
)


class NoNorm(nn.Module):
    """The first EAGLE layer's input norm: none."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class EagleProposer(RunnerProposer):
    """An EAGLE-1/2 head read from ``config.speculative.model``.

    Raises:
        ConfigError: no ``speculative.model`` set, or it is not a head directory.
    """

    supports_cuda_graphs = True  # draft passes replay in CUDA graphs
    supports_graph_drafts = True  # and take their drafts inside them

    def __init__(self, config: LMKitConfig, *, options: Any = None) -> None:
        # sampled requests' drafts drawn from the head's distribution (draft_sampling)
        self.samples_drafts = (options or EagleOptions()).draft_sampling == "auto"
        self.checkpoint = HeadCheckpoint(config, "eagle")
        self.dims = self.checkpoint.dims
        self.num_kv_layers = self.dims.num_layers
        self.head: EagleHead | None = None

    def check_target(self, target_hf_config: Any) -> None:
        """Refuse a head whose feature size or vocabulary does not fit the target."""
        target = LlamaDims.from_hf(target_hf_config)
        ckpt, hidden, problems = self.checkpoint, self.dims.hidden_size, []
        if hidden != target.hidden_size:
            problems.append(f"hidden_size {hidden} != the target's {target.hidden_size}")
        if "fc.weight" not in ckpt.shapes:
            problems.append("the checkpoint has no fc.weight (not an EAGLE-1/2 head)")
        elif (fc := ckpt.shape_problem("fc.weight", (hidden, 2 * target.hidden_size))):
            problems.append(f"{fc} (concat of embedding and target feature)")
        if "midlayer.self_attn.q_proj.weight" in ckpt.shapes:
            problems.append("it is an EAGLE-3 head (midlayer.*): use --speculative eagle3")
        if not problems:  # (a head of another kind is named above)
            for i in range(self.dims.num_layers):  # layer 0 has no input norm in EAGLE-1
                norms = ("post_attention_layernorm", *(("input_layernorm",) if i else ()))
                if (gone := ckpt.missing_problem(f"layers.{i}.", (*BLOCK_TENSORS, *norms))):
                    problems.append(gone)
        if self.dims.vocab_size != target.vocab_size:
            problems.append(f"vocab_size {self.dims.vocab_size} != the target's "
                            f"{target.vocab_size}")
        for name in ("embed_tokens.weight", "lm_head.weight"):
            if name in ckpt.shapes and (bad := ckpt.shape_problem(
                    name, (target.vocab_size, hidden))):
                problems.append(bad)
        if problems:
            raise ConfigError(f"the EAGLE head at {ckpt.model_dir} does not fit the target "
                              f"model: {'; '.join(problems)}")
        self.target_feature_size = target.hidden_size  # the target's final hidden states

    def load(self, ctx: DraftHeadContext) -> None:
        """Build the head (sharing what the checkpoint omits) and load its weights."""
        shapes = self.checkpoint.shapes
        self.attn = build_attention(self.dims, ctx.build)
        self.hidden_size = self.dims.hidden_size
        self.head = EagleHead(self.checkpoint.hf_config, self.dims, ctx,
                              own_embedding="embed_tokens.weight" in shapes,
                              own_lm_head="lm_head.weight" in shapes,
                              fc_bias="fc.bias" in shapes)
        with torch.no_grad():
            load_named(self.head.weight_targets(), self.checkpoint.weights(), "EAGLE head")
        self.head.eval()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        assert self.head is not None, "load() first"
        return self.head.forward(input_ids, positions, hidden_states, ctx)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        assert self.head is not None, "load() first"
        return self.head.compute_logits(hidden_states)


class EagleHead(nn.Module):
    """``fc`` and the decoder layers; the embedding and language-model head are the
    head's own when its checkpoint has them, else the target's."""

    def __init__(self, hf_config: Any, dims: LlamaDims, ctx: DraftHeadContext, *,
                 own_embedding: bool, own_lm_head: bool, fc_bias: bool) -> None:
        super().__init__()
        dtype, device = ctx.build.dtype, torch.device(ctx.build.device)
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        h = dims.hidden_size
        self.target = ctx.target
        self.rotary = RotaryEmbedding(rope_config_from_hf(hf_config, dims.head_dim),
                                      dims.head_dim, device)
        self.fc = Linear(2 * h, {"weight": h}, bias=fc_bias, **kw)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(dims, i, self.rotary, dtype, device) for i in range(dims.num_layers))
        self.layers[0].replace_input_norm(NoNorm())
        self.embed_tokens = VocabEmbedding(dims.vocab_size, h, **kw) if own_embedding else None
        self.lm_head = (Linear(h, {"weight": dims.vocab_size}, bias=False, **kw)
                        if own_lm_head else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``[n]`` ids, positions, ``[n, hidden]`` features -> ``[n, hidden]``."""
        embeds = (self.embed_tokens(input_ids) if self.embed_tokens is not None
                  else self.target.embed_input_ids(input_ids))
        x = self.fc.forward(torch.cat((embeds, hidden_states.to(embeds.dtype)), dim=-1))
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            x, residual = layer.forward(x, residual, cos, sin, ctx.attn, ctx.kv_caches[i])
        assert residual is not None
        return x + residual

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> float32 ``[n, vocab]``: the head's own LM head, else the
        target's."""
        if self.lm_head is None:
            return self.target.compute_logits(hidden_states)
        return self.lm_head.forward(hidden_states).float().contiguous()

    def weight_targets(self) -> dict[str, Loader]:
        """EAGLE checkpoint name -> how to load it into the fused parameters."""
        targets: dict[str, Loader] = {}
        linear_targets(targets, self.fc, {"fc": "weight"})
        for i, layer in enumerate(cast(list[LlamaDecoderLayer], list(self.layers))):
            block_targets(targets, f"layers.{i}", layer.self_attn, cast(LlamaMLP, layer.mlp))
            add_whole(targets, f"layers.{i}.post_attention_layernorm.weight",
                      layer.post_attention_layernorm.weight)
            if i > 0:
                add_whole(targets, f"layers.{i}.input_layernorm.weight",
                          layer.input_layernorm.weight)
        if self.embed_tokens is not None:
            add_whole(targets, "embed_tokens.weight", self.embed_tokens.weight)
        if self.lm_head is not None:
            linear_targets(targets, self.lm_head, {"lm_head": "weight"})
        return targets

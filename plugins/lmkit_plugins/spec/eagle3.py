"""The ``eagle3`` proposer: an EAGLE-3 draft head, hosted in the model runner.

EAGLE-3 (Li et al. 2025) fuses three of the target's layers instead of its last one:
the inputs of target layers ``low, mid, high`` (the residual stream entering each;
``eagle_config.eagle_aux_hidden_state_layer_ids`` in the head's config, else
``[2, L // 2, L - 3]`` for an ``L``-layer target, as vLLM derives them), concatenated,
go through ``fc`` (``[hidden, 3 * target hidden]``, no bias) on the first pass; later
passes feed the head's own output back. The one decoder layer (``midlayer``) attends
over ``concat[input_layernorm(embedding), hidden_norm(feature)]`` (its q/k/v take
``2 * hidden`` inputs), its residual is the feature; a final ``norm`` precedes the
head's own language-model head over a *draft vocabulary* of ``draft_vocab_size`` ids,
mapped to the target's by ``d2t`` (``target id = draft id + d2t[draft id]``; ``t2d``,
the target-side mask, is read and not needed: sampled drafts are drawn over the draft
vocabulary and mapped, so target ids outside it get probability 0).

Checkpoint tensors: ``fc.weight``, ``midlayer.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,
down}_proj, input_layernorm, hidden_norm, post_attention_layernorm}.weight`` (also
accepted as ``layers.0.*``), ``norm.weight``, ``lm_head.weight``, ``d2t`` and ``t2d``
(both optional when the draft vocabulary is the target's), optionally
``embed_tokens.weight`` (else the target's embedding is shared).
"""

from __future__ import annotations

from typing import Any

import torch
from lmkit.api import (
    ConfigError,
    DraftHeadContext,
    ForwardContext,
    LMKitConfig,
    ModelLoadError,
    RunnerProposer,
)
from torch import nn

from lmkit_plugins.models.layers import Linear, RMSNorm, VocabEmbedding
from lmkit_plugins.models.llama_dims import LlamaDims
from lmkit_plugins.models.llama_layers import LlamaAttention, LlamaMLP
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


class Eagle3Proposer(RunnerProposer):
    """An EAGLE-3 head read from ``config.speculative.model``.

    Raises:
        ConfigError: no ``speculative.model`` set, not a head directory, or a head of
            more than one decoder layer (not built yet).
    """

    supports_cuda_graphs = True  # draft passes replay in CUDA graphs
    supports_graph_drafts = True  # and take their drafts inside them

    def __init__(self, config: LMKitConfig, *, options: Any = None) -> None:
        # sampled requests' drafts drawn from the head's distribution (draft_sampling)
        self.samples_drafts = (options or EagleOptions()).draft_sampling == "auto"
        self.checkpoint = HeadCheckpoint(config, "eagle3")
        self.dims = self.checkpoint.dims
        if self.dims.num_layers != 1:
            raise ConfigError(
                f"the EAGLE-3 head at {self.checkpoint.model_dir} has num_hidden_layers = "
                f"{self.dims.num_layers}; heads of more than one layer are not built yet")
        self.num_kv_layers = 1
        cfg = self.checkpoint.hf_config
        draft_vocab = getattr(cfg, "draft_vocab_size", None) or self.dims.vocab_size
        eagle_config = getattr(cfg, "eagle_config", None) or {}
        ids = (eagle_config.get("eagle_aux_hidden_state_layer_ids")
               if isinstance(eagle_config, dict) else eagle_config)
        bad = []
        if not _whole(draft_vocab) or draft_vocab < 1:
            bad.append(f"draft_vocab_size is {draft_vocab!r}; expected a positive whole number")
        if not isinstance(eagle_config, dict):
            bad.append(f"eagle_config is {eagle_config!r}; expected an object")
        elif ids and not (isinstance(ids, list) and all(_whole(i) for i in ids)):
            bad.append(f"eagle_config.eagle_aux_hidden_state_layer_ids is {ids!r}; expected "
                       "a list of target layer numbers")
        if bad:
            raise ConfigError(f"the EAGLE-3 head at {self.checkpoint.model_dir}: its "
                              f"config.json's {'; '.join(bad)}")
        self.draft_vocab_size = int(draft_vocab)
        self.configured_layers = tuple(ids) if ids else None
        self.head: Eagle3Head | None = None

    def check_target(self, target_hf_config: Any) -> None:
        """Refuse a head whose layers, feature sizes or vocabulary do not fit the target;
        sets :attr:`target_layers`."""
        target = LlamaDims.from_hf(target_hf_config)
        n = target.num_layers
        layers = self.configured_layers or (2, n // 2, n - 3)
        ckpt, h, problems = self.checkpoint, self.dims.hidden_size, []
        if ("midlayer.self_attn.q_proj.weight" not in ckpt.shapes
                and ckpt.shapes.get("fc.weight") == (h, 2 * target.hidden_size)):
            problems.append("it looks like an EAGLE-1/2 head (fc over [embedding, feature], no "
                            "midlayer): use --speculative eagle")
        if any(not 0 <= i < n for i in layers):
            problems.append(f"its target layers {list(layers)} are not all layers of the "
                            f"{n}-layer target (set eagle_config.eagle_aux_hidden_state_layer_ids "
                            "in its config.json)")
        q_size = self.dims.num_heads * self.dims.head_dim
        expect: dict[str, tuple[int, ...]] = {
            "fc.weight": (h, len(layers) * target.hidden_size),
            "midlayer.self_attn.q_proj.weight": (q_size, 2 * h),
            "lm_head.weight": (self.draft_vocab_size, h)}
        if self.draft_vocab_size != target.vocab_size or "d2t" in ckpt.shapes:
            expect["d2t"] = (self.draft_vocab_size,)
        if "embed_tokens.weight" in ckpt.shapes:
            expect["embed_tokens.weight"] = (target.vocab_size, h)
        elif h != target.hidden_size:
            problems.append(f"hidden_size {h} != the target's {target.hidden_size} (and no "
                            "embed_tokens.weight of its own)")
        for name, shape in expect.items():
            if name not in ckpt.shapes:  # the midlayer may be saved as layers.0
                name = name.replace("midlayer.", "layers.0.")
            if (bad := ckpt.shape_problem(name, shape)) is not None:
                problems.append(bad)
        block = "midlayer." if "midlayer.self_attn.q_proj.weight" in ckpt.shapes else "layers.0."
        if (gone := ckpt.missing_problem(block, (*BLOCK_TENSORS, "input_layernorm",
                                                 "hidden_norm", "post_attention_layernorm"))):
            problems.append(gone)
        if (gone := ckpt.missing_problem("", ("norm",))):
            problems.append(gone)
        if self.dims.vocab_size != target.vocab_size:
            problems.append(f"vocab_size {self.dims.vocab_size} != the target's "
                            f"{target.vocab_size}")
        if self.draft_vocab_size > target.vocab_size:
            problems.append(f"draft_vocab_size {self.draft_vocab_size} exceeds the target's "
                            f"vocabulary ({target.vocab_size})")
        if problems:
            raise ConfigError(f"the EAGLE-3 head at {ckpt.model_dir} does not fit the target "
                              f"model: {'; '.join(problems)}")
        self.target_layers = tuple(layers)
        self.target_feature_size = len(layers) * target.hidden_size  # fc's input

    def load(self, ctx: DraftHeadContext) -> None:
        """Build the head (sharing the target's embedding unless it has its own) and
        load its weights."""
        self.attn = build_attention(self.dims, ctx.build)
        self.hidden_size = self.dims.hidden_size
        self.head = Eagle3Head(self.checkpoint.hf_config, self.dims, ctx,
                               self.draft_vocab_size, len(self.target_layers),
                               own_embedding="embed_tokens.weight" in self.checkpoint.shapes)
        weights = ((n.replace("layers.0.", "midlayer.", 1) if n.startswith("layers.0.") else n,
                    t) for n, t in self.checkpoint.weights())
        with torch.no_grad():
            load_named(self.head.weight_targets(set(self.checkpoint.shapes)), weights,
                       "EAGLE-3 head")
        self.head.map_vocabulary()
        self.head.eval()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        assert self.head is not None, "load() first"
        return self.head.forward(input_ids, positions, hidden_states, ctx)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        assert self.head is not None, "load() first"
        return self.head.compute_logits(hidden_states)

    def draft_argmax(self, hidden_states: torch.Tensor) -> torch.Tensor:
        assert self.head is not None, "load() first"
        return self.head.draft_argmax(hidden_states)

    def draft_logits(self, hidden_states: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits over the draft vocabulary and its map to target ids (``d2t``)."""
        assert self.head is not None, "load() first"
        return self.head.draft_logits(hidden_states), self.head.target_ids


class Eagle3Head(nn.Module):
    """``fc``, the midlayer, the final norm and the draft-vocabulary LM head."""

    d2t: torch.Tensor  # [draft vocab] int64: target id - draft id
    t2d: torch.Tensor  # [vocab] bool: target ids in the draft vocabulary

    def __init__(self, hf_config: Any, dims: LlamaDims, ctx: DraftHeadContext,
                 draft_vocab_size: int, num_target_layers: int, *, own_embedding: bool) -> None:
        super().__init__()
        dtype, device = ctx.build.dtype, torch.device(ctx.build.device)
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        h, eps = dims.hidden_size, dims.rms_norm_eps
        self.hidden_size = h
        self.target = ctx.target
        self.vocab_size = dims.vocab_size
        self.rotary = RotaryEmbedding(rope_config_from_hf(hf_config, dims.head_dim),
                                      dims.head_dim, device)
        target_hidden = LlamaDims.from_hf(ctx.target_hf_config).hidden_size
        self.fc = Linear(num_target_layers * target_hidden, {"weight": h}, bias=False, **kw)
        self.self_attn = LlamaAttention(dims, 0, self.rotary, dtype, device)
        # the midlayer's attention reads [embedding, feature]: q/k/v take 2 * hidden
        attn = self.self_attn
        self.self_attn.qkv_proj = Linear(2 * h, {"q": attn.q_size, "k": attn.kv_size,
                                                 "v": attn.kv_size}, bias=dims.qkv_bias, **kw)
        self.mlp = LlamaMLP(dims, dtype, device)
        self.input_layernorm = RMSNorm(h, eps, **kw)
        self.hidden_norm = RMSNorm(h, eps, **kw)
        self.post_attention_layernorm = RMSNorm(h, eps, **kw)
        self.norm = RMSNorm(h, eps, **kw)
        self.lm_head = Linear(h, {"weight": draft_vocab_size}, bias=False, **kw)
        self.embed_tokens = VocabEmbedding(dims.vocab_size, h, **kw) if own_embedding else None
        # draft id -> target id (the checkpoint stores the offsets, d2t)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64,
                                                device=device))
        self.register_buffer("t2d", torch.ones(dims.vocab_size, dtype=torch.bool,
                                               device=device))
        self.target_ids: torch.Tensor | None = None  # by map_vocabulary
        self.ids_ascending = True  # target_ids in draft-id order are ascending

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``[n]`` ids, positions, features (``[n, 3 * target hidden]`` on the first
        pass, ``[n, hidden]`` after) -> the head's output before its final norm."""
        embeds = (self.embed_tokens(input_ids) if self.embed_tokens is not None
                  else self.target.embed_input_ids(input_ids))
        feature = hidden_states.to(embeds.dtype)
        if feature.shape[-1] != self.hidden_size:  # the target's fused layers
            feature = self.fc.forward(feature)
        x = torch.cat((_normed(self.input_layernorm, embeds),
                       _normed(self.hidden_norm, feature)), dim=-1)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        x = self.self_attn.forward(x, cos, sin, ctx.attn, ctx.kv_caches[0])
        x, residual = self.post_attention_layernorm.forward(x, feature)
        return self.mlp.forward(x) + residual

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> float32 logits over the target's vocabulary (ids outside
        the draft vocabulary get ``-inf``)."""
        draft = self.lm_head.forward(_normed(self.norm, hidden_states)).float()
        if self.target_ids is None:
            return draft.contiguous()
        out = draft.new_full((draft.shape[0], self.vocab_size), float("-inf"))
        out[:, self.target_ids] = draft
        return out

    def draft_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> float32 ``[n, draft vocab]`` logits (draft ids)."""
        return self.lm_head.forward(_normed(self.norm, hidden_states)).float()

    def draft_argmax(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> ``[n]`` target ids: the argmax over the draft vocabulary,
        mapped (:meth:`compute_logits`' argmax, without full-vocabulary logits; with
        ascending ``target_ids`` equal maxima go to the same, lowest id)."""
        if not self.ids_ascending:
            return self.compute_logits(hidden_states).argmax(dim=-1)
        ids = self.lm_head.forward(_normed(self.norm, hidden_states)).argmax(dim=-1)
        return ids if self.target_ids is None else self.target_ids[ids]

    def map_vocabulary(self) -> None:
        """After loading: the target id of each draft id (``None``: the same ids)."""
        ids = torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t
        same = len(ids) == self.vocab_size and bool(self.d2t.eq(0).all())
        if not same and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ModelLoadError(f"EAGLE-3 head d2t maps draft ids outside the target's "
                                 f"vocabulary [0, {self.vocab_size})")
        self.target_ids = None if same else ids
        self.ids_ascending = same or bool((ids[1:] > ids[:-1]).all())

    def weight_targets(self, names: set[str]) -> dict[str, Loader]:
        """EAGLE-3 checkpoint name -> how to load it (``d2t`` / ``t2d`` when present)."""
        targets: dict[str, Loader] = {}
        linear_targets(targets, self.fc, {"fc": "weight"})
        block_targets(targets, "midlayer", self.self_attn, self.mlp)
        for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            add_whole(targets, f"midlayer.{norm}.weight", getattr(self, norm).weight)
        add_whole(targets, "norm.weight", self.norm.weight)
        linear_targets(targets, self.lm_head, {"lm_head": "weight"})
        if self.embed_tokens is not None:
            add_whole(targets, "embed_tokens.weight", self.embed_tokens.weight)
        for buffer in ("d2t", "t2d"):
            if buffer in names:
                add_whole(targets, buffer, getattr(self, buffer))
        return targets


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _normed(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    out = norm.forward(x)
    assert isinstance(out, torch.Tensor)
    return out

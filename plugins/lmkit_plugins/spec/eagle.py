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

from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

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

from lmkit_plugins.models.layers import Linear, VocabEmbedding
from lmkit_plugins.models.llama import LlamaDecoderLayer, LlamaDims
from lmkit_plugins.models.rotary import RotaryEmbedding, rope_config_from_hf


class _NoNorm(nn.Module):
    """The first EAGLE layer's input norm: none."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class EagleProposer(RunnerProposer):
    """An EAGLE-1/2 head read from ``config.speculative.model``.

    Raises:
        ConfigError: no ``speculative.model`` set, or it is not a head directory.
    """

    def __init__(self, config: LMKitConfig, *, options: Any = None) -> None:
        from lmkit.api import check_weight_files, load_hf_config

        path = config.speculative.model
        if not path:
            raise ConfigError(
                "speculative proposer 'eagle' needs its draft head: set speculative.model "
                "(--speculative-model DIR) to a directory with config.json and *.safetensors")
        self.model_dir = Path(path).expanduser()
        if not (self.model_dir / "config.json").is_file():
            raise ConfigError(
                f"speculative.model {path!r} is not an EAGLE head directory: "
                f"{self.model_dir / 'config.json'} does not exist. Point --speculative-model "
                "at a local directory with the head's config.json and *.safetensors.")
        try:
            self.hf_config = load_hf_config(self.model_dir)
            self.dims = LlamaDims.from_hf(self.hf_config)
            self.shapes = _checkpoint_shapes(check_weight_files(self.model_dir))
        except (ModelLoadError, AttributeError, TypeError) as e:
            raise ConfigError(f"speculative.model {path!r}: cannot read the EAGLE head: {e}") from e
        self.num_kv_layers = self.dims.num_layers
        self.head: EagleHead | None = None

    def check_target(self, target_hf_config: Any) -> None:
        """Refuse a head whose feature size or vocabulary does not fit the target."""
        target = LlamaDims.from_hf(target_hf_config)
        hidden, problems = self.dims.hidden_size, []
        if hidden != target.hidden_size:
            problems.append(f"hidden_size {hidden} != the target's {target.hidden_size}")
        fc = self.shapes.get("fc.weight")
        if fc is None:
            problems.append("the checkpoint has no fc.weight (not an EAGLE-1/2 head; an "
                            "EAGLE-3 head is not built yet)")
        elif fc != (hidden, 2 * target.hidden_size):
            problems.append(f"fc.weight is {list(fc)}, expected [{hidden}, "
                            f"{2 * target.hidden_size}] (concat of embedding and target feature)")
        if self.dims.vocab_size != target.vocab_size:
            problems.append(f"vocab_size {self.dims.vocab_size} != the target's "
                            f"{target.vocab_size}")
        for name in ("embed_tokens.weight", "lm_head.weight"):
            shape = self.shapes.get(name)
            if shape is not None and shape != (target.vocab_size, hidden):
                problems.append(f"{name} is {list(shape)}, expected "
                                f"[{target.vocab_size}, {hidden}]")
        if problems:
            raise ConfigError(f"the EAGLE head at {self.model_dir} does not fit the target "
                              f"model: {'; '.join(problems)}")

    def load(self, ctx: DraftHeadContext) -> None:
        """Build the head (sharing what the checkpoint omits) and load its weights."""
        from lmkit.api import iterate_weights

        b = ctx.build
        d = self.dims
        self.attn = b.attention_cls(
            num_heads=d.num_heads, num_kv_heads=d.num_kv_heads, head_size=d.head_dim,
            scale=d.head_dim ** -0.5, dtype=b.dtype, device=b.device, block_size=b.block_size,
            sliding_window=None, options=b.attention_options)
        self.head = EagleHead(self.hf_config, d, ctx, own_embedding="embed_tokens.weight"
                              in self.shapes, own_lm_head="lm_head.weight" in self.shapes,
                              fc_bias="fc.bias" in self.shapes)
        self.head.load_weights(iterate_weights(self.model_dir))
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
        self.layers[0].input_layernorm = _NoNorm()
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

    @torch.no_grad()
    def load_weights(self, weights: Any) -> None:
        """Load EAGLE-named tensors into the fused projections.

        Raises:
            ModelLoadError: missing or unexpected tensors, or a shape mismatch.
        """
        targets = self._targets()
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            name = name.removeprefix("model.")
            load = targets.get(name)
            if load is None:
                if not name.endswith("rotary_emb.inv_freq"):
                    unexpected.append(name)
                continue
            try:
                load(tensor)
            except ValueError as e:
                raise ModelLoadError(f"EAGLE head weight {name}: {e}") from e
            loaded.add(name)
        missing = sorted(set(targets) - loaded)
        if missing or unexpected:
            raise ModelLoadError(
                "the EAGLE head checkpoint does not match its config.json: "
                + (f"missing {', '.join(missing[:8])}" if missing else "")
                + ("; " if missing and unexpected else "")
                + (f"unexpected {', '.join(unexpected[:8])}" if unexpected else ""))

    def _targets(self) -> dict[str, Callable[[torch.Tensor], None]]:
        targets: dict[str, Callable[[torch.Tensor], None]] = {}

        def part(linear: Linear, shard: str, kind: str) -> Callable[[torch.Tensor], None]:
            if kind == "bias":
                return lambda t: linear.load_shard(shard, bias=t)
            return lambda t: linear.load_shard(shard, weight=t)

        def whole(param: torch.Tensor) -> Callable[[torch.Tensor], None]:
            def load(t: torch.Tensor) -> None:
                if tuple(t.shape) != tuple(param.shape):
                    raise ValueError(f"shape {tuple(t.shape)} != {tuple(param.shape)}")
                param.copy_(t)
            return load

        def linear(prefix: str, lin: Linear, names: dict[str, str]) -> None:
            for hf, shard in names.items():
                targets[f"{prefix}.{hf}.weight"] = part(lin, shard, "weight")
                if lin.bias is not None:
                    targets[f"{prefix}.{hf}.bias"] = part(lin, shard, "bias")

        targets["fc.weight"] = part(self.fc, "weight", "weight")
        if self.fc.bias is not None:
            targets["fc.bias"] = part(self.fc, "weight", "bias")
        for i, layer in enumerate(cast(list[LlamaDecoderLayer], list(self.layers))):
            p = f"layers.{i}"
            attn, mlp = layer.self_attn, layer.mlp
            linear(f"{p}.self_attn", attn.qkv_proj, {"q_proj": "q", "k_proj": "k", "v_proj": "v"})
            linear(f"{p}.self_attn", attn.o_proj, {"o_proj": "weight"})
            linear(f"{p}.mlp", mlp.gate_up_proj, {"gate_proj": "gate", "up_proj": "up"})
            linear(f"{p}.mlp", mlp.down_proj, {"down_proj": "weight"})
            targets[f"{p}.post_attention_layernorm.weight"] = whole(
                layer.post_attention_layernorm.weight)
            if i > 0:
                targets[f"{p}.input_layernorm.weight"] = whole(layer.input_layernorm.weight)
        if self.embed_tokens is not None:
            targets["embed_tokens.weight"] = whole(self.embed_tokens.weight)
        if self.lm_head is not None:
            targets["lm_head.weight"] = part(self.lm_head, "weight", "weight")
        return targets


def _checkpoint_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Tensor name (``model.`` prefix dropped) -> shape, from the safetensors headers
    only (no tensor data is read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                shapes[name.removeprefix("model.")] = tuple(f.get_slice(name).get_shape())
    return shapes

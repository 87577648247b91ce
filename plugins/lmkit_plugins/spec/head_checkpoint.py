"""What the EAGLE draft heads (``eagle``, ``eagle3``) share: reading a head directory
(config and tensor shapes, no weights) and loading named tensors into fused layers."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from lmkit.api import ConfigError, LMKitConfig, ModelLoadError

from lmkit_plugins.models.layers import Linear, whole_weight_loader
from lmkit_plugins.models.llama_dims import LlamaDims
from lmkit_plugins.models.llama_layers import LlamaAttention, LlamaMLP

Loader = Callable[[torch.Tensor], None]

#: the tensors of one decoder block (``.weight`` left off)
BLOCK_TENSORS = tuple(f"self_attn.{p}_proj" for p in "qkvo") + tuple(
    f"mlp.{p}_proj" for p in ("gate", "up", "down"))


class HeadCheckpoint:
    """A draft head directory: ``config.json`` (a Llama config) and the shapes of its
    ``*.safetensors`` tensors (``model.`` prefixes dropped), read from the headers only.

    Raises:
        ConfigError: ``speculative.model`` unset, not a directory with ``config.json``,
            or unreadable.
    """

    def __init__(self, config: LMKitConfig, proposer: str) -> None:
        from lmkit.api import check_weight_files, load_hf_config

        path = config.speculative.model
        if not path:
            raise ConfigError(
                f"speculative proposer {proposer!r} needs its draft head: set "
                "speculative.model (--speculative-model DIR) to a directory with config.json "
                "and *.safetensors")
        self.model_dir = Path(path).expanduser()
        if not (self.model_dir / "config.json").is_file():
            raise ConfigError(
                f"speculative.model {path!r} is not an EAGLE head directory "
                f"(--speculative {proposer}): "
                f"{self.model_dir / 'config.json'} does not exist. Point --speculative-model "
                "at a local directory with the head's config.json and *.safetensors.")
        try:
            self.hf_config = load_hf_config(self.model_dir)
            self.dims = LlamaDims.from_hf(self.hf_config)
            self.shapes = checkpoint_shapes(check_weight_files(self.model_dir))
        except (ModelLoadError, AttributeError, TypeError) as e:
            raise ConfigError(
                f"speculative.model {path!r}: cannot read the {proposer} head: {e}") from e

    def shape_problem(self, name: str, expected: tuple[int, ...]) -> str | None:
        """Why tensor ``name`` does not have shape ``expected`` (``None`` when it does)."""
        shape = self.shapes.get(name)
        if shape is None:
            return f"the checkpoint has no {name}"
        if shape != expected:
            return f"{name} is {list(shape)}, expected {list(expected)}"
        return None

    def missing_problem(self, prefix: str, names: Iterable[str]) -> str | None:
        """Which of ``prefix`` + ``names`` (``.weight`` added) the checkpoint lacks, as a
        reason to refuse it before any weights load (``None`` when it has them all)."""
        missing = [f"{prefix}{n}.weight" for n in names
                   if f"{prefix}{n}.weight" not in self.shapes]
        if not missing:
            return None
        return (f"the checkpoint has no {', '.join(missing[:8])}"
                + (f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""))

    def weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The head's tensors (``model.`` prefixes dropped)."""
        from lmkit.api import iterate_weights

        return ((n.removeprefix("model."), t) for n, t in iterate_weights(self.model_dir))


def checkpoint_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Tensor name (``model.`` prefix dropped) -> shape, from the safetensors headers
    only (no tensor data is read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                shapes[name.removeprefix("model.")] = tuple(f.get_slice(name).get_shape())
    return shapes


def add_whole(targets: dict[str, Loader], name: str, param: torch.Tensor) -> None:
    """``name`` -> copied into ``param`` as it is (the shape checked)."""
    targets[name] = whole_weight_loader(param, name)


def linear_targets(targets: dict[str, Loader], linear: Linear, names: dict[str, str]) -> None:
    """``{name}.weight`` (and ``{name}.bias``) -> shard ``names[name]`` of ``linear``."""
    for name, shard in names.items():
        targets[f"{name}.weight"] = (
            lambda t, s=shard: linear.load_shard(s, weight=t))  # type: ignore[misc]
        if linear.bias is not None:
            targets[f"{name}.bias"] = (
                lambda t, s=shard: linear.load_shard(s, bias=t))  # type: ignore[misc]


def block_targets(targets: dict[str, Loader], prefix: str, attn: LlamaAttention,
                  mlp: LlamaMLP) -> None:
    """The attention and MLP projections of one decoder block under ``prefix``."""
    a, m = f"{prefix}.self_attn", f"{prefix}.mlp"
    linear_targets(targets, attn.qkv_proj,
                   {f"{a}.q_proj": "q", f"{a}.k_proj": "k", f"{a}.v_proj": "v"})
    linear_targets(targets, attn.o_proj, {f"{a}.o_proj": "weight"})
    linear_targets(targets, mlp.gate_up_proj, {f"{m}.gate_proj": "gate", f"{m}.up_proj": "up"})
    linear_targets(targets, mlp.down_proj, {f"{m}.down_proj": "weight"})


def load_named(targets: dict[str, Loader], weights: Iterable[tuple[str, torch.Tensor]],
               what: str) -> None:
    """Load every tensor of ``weights`` through ``targets``.

    Raises:
        ModelLoadError: missing or unexpected tensors, or a shape mismatch.
    """
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        load = targets.get(name)
        if load is None:
            if not name.endswith("rotary_emb.inv_freq"):
                unexpected.append(name)
            continue
        try:
            load(tensor)
        except ValueError as e:
            raise ModelLoadError(f"{what} weight {name}: {e}") from e
        loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing or unexpected:
        raise ModelLoadError(
            f"the {what} checkpoint does not match its config.json: "
            + (f"missing {', '.join(missing[:8])}" if missing else "")
            + ("; " if missing and unexpected else "")
            + (f"unexpected {', '.join(unexpected[:8])}" if unexpected else ""))


def build_attention(dims: LlamaDims, build: Any) -> Any:
    """The head's own attention backend (its KV cache uses the target's block size)."""
    return build.attention_cls(
        num_heads=dims.num_heads, num_kv_heads=dims.num_kv_heads, head_size=dims.head_dim,
        scale=dims.head_dim ** -0.5, dtype=build.dtype, device=build.device,
        block_size=build.block_size, sliding_window=None, options=build.attention_options,
        kv_cache_dtype=build.kv_cache_dtype)

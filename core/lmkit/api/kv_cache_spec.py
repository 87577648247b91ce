"""KV cache specs: what each attention layer keeps per token, and the groups of layers
that keep the same thing.

A model's layers need not all cache the same way: a hybrid model interleaves
sliding-window layers with full-attention ones, an MLA model caches one latent vector
per token. Each layer has a :class:`KVCacheSpec`; layers with equal specs form a
:class:`KVCacheGroup`, which has its own attention backend instance (built for that
spec, e.g. with its window) and its own per-layer cache tensors. The runner plans every
group's backend once per step; memory is counted per group (:attr:`KVCacheGroup.page_bytes`
times its layers).

A model that declares nothing is one group: every layer has the spec of its one
backend ``model.attn`` (:func:`spec_of_backend`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from lmkit.api.mla_attention import MHA, MLA, MLAAttentionBackend

if TYPE_CHECKING:
    from lmkit.api.attention import AttentionBackend
    from lmkit.plugin_host.spec import Needs


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """What one attention layer caches per token. Subclasses are the kinds; equal specs
    (same kind, same fields) share a :class:`KVCacheGroup`."""

    #: the kind's name, in messages and docs
    kind: ClassVar[str] = "kv_cache"

    def needs(self) -> Needs:
        """What an attention backend must declare to serve layers of this spec: stack
        resolution refuses a backend that lacks it, before weights load."""
        from lmkit.plugin_host.spec import Needs

        return Needs(values={"attention_kind": MHA})

    def describe(self) -> str:
        """The spec in a message: ``sliding_window(window=4096)``."""
        return self.kind


@dataclass(frozen=True, slots=True)
class FullAttentionSpec(KVCacheSpec):
    """Keys and values of every token of the context (causal full attention)."""

    kind: ClassVar[str] = "full_attention"


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec(KVCacheSpec):
    """Keys and values for attention over the last ``window`` tokens only (a query at
    position ``p`` sees keys at positions ``> p - window``); served by backends that
    declare the ``sliding_window`` feature."""

    kind: ClassVar[str] = "sliding_window"
    window: int = 0

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"a sliding window must be at least 1 token, got {self.window}")

    def needs(self) -> Needs:
        from lmkit.plugin_host.spec import Needs

        return Needs(features=frozenset({"sliding_window"}), values={"attention_kind": MHA})

    def describe(self) -> str:
        return f"{self.kind}(window={self.window})"


@dataclass(frozen=True, slots=True)
class MLALatentSpec(KVCacheSpec):
    """One latent vector of ``latent_size`` (``kv_lora_rank + qk_rope_head_dim``) per
    token, for multi-head latent attention; served by backends whose caps declare
    ``attention_kind`` ``"mla"`` (:class:`~lmkit.api.MLAAttentionBackend`)."""

    kind: ClassVar[str] = "mla_latent"
    latent_size: int = 0

    def needs(self) -> Needs:
        from lmkit.plugin_host.spec import Needs

        return Needs(values={"attention_kind": MLA})

    def describe(self) -> str:
        return f"{self.kind}(latent_size={self.latent_size})"


def spec_of_backend(attn: AttentionBackend) -> KVCacheSpec:
    """The spec a built backend serves: MLA latent for an
    :class:`~lmkit.api.MLAAttentionBackend`, sliding window when built with a window,
    else full attention."""
    if isinstance(attn, MLAAttentionBackend):
        return MLALatentSpec(latent_size=attn.kv_lora_rank + attn.qk_rope_head_dim)
    if attn.sliding_window:
        return SlidingWindowSpec(window=int(attn.sliding_window))
    return FullAttentionSpec()


def specs_needs(specs: Sequence[KVCacheSpec]) -> Needs:
    """What a backend needs to serve every one of ``specs`` (all of a model's groups).

    :raises ValueError: the specs need different ``attention_kind`` values (one backend
        cannot serve both an MLA latent layer and a multi-head one).
    """
    from lmkit.plugin_host.spec import Needs

    needs = Needs()
    for spec in dict.fromkeys(specs):
        wanted = spec.needs()
        for key, value in wanted.values.items():
            if key in needs.values and needs.values[key] != value:
                raise ValueError(
                    f"the model's layers need attention backends of {key} "
                    f"{needs.values[key]!r} and {value!r}; lmkit serves one backend kind "
                    "per model")
        needs = needs.merge(wanted)
    return needs


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers with equal :class:`KVCacheSpec`, the backend instance built for it, and
    (by the runner) their cache tensors shaped ``attn.kv_cache_shape(num_blocks)``.

    Attributes:
        spec: what every layer of the group caches per token.
        layers: the model's layer indices in this group, ascending.
        attn: the group's attention backend (planned once per step by the runner).
    """

    spec: KVCacheSpec
    layers: tuple[int, ...]
    attn: AttentionBackend

    @property
    def page_bytes(self) -> int:
        """Bytes of one KV block of one layer: the backend's ``kv_cache_shape(1)`` in its
        KV cache dtype (``attn.kv_cache_dtype``: one byte per value in FP8)."""
        return math.prod(self.attn.kv_cache_shape(1)) * self.attn.kv_cache_dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one KV block over all the group's layers."""
        return self.page_bytes * len(self.layers)


def kv_window(groups: Sequence[KVCacheGroup]) -> int | None:
    """How many of the latest keys the layers of ``groups`` read at most: the widest
    window when every group is a :class:`SlidingWindowSpec`, else ``None`` (some layer
    reads the whole context). Blocks wholly behind it are never read again."""
    windows = [g.spec.window if isinstance(g.spec, SlidingWindowSpec) else None
               for g in groups]
    if not windows or None in windows:
        return None
    return max(w for w in windows if w is not None)


def one_kv_cache_group(attn: AttentionBackend, num_layers: int) -> tuple[KVCacheGroup]:
    """All ``num_layers`` layers on one backend: the groups of a model (or draft head)
    whose layers all cache alike."""
    return (KVCacheGroup(spec_of_backend(attn), tuple(range(num_layers)), attn),)


def build_kv_cache_groups(specs: Sequence[KVCacheSpec],
                          make_backend: Callable[[KVCacheSpec], AttentionBackend]
                          ) -> tuple[KVCacheGroup, ...]:
    """Group the layers by equal spec (in order of each spec's first layer) and build
    one backend per group with ``make_backend(spec)``; what a model with several kinds
    of layers calls in its constructor (and returns from
    :meth:`~lmkit.api.Model.kv_cache_groups`)."""
    layers: dict[KVCacheSpec, list[int]] = {}
    for i, spec in enumerate(specs):
        layers.setdefault(spec, []).append(i)
    return tuple(KVCacheGroup(spec, tuple(ids), make_backend(spec))
                 for spec, ids in layers.items())


def check_kv_cache_groups(groups: Sequence[KVCacheGroup], num_layers: int) -> None:
    """Check that ``groups`` cover each of ``num_layers`` layers exactly once and that
    each backend serves its group's spec.

    :raises ValueError: naming the layer or group that is wrong (a model bug).
    """
    seen: dict[int, int] = {}
    for g, group in enumerate(groups):
        for layer in group.layers:
            if layer in seen or not 0 <= layer < num_layers:
                raise ValueError(
                    f"KV cache group {g} ({group.spec.describe()}) lists layer {layer}, "
                    f"which is {'in group ' + str(seen[layer]) if layer in seen else 'out of range'}"
                    f"; the groups must cover layers 0..{num_layers - 1} once each")
            seen[layer] = g
        served = spec_of_backend(group.attn)
        if served != group.spec:
            raise ValueError(
                f"KV cache group {g} is {group.spec.describe()} but its backend "
                f"{type(group.attn).__name__} was built for {served.describe()}")
    missing = sorted(set(range(num_layers)) - set(seen))
    if missing:
        raise ValueError(f"layers {missing} are in no KV cache group; the groups must "
                         f"cover layers 0..{num_layers - 1} once each")

"""The read-only view of a running engine core that lifecycle hooks receive."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmkit.api.executor import ModelInfo
    from lmkit.api.model_facts import ModelFacts
    from lmkit.config.schema import LMKitConfig
    from lmkit.plugin_host.resolve import ResolvedStack


class EngineView:
    """What a plugin may see of the engine core in ``engine_started``, ``engine_step``
    and ``engine_stopped``: the resolved stack, the runtime configuration, facts about
    the loaded model and the engine's counters. Nothing here can change the engine:
    attributes cannot be set, and the engine core itself is not reachable.

    Attributes:
        stack: the resolved plugin stack (chosen names and options).
        config: a copy of the engine's runtime configuration (``model.max_model_len``
            filled in); changing it changes nothing in the engine.
        facts: the model's facts (architecture, context length, EOS ids, vocabulary).
        model_info: what the executor measured (KV bytes per block, device, dtype).
        num_blocks: the KV pool size in blocks.
    """

    __slots__ = ("_stack", "_config", "_facts", "_model_info", "_num_blocks", "_stats")
    _stack: ResolvedStack
    _config: LMKitConfig
    _facts: ModelFacts
    _model_info: ModelInfo
    _num_blocks: int
    _stats: Callable[[], dict[str, Any]]

    def __init__(self, stack: ResolvedStack, config: LMKitConfig, facts: ModelFacts,
                 model_info: ModelInfo, num_blocks: int,
                 stats: Callable[[], dict[str, Any]]) -> None:
        object.__setattr__(self, "_stack", stack)
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_facts", facts)
        object.__setattr__(self, "_model_info", model_info)
        object.__setattr__(self, "_num_blocks", num_blocks)
        object.__setattr__(self, "_stats", stats)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"EngineView is read-only: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"EngineView is read-only: cannot delete {name!r}")

    @property
    def stack(self) -> ResolvedStack:
        """The resolved plugin stack."""
        return self._stack

    @property
    def config(self) -> LMKitConfig:
        """A copy of the engine's runtime configuration."""
        return self._config

    @property
    def facts(self) -> ModelFacts:
        """The model's facts (frozen)."""
        return self._facts

    @property
    def model_info(self) -> ModelInfo:
        """Facts about the loaded model (frozen)."""
        return self._model_info

    @property
    def num_blocks(self) -> int:
        """The KV pool size in blocks."""
        return self._num_blocks

    def stats(self) -> dict[str, Any]:
        """A fresh copy of the engine's counters (``EngineCore.stats()``)."""
        return dict(self._stats())

    def __repr__(self) -> str:
        return (f"EngineView(model={self._facts.architecture!r}, "
                f"num_blocks={self._num_blocks})")

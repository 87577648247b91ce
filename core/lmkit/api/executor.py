"""The Executor contract: start model workers and drive them one step at a time."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmkit.api.runner_output import ModelRunnerOutput
    from lmkit.api.scheduler_output import SchedulerOutput


@dataclass(frozen=True)
class ModelInfo:
    """What the executor measured once the model is loaded (what the engine knows
    before, the architecture, vocabulary, context length, layers, is in
    :class:`~lmkit.api.ModelFacts`)."""

    kv_bytes_per_block: int  # all layers, K and V
    available_kv_bytes: int  # memory the KV cache may use on this device
    device: str
    dtype: str
    # KV slots per request the scheduler must reserve past the scheduled tokens because
    # the runner launches decode steps ahead of scheduling (0 when it does not)
    num_lookahead_slots: int = 0


class Executor(ABC):
    """Runs the model for the engine core.

    Constructor (the one signature the engine uses)::

        cls(config, stack, *, options, host, facts)

    ``config`` is the engine's runtime :class:`~lmkit.api.LMKitConfig`, ``stack`` the
    resolved :class:`~lmkit.plugin_host.resolve.ResolvedStack` (chosen names and
    options; a worker in another process resolves the names in its own plugin
    manager), ``options`` the validated instance of the spec's options model, ``host``
    the engine's :class:`~lmkit.api.PluginHost` (model architectures), ``facts`` the
    engine's :class:`~lmkit.api.ModelFacts` (context length, EOS ids, architecture),
    which the workers' model runners use instead of deriving their own.
    """

    @abstractmethod
    def start(self) -> ModelInfo:
        """Start workers, load weights, profile memory; return what they measured."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV blocks on every worker."""

    @abstractmethod
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step's forward and sampling."""

    @abstractmethod
    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every worker's model runner; one result per worker."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop workers and release their memory. Safe to call twice."""

"""The Executor contract: start model workers and drive them one step at a time."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

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
    # how many of the latest keys any attention layer reads when every layer (a draft
    # head's too) slides over a window; None when a layer reads the whole context
    kv_window: int | None = None


def across_ranks(infos: Sequence[ModelInfo]) -> ModelInfo:
    """The first rank's :class:`ModelInfo` with the KV budget every rank can hold: each
    rank allocates the same number of blocks, of its own size (a rank with fewer KV
    heads has smaller blocks), so the budget is the smallest ``available / per block``
    over the ranks, given in the first rank's block size."""
    first = infos[0]
    blocks = min(i.available_kv_bytes // i.kv_bytes_per_block for i in infos)
    return dataclasses.replace(first, available_kv_bytes=blocks * first.kv_bytes_per_block)


class Executor(ABC):
    """Runs the model for the engine core.

    Constructor (the one signature the engine uses)::

        cls(config, stack, *, options, host, facts)

    * ``config``: the engine's runtime :class:`~lmkit.config.LMKitConfig`;
      ``config.model.model`` is a local model directory (the engine resolves aliases
      and hub ids before this point);
    * ``stack``: the resolved :class:`~lmkit.plugin_host.resolve.ResolvedStack` (chosen
      names and options; a worker in another process resolves the names in its own
      plugin manager);
    * ``options``: the validated options of the executor plugin (or None);
    * ``host``: the engine's :class:`~lmkit.plugin_host.manager.PluginHost` (model
      architectures, attention backends, offload tiers), or None to load one from
      ``config.plugins``;
    * ``facts``: the engine's :class:`~lmkit.api.ModelFacts` (context length, EOS ids,
      architecture), which the workers' model runners use instead of deriving their own.

    The KV offload tier lives with the device caches, in the workers; the engine core
    reaches it only through :meth:`offload_lookup`, :meth:`offload_stats` and
    :meth:`close_offload`, whose defaults serve an executor without offload.
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
    def shutdown(self) -> None:
        """Stop workers and release their memory. Safe to call twice."""

    def check_health(self) -> None:  # noqa: B027 - optional
        """Raise if the executor can no longer run steps (a worker process died while
        nothing ran), without waiting on the workers. The engine-core process calls it
        about once a second while idle, so that a dead worker is reported before the
        next request arrives. Default: nothing to check (plugin API 1.5)."""

    def offload_lookup(self, block_hashes: Sequence[bytes]) -> tuple[int, int]:
        """``(held, resident)``: how many leading blocks of ``block_hashes`` the KV
        offload tier holds, and how many of those it can load in the step that reads
        them. With several workers, the smallest answers (a block counts only when
        every worker holds its share). Default: ``(0, 0)``, no tier."""
        return 0, 0

    def offload_stats(self) -> dict[str, int]:
        """The offload tier's counters, summed over workers. Default: none."""
        return {}

    def close_offload(self) -> None:  # noqa: B027 - optional
        """Close the offload tier on every worker (pending disk writes finish). Called
        once at engine shutdown, before :meth:`shutdown`. Default: nothing to close."""

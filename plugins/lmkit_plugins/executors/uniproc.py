"""The ``uniproc`` executor: one model runner in the engine-core process.

A step that raises is fatal, as with the other executors
(:mod:`lmkit_plugins.executors.failure`): the runner's state is undefined after it, so
the call raises :class:`~lmkit_plugins.executors.failure.WorkerFailedError` (the
original error chained) and so does every later step.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmkit.api import (
    Executor,
    LMKitConfig,
    ModelFacts,
    ModelInfo,
    ModelRunnerOutput,
    PluginHost,
    ResolvedStack,
    SchedulerOutput,
)

from lmkit_plugins.executors.failure import WorkerFailedError


class UniProcExecutor(Executor):
    """Runs a single :class:`~lmkit.api.ModelRunner` in this process, on this device.

    Args:
        config: the engine's configuration; ``config.model.model`` is a local model
            directory (the engine resolves aliases and hub ids before this point).
        stack: the resolved stack (device, dtype, attention backend).
        options: this executor's options (it takes none).
        host: the plugin host to find model architectures in; loaded from
            ``config.plugins`` when not given.
        facts: the engine's facts about the model; derived from ``config`` (with
            :func:`lmkit.api.load_model_facts`) when not given.
    """

    def __init__(self, config: LMKitConfig, stack: ResolvedStack, *, options: Any = None,
                 host: PluginHost | None = None, facts: ModelFacts | None = None) -> None:
        self.config = config
        self.stack = stack
        self.options = options
        self.host = host if host is not None else PluginHost.load(config.plugins)
        self.facts = facts
        self.runner: Any = None
        self._failed: str | None = None

    def start(self) -> ModelInfo:
        """Load the model and measure memory; return what the engine needs to know."""
        from lmkit.api import ModelRunner, load_model_facts

        if self.facts is None:
            self.facts = load_model_facts(Path(self.config.model.model), self.host,
                                          self.config.model.max_model_len)
        runner = ModelRunner(self.config, self.stack, self.host, self.facts)
        runner.load_model()
        self.runner = runner
        return ModelInfo(
            kv_bytes_per_block=runner.kv_bytes_per_block(),
            available_kv_bytes=runner.available_kv_bytes(),
            device=str(runner.device),
            dtype=self.stack.dtype,
            num_lookahead_slots=runner.num_lookahead_slots,
            kv_window=runner.kv_window(),
        )

    def _require_runner(self) -> Any:
        if self.runner is None:
            raise RuntimeError("UniProcExecutor.start() must be called first")
        return self.runner

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV blocks."""
        self._require_runner().initialize_kv_cache(num_blocks)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step's forward and sampling.

        :raises WorkerFailedError: the model runner raised (in this step or before).
        """
        if self._failed is not None:
            raise WorkerFailedError(self._failed)
        runner = self._require_runner()
        try:
            return runner.execute_model(scheduler_output)
        except Exception as e:
            self._failed = (f"the model runner failed in a step: {type(e).__name__}: {e}; "
                            "its state is undefined, so this engine cannot go on (start a "
                            "new one; lmkit serve does so on its own)")
            raise WorkerFailedError(self._failed) from e

    def offload_lookup(self, block_hashes: Sequence[bytes]) -> tuple[int, int]:
        """The runner's answer (one worker: nothing to combine)."""
        return self._require_runner().offload_lookup(block_hashes)

    def offload_stats(self) -> dict[str, int]:
        """The runner's offload counters."""
        return self._require_runner().offload_stats()

    def close_offload(self) -> None:
        """Close the runner's offload tier; nothing once shut down."""
        if self.runner is not None:
            self.runner.close_offload()

    def shutdown(self) -> None:
        """Release the model, the KV cache and the graphs (:meth:`ModelRunner.release`),
        and return their device memory. Safe to call twice."""
        runner, self.runner = self.runner, None
        if runner is None:
            return
        cuda = runner.device.type == "cuda"
        runner.release()
        del runner  # before collecting: the runner must not outlive this call
        import gc

        gc.collect()  # reference cycles (modules, graphs) would hold device memory
        if cuda:
            import torch

            torch.cuda.empty_cache()

"""The engine core: one busy loop of schedule -> execute -> update.

It owns the scheduler and the executor; it knows nothing about text. Frontends
(``LLM`` in-process, the API server over ZMQ) feed it validated :class:`Request` objects
and turn its :class:`EngineCoreOutput` s into text.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lmkit.api.outputs import EngineCoreOutput
from lmkit.api.request import Request, RequestStatus
from lmkit.config.schema import LMKitConfig
from lmkit.errors import ConfigError, InvalidRequestError
from lmkit.offload.attach import attach_offload
from lmkit.plugin_host.manager import PluginHost
from lmkit.plugin_host.resolve import ResolvedStack, resolve_stack
from lmkit.spec_decode.manager import ProposerManager
from lmkit.structured.manager import StructuredOutputManager, structured_output_off_error

logger = logging.getLogger(__name__)


class EngineCore:
    """Requests in, tokens out.

    Construction resolves the model files and the plugin stack (cross-checked before any
    weights load), starts the executor, sizes the KV pool from the memory the executor
    reports, and builds the scheduler.
    """

    def __init__(self, config: LMKitConfig, host: PluginHost | None = None,
                 progress: bool = True) -> None:
        from lmkit.loading.model_facts import load_model_facts
        from lmkit.loading.resolve import resolve_model

        self.host = host or PluginHost.load(config.plugins)
        self.host.hook.configure(config=config)
        cache_dir = Path(config.model.cache_dir) if config.model.cache_dir else None
        self.model_dir: Path = resolve_model(config.model.model, self.host, cache_dir,
                                             source=config.model.source, progress=progress)
        # what every process knows of the model (context, EOS, architecture, needs): once
        self.facts = load_model_facts(self.model_dir, self.host, config.model.max_model_len)
        self.stack: ResolvedStack = resolve_stack(config, self.host, self.facts.attention_needs)
        self.config = self._runtime_config(config)

        executor_reg = self.stack.get("executor")
        assert executor_reg is not None
        self.executor = executor_reg.spec.load()(
            self.config, self.stack, options=self.stack.options["executor"], host=self.host,
            facts=self.facts)
        try:
            self.model_info = self.executor.start()
            self.num_blocks = self._num_blocks()
            self.executor.initialize_kv_cache(self.num_blocks)
            sched_reg = self.stack.get("scheduler")
            assert sched_reg is not None
            self.scheduler = sched_reg.spec.load()(
                self.config, num_blocks=self.num_blocks, options=self.stack.options["scheduler"])
            self.offload = attach_offload(
                self.stack, self.scheduler, self.executor,
                write_through=self.config.offload.store_policy == "write_through")
            self._reserve_decode_lookahead_slots()
            self.structured_output = StructuredOutputManager.from_stack(
                self.config, self.stack, self.model_dir, self.facts.vocab_size)
            self.spec_decode = ProposerManager.from_stack(self.config, self.stack,
                                                          self.facts.vocab_size)
        except BaseException:
            self.executor.shutdown()
            raise
        self._step_hooked = bool(self.host.hook.engine_step.get_hookimpls())
        self._num_steps = 0
        self._num_scheduled_tokens = 0
        self._started = time.monotonic()
        self._closed = False
        self.host.hook.engine_started(engine=self)

    # ------------------------------------------------------------------ setup

    def _runtime_config(self, config: LMKitConfig) -> LMKitConfig:
        """A copy of ``config`` with the model directory and context length filled in."""
        max_len = self.facts.max_model_len
        cfg = config.model_copy(deep=True)
        cfg.model.model = str(self.model_dir)
        cfg.model.max_model_len = max_len
        cfg.scheduler.max_num_batched_tokens = max(
            cfg.scheduler.max_num_batched_tokens,
            1 if cfg.scheduler.enable_chunked_prefill else max_len)
        return cfg

    def _num_blocks(self) -> int:
        info = self.model_info
        cfg = self.config
        if cfg.cache.num_blocks is not None:
            num_blocks = cfg.cache.num_blocks
        else:
            num_blocks = info.available_kv_bytes // info.kv_bytes_per_block
        block_size = cfg.cache.block_size
        # one request of max_model_len tokens, plus block 0 (the scheduler's null block)
        need = -(-int(cfg.model.max_model_len or 1) // block_size) + 1
        if num_blocks < need:
            raise ConfigError(
                f"the KV cache holds {num_blocks} blocks of {block_size} tokens "
                f"({num_blocks * block_size} tokens), fewer than one request of "
                f"max_model_len={cfg.model.max_model_len} needs ({need} blocks). Give it more "
                "memory (cache.kv_cache_memory_gb / cache.gpu_memory_utilization / "
                "cache.num_blocks) or lower model.max_model_len.")
        logger.info("KV cache: %d blocks x %d tokens (%.2f GiB)", num_blocks, block_size,
                    num_blocks * info.kv_bytes_per_block / 2**30)
        return int(num_blocks)

    def _reserve_decode_lookahead_slots(self) -> None:
        """With CUDA graphs the runner launches each decode step before it is scheduled
        (lmkit.worker.gpu_lookahead); the scheduler then keeps one more KV slot per request."""
        slots = self.model_info.num_lookahead_slots
        current = getattr(self.scheduler, "num_lookahead_tokens", None)
        if slots and isinstance(current, int) and current < slots:
            self.scheduler.num_lookahead_tokens = slots

    # ------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        """Queue a validated request (see :class:`~lmkit.frontend.processor.InputProcessor`).
        A constrained request waits for its grammar outside the scheduler; if the grammar
        fails to compile it is refused later (:meth:`take_rejected_requests`)."""
        if request.sampling_params.structured_outputs is not None:
            if self.structured_output is None:
                raise structured_output_off_error(self.config)
            self.structured_output.add_request(request)
            return
        self.scheduler.add_request(request)
        if self.spec_decode is not None:
            self.spec_decode.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort requests; unknown or finished ids are ignored."""
        ids = list(request_ids)
        if ids:
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            if self.structured_output is not None:
                self.structured_output.abort(ids)
            if self.spec_decode is not None:
                self.spec_decode.remove_requests(ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or (
            self.structured_output is not None and self.structured_output.has_pending())

    def take_rejected_requests(self) -> list[tuple[str, InvalidRequestError]]:
        """``(request id, error)`` of requests refused after :meth:`add_request` took them
        (a constraint that did not compile, or not in time); they produce no output."""
        return self.structured_output.take_rejected() if self.structured_output else []

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[EngineCoreOutput]:
        """Run one engine step; returns outputs of requests that advanced or finished."""
        if self._step_hooked:
            return self.host.hook.engine_step.call_extra([self._step], {"engine": self})
        return self._step(self)

    def _step(self, engine: EngineCore) -> list[EngineCoreOutput]:
        grammars = self.structured_output
        if grammars is not None:  # constrained requests whose grammar is ready join
            admitted = grammars.admit(self.scheduler,
                                      idle=not self.scheduler.has_unfinished_requests())
            if self.spec_decode is not None:
                for request in admitted:
                    self.spec_decode.add_request(request)
        scheduler_output = self.scheduler.schedule()
        if grammars is not None:
            grammars.fill_bitmask(scheduler_output)
        if self.spec_decode is not None:
            self.spec_decode.before_execute(scheduler_output)
        runner_output = self.executor.execute(scheduler_output)
        self._num_steps += 1
        self._num_scheduled_tokens += scheduler_output.total_num_scheduled_tokens
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if grammars is not None:  # accepted tokens advance grammars; terminated ones end
            grammars.advance(outputs, self.scheduler)
        if self.spec_decode is not None:  # drafts for the next step
            self.spec_decode.after_step(scheduler_output, runner_output, outputs)
            if grammars is not None:  # only drafts the grammars allow
                grammars.trim_draft_tokens()
        return outputs

    def stats(self) -> dict[str, Any]:
        """Scheduler and cache counters plus engine-level facts, for metrics."""
        stats = dict(self.scheduler.get_stats())
        stats.update(num_steps=self._num_steps, num_blocks=self.num_blocks,
                     num_scheduled_tokens=self._num_scheduled_tokens,
                     uptime_s=time.monotonic() - self._started)
        if self.offload is not None:
            stats.update(self.offload.stats())
        if self.spec_decode is not None:
            stats.update(self.spec_decode.get_stats())
        if self.structured_output is not None:
            stats.update(self.structured_output.stats())
        return stats

    def shutdown(self) -> None:
        """Stop the executor; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self.structured_output is not None:
            self.structured_output.shutdown()
        try:
            if self.offload is not None:
                self.offload.close()  # finishes pending disk writes; never raises
            self.executor.shutdown()
        finally:
            self.host.hook.engine_stopped(engine=self)

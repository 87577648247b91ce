"""The engine core: one busy loop of schedule -> execute -> update.

Features (structured output, speculative decoding, KV offload) are
:class:`~lmkit.engine.phases.StepPhase` s built once at construction; the step runs
them before scheduling, after scheduling and after the model's output.

It owns the scheduler and the executor; it knows nothing about text. Frontends
(``LLM`` in-process, the API server over ZMQ) feed it validated :class:`Request` objects
and turn its :class:`EngineCoreOutput` s into text.

Plugin faults at run time: a feature's plugin (proposer, grammar) that fails some
requests has them ended with an error naming it, and the engine goes on
(:meth:`StepPhase.take_failed <lmkit.engine.phases.StepPhase.take_failed>`); a
scheduler plugin that raises or plans a step the runner cannot run
(:class:`~lmkit.engine.plan_check.PlanCheck`) leaves state nobody can trust, so the
engine stops: this call and every later one raise :class:`~lmkit.errors.EngineDeadError`
naming the scheduler and what it did.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NoReturn

from lmkit.api.contract import build
from lmkit.api.engine_view import EngineView
from lmkit.api.outputs import EngineCoreOutput
from lmkit.api.request import Request, RequestStatus
from lmkit.api.scheduler import SchedulerContext
from lmkit.config.parallel import check_model_split
from lmkit.config.schema import LMKitConfig
from lmkit.engine.gc_heap import freeze_startup_heap, unfreeze_heap
from lmkit.engine.phases import StepPhase, StepPhases
from lmkit.engine.plan_check import PlanCheck
from lmkit.engine.pooling_phase import PoolingPhase, sentence_transformers_pooler
from lmkit.engine.step_trace import StepTracePhase
from lmkit.errors import ConfigError, EngineDeadError, InvalidRequestError, LMKitError
from lmkit.offload.attach import OffloadPhase, prefix_tier
from lmkit.plugin_host.faults import raised_in, registration_label
from lmkit.plugin_host.manager import PluginHost
from lmkit.plugin_host.resolve import ResolvedStack, resolve_stack
from lmkit.sample.processors import check_request
from lmkit.spec_decode.manager import ProposerManager, check_runner_hosted
from lmkit.structured.manager import StructuredOutputManager
from lmkit.structured.rows import TrimDrafts

logger = logging.getLogger(__name__)


class EngineCore:
    """Requests in, tokens out.

    Construction resolves the model files (with ``require_tokenizer``, as the frontends
    that load one pass, a model without tokenizer files is refused there) and the plugin
    stack (cross-checked before any weights load), starts the executor, sizes the KV pool from the memory the executor
    reports, builds the scheduler (with its :class:`~lmkit.api.SchedulerContext`) and
    the feature phases, then freezes the startup heap out of the garbage collector's
    full collections (:mod:`lmkit.engine.gc_heap`).
    """

    def __init__(self, config: LMKitConfig, host: PluginHost | None = None,
                 progress: bool = True, require_tokenizer: bool = False) -> None:
        from lmkit.loading.model_facts import load_model_facts
        from lmkit.loading.resolve import resolve_model
        from lmkit.loading.tokenizer import tokenizer_files

        self.host = host or PluginHost.load(config.plugins)
        self.host.hook.configure(config=config)
        cache_dir = Path(config.model.cache_dir) if config.model.cache_dir else None
        self.model_dir: Path = resolve_model(config.model.model, self.host, cache_dir,
                                             source=config.model.source, progress=progress,
                                             weights=config.model.load_format != "dummy")
        if require_tokenizer:  # a frontend that will load it: refused before any weight
            tokenizer_files(self.model_dir, config.model.tokenizer)
        # what every process knows of the model (context, EOS, architecture, needs): once
        self.facts = load_model_facts(self.model_dir, self.host, config.model.max_model_len,
                                      tokenizer=config.model.tokenizer)
        check_model_split(config, self.facts)
        self.stack: ResolvedStack = resolve_stack(config, self.host, self.facts.attention_needs,
                                                  weight_format=self.facts.weight_format,
                                                  encoder=not self.facts.pooling.causal)
        check_runner_hosted(config, self.stack)
        self.config = self._runtime_config(config)
        self.dead_reason: str | None = None  # set when a scheduler fault stopped the engine

        executor_reg = self.stack.get("executor")
        assert executor_reg is not None
        self.executor = build("executor", executor_reg.spec.load(), self.config, self.stack,
                              options=self.stack.options["executor"], host=self.host,
                              facts=self.facts, plugin=executor_reg.origin)
        try:
            self.model_info = self.executor.start()
            self.num_blocks = self._num_blocks()
            self.executor.initialize_kv_cache(self.num_blocks)
            self.phases = self._build_scheduler_and_phases()
        except BaseException:
            self.executor.shutdown()
            raise
        self._step_hooked = bool(self.host.hook.engine_step.get_hookimpls())
        self._num_steps = 0
        self._num_scheduled_tokens = 0
        self._started = time.monotonic()
        self._closed = False
        # plugins see a copy of the configuration: changing it changes nothing here
        self.view = EngineView(self.stack, self.config.model_copy(deep=True), self.facts,
                               self.model_info, self.num_blocks, self.stats)
        self.host.hook.engine_started(engine=self.view)
        # startup's objects out of later full collections (a mid-run stall otherwise)
        self._gc_frozen = freeze_startup_heap()

    # ------------------------------------------------------------------ setup

    def _build_scheduler_and_phases(self) -> StepPhases:
        """The scheduler, given the lookahead slots and the offload tier it consults,
        then the features in the order they run at each phase: grammars advance before
        the proposer drafts (it must see requests a grammar ended), and drafts are cut
        to what the grammars allow after it."""
        sched_reg = self.stack.get("scheduler")
        assert sched_reg is not None
        scheduler_cls = sched_reg.spec.load()
        tier = prefix_tier(self.stack, scheduler_cls, self.executor,
                           write_through=self.config.offload.store_policy == "write_through")
        context = SchedulerContext(num_lookahead_slots=self.model_info.num_lookahead_slots,
                                   prefix_tier=tier, kv_window=self.model_info.kv_window)
        self.scheduler = build("scheduler", scheduler_cls, self.config,
                               num_blocks=self.num_blocks, options=self.stack.options["scheduler"],
                               context=context, plugin=sched_reg.origin)
        self.plan_check = PlanCheck(registration_label(sched_reg),
                                    self.config.scheduler.max_num_batched_tokens,
                                    self.config.scheduler.max_num_seqs,
                                    self.facts.max_model_len)
        structured = StructuredOutputManager.from_stack(
            self.config, self.stack, self.model_dir, self.facts.vocab_size, self.scheduler)
        pooling = PoolingPhase(self.host, self.facts, sentence_transformers_pooler(self.model_dir))
        trace = StepTracePhase.from_env()  # first: its clock starts before the others
        phases: list[StepPhase] = [*([trace] if trace else []), pooling, structured]
        proposer = ProposerManager.from_stack(self.config, self.stack,
                                              self.facts.vocab_size)
        if proposer is not None:
            phases.append(proposer)
            if isinstance(structured, StructuredOutputManager) and not self.config.speculative.tree:
                phases.append(TrimDrafts(structured))  # after the proposer's (chains)
        if tier is not None:
            phases.append(OffloadPhase(self.executor))
        return StepPhases(phases)

    def _runtime_config(self, config: LMKitConfig) -> LMKitConfig:
        """A copy of ``config`` with the model directory and context length filled in."""
        max_len = self.facts.max_model_len
        cfg = config.model_copy(deep=True)
        cfg.model.model = str(self.model_dir)
        cfg.model.max_model_len = max_len
        # what auto resolved to (workers resolve again); update= as the stack's dtype is
        # a plain str, one of the field's choices
        cfg.model = cfg.model.model_copy(update={"dtype": self.stack.dtype})
        if not self.facts.pooling.causal:
            # bidirectional attention: a token's K/V depend on the whole prompt, so each
            # prompt runs in one step and no prefix of it can be reused
            cfg.scheduler.enable_chunked_prefill = False
            cfg.cache.enable_prefix_caching = False
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
        fp8 = ", float8 e4m3" if cfg.cache.fp8_kv_cache else ""
        logger.info("KV cache: %d blocks x %d tokens (%.2f GiB%s)", num_blocks, block_size,
                    num_blocks * info.kv_bytes_per_block / 2**30, fp8)
        return int(num_blocks)

    # ------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        """Queue a validated request (see :class:`~lmkit.frontend.processor.InputProcessor`).
        A constrained request waits in the scheduler for its grammar; if the grammar
        fails to compile it is refused later (:meth:`take_rejected_requests`).

        Raises:
            InvalidRequestError: the scheduler or a feature refuses it (duplicate id,
                too long for the KV cache, a constraint this engine cannot serve).
            EngineDeadError: the engine stopped (:meth:`step`).
        """
        self._check_alive()
        check_request(self.host.registry, request.sampling_params,
                      self.config.logits_processors.enable, self.facts.vocab_size)
        try:
            self.scheduler.add_request(request)
        except LMKitError:
            raise
        except Exception as e:
            self._die(raised_in(self.plan_check.label, e,
                                f"queueing request {request.request_id!r}"), e)
        try:
            self.phases.add_request(request)
        except BaseException:
            self.abort_requests([request.request_id])
            raise

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort requests; unknown or finished ids are ignored (all of them once the
        engine stopped)."""
        ids = list(request_ids)
        if ids and self.dead_reason is None:
            self._finish(ids, RequestStatus.FINISHED_ABORTED)
            self.phases.abort_requests(ids)

    def check_health(self) -> None:
        """Raise if the engine can no longer step: it stopped (:class:`EngineDeadError`),
        or its executor reports a dead worker (``Executor.check_health``)."""
        self._check_alive()
        self.executor.check_health()

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting (for its grammar too), running or preempted;
        ``False`` once the engine stopped (nothing can finish)."""
        if self.dead_reason is not None:
            return False
        try:
            return self.scheduler.has_unfinished_requests()
        except Exception as e:
            self._die(raised_in(self.plan_check.label, e, "asked for unfinished requests"), e)

    def take_rejected_requests(self) -> list[tuple[str, InvalidRequestError]]:
        """``(request id, error)`` of requests refused after :meth:`add_request` took them
        (a constraint that did not compile, or not in time); they produce no output."""
        return self.phases.take_rejected()

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[EngineCoreOutput]:
        """Run one engine step; returns outputs of requests that advanced or finished.

        Raises:
            EngineDeadError: the scheduler plugin raised or planned a step that breaks
                its contract (this step), or did so before (the engine stopped).
        """
        self._check_alive()
        if self._step_hooked:
            return self.host.hook.engine_step.call_extra([self._step], {"engine": self.view})
        return self._step(self.view)

    def _step(self, engine: EngineView) -> list[EngineCoreOutput]:
        self.phases.before_schedule()
        label = self.plan_check.label
        try:
            scheduler_output = self.scheduler.schedule()
        except Exception as e:
            self._die(raised_in(label, e, "planning a step"), e)
        problem = self.plan_check.check(scheduler_output)
        if problem is not None:
            self._die(f"{label} {problem}")
        self.phases.after_schedule(scheduler_output)
        runner_output = self.executor.execute(scheduler_output)
        try:
            outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        except Exception as e:
            self._die(raised_in(label, e, "taking the step's tokens (update_from_output)"), e)
        if not isinstance(outputs, list):
            self._die(f"{label} update_from_output returned {type(outputs).__name__}, not "
                      "a list of EngineCoreOutput")
        self.phases.after_model_output(scheduler_output, runner_output, outputs)
        failed = self.phases.take_failed()
        if failed:
            self._fail_requests(failed, outputs)
        self._num_steps += 1
        self._num_scheduled_tokens += scheduler_output.total_num_scheduled_tokens
        return outputs

    def _fail_requests(self, failed: dict[str, str], outputs: list[EngineCoreOutput]) -> None:
        """End the requests a feature's plugin failed (request id -> why) with
        ``finish_reason="error"``: out of the scheduler and every phase, this step's
        tokens withheld (they may not be valid output)."""
        ids = list(failed)
        self._finish(ids, RequestStatus.FINISHED_ERROR)
        self.phases.abort_requests(ids)
        by_id = {o.request_id: o for o in outputs if o.request_id in failed}
        for rid, message in failed.items():
            out = by_id.get(rid)
            if out is None:
                out = EngineCoreOutput(rid, [])
                outputs.append(out)
            out.new_token_ids, out.new_logprobs = [], None
            out.finish_reason, out.stop_reason = "error", message
            out.error_code = out.error_param = None  # the engine's fault, not the request's

    def _finish(self, ids: list[str], status: RequestStatus) -> None:
        try:
            self.scheduler.finish_requests(ids, status)
        except Exception as e:
            self._die(raised_in(self.plan_check.label, e, f"finishing {len(ids)} requests"), e)

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    def _die(self, message: str, cause: BaseException | None = None) -> NoReturn:
        """Stop the engine over a scheduler fault (``message`` names the plugin and what
        it did): raises :class:`EngineDeadError`, as every later call will."""
        self.dead_reason = (
            f"{message}. The engine stopped: its scheduler's state can no longer be trusted, "
            "so no request can go on; fix the scheduler plugin or choose another "
            "(scheduler.backend), and start a new engine")
        logger.error("%s", self.dead_reason, exc_info=cause)
        raise EngineDeadError(self.dead_reason) from cause

    def stats(self) -> dict[str, Any]:
        """Scheduler and cache counters, each feature's, plus engine-level facts."""
        stats = dict(self.scheduler.get_stats())
        stats.update(num_steps=self._num_steps, num_blocks=self.num_blocks,
                     kv_cache_bytes=self.num_blocks * self.model_info.kv_bytes_per_block,
                     num_scheduled_tokens=self._num_scheduled_tokens,
                     uptime_s=time.monotonic() - self._started)
        stats.update(self.phases.stats())
        return stats

    def shutdown(self) -> None:
        """Stop the features (offload finishes pending disk writes), then the executor;
        safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._gc_frozen:
            unfreeze_heap()  # before the executor collects what the model leaves behind
        try:
            self.phases.shutdown()
            self.executor.shutdown()
        finally:
            self.host.hook.engine_stopped(engine=self.view)

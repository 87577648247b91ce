"""The model runner: loads the model, owns the KV cache, runs one step at a time.

Per step (:meth:`ModelRunner.execute_model`): update the persistent request states
from the schedule, pack the inputs in the :class:`InputBatch` (vectorised host work,
O(batch) Python), plan the attention backend once, run the forward, take logits only
where a request samples, sample, and append the sampled tokens to the runner's own
copy of each request. The only device-to-host synchronisation is reading the sampled
tokens (plus logprobs when asked).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lmkit.api.contract import build
from lmkit.api.kv_cache_spec import KVCacheGroup, kv_window
from lmkit.api.model import ForwardContext, ModelBuildContext
from lmkit.api.runner_output import ModelRunnerOutput
from lmkit.api.spec_decode import DraftHeadContext
from lmkit.errors import ModelLoadError
from lmkit.loading.model_facts import model_class
from lmkit.loading.weights import load_hf_config
from lmkit.offload.worker import OffloadWorker, build_offload_worker
from lmkit.sample.bitmask import bitmask_kernel
from lmkit.sample.kernels import build_sampling_kernels
from lmkit.sample.processors import LogitsProcessorSet
from lmkit.sample.sampler import Sampler
from lmkit.worker import memory
from lmkit.worker.cuda_graphs import CudaGraphRunner
from lmkit.worker.draft_runner import DraftRunner
from lmkit.worker.dummy_steps import DummyStepModel, profile_run, warm_up_step_shapes
from lmkit.worker.early_drafts import early_greedy_targets, head_drafts, read_greedy
from lmkit.worker.gpu_lookahead import DecodeLookahead, decode_lookahead_slots
from lmkit.worker.graph_capture import maybe_capture
from lmkit.worker.input_batch import CachedRequestState, DeviceInputs, InputBatch, StepInputs
from lmkit.worker.kv_scales import set_kv_cache_scales
from lmkit.worker.lookaheads import build_lookaheads
from lmkit.worker.model_build import (
    build_draft_proposer,
    check_load_format,
    check_tensor_parallel,
    kv_cache_groups,
    kv_cache_torch_dtype,
    quantization_method,
    weight_source,
)
from lmkit.worker.piecewise_graphs import PiecewiseGraphRunner, maybe_capture_piecewise
from lmkit.worker.pooling import PoolingRequests
from lmkit.worker.prompt_logprobs import step_prompt_logprobs
from lmkit.worker.spec_lookahead import SpecLookahead, spec_lookahead_slots, take_ahead
from lmkit.worker.step_plan import commit_tokens, sampling_plan
from lmkit.worker.step_sampling import sample_step
from lmkit.worker.tree_step import mark_tree_rows, tree_of

if TYPE_CHECKING:
    from lmkit.api.model_facts import ModelFacts
    from lmkit.api.scheduler_output import SchedulerOutput
    from lmkit.config.schema import LMKitConfig
    from lmkit.plugin_host.manager import PluginHost
    from lmkit.plugin_host.resolve import ResolvedStack

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    """Runs the model of ``model_dir`` for the engine, one scheduled step at a time.

    Args:
        config: the engine's configuration (``model.max_model_len`` filled in).
        stack: the resolved stack: device, dtype and the chosen attention backend.
        host: the plugin host whose registry knows the model architectures.
        facts: the engine's facts about the model (its directory, architecture, context
            length and EOS ids; :func:`lmkit.loading.model_facts.load_model_facts`).
        tp_rank, tp_size, tp_group: this runner's share of a tensor-parallel group
            (see :class:`~lmkit.api.ModelBuildContext`); one rank by default.
    """

    def __init__(self, config: LMKitConfig, stack: ResolvedStack, host: PluginHost,
                 facts: ModelFacts, tp_rank: int = 0, tp_size: int = 1,
                 tp_group: Any = None) -> None:
        self.config = config
        self.stack = stack
        self.host = host
        self.facts = facts
        self.model_dir = Path(facts.model_dir)
        self.tp_rank, self.tp_size, self.tp_group = tp_rank, tp_size, tp_group
        self.device = torch.device(stack.device)
        self.dtype = DTYPES[stack.dtype]
        # memory other engines of this process already hold (not this engine's to count)
        self._baseline_bytes = (torch.cuda.memory_allocated(self.device)
                                if self.device.type == "cuda" else 0)
        self.block_size = config.cache.block_size
        self.model: Any = None
        self.hf_config: Any = None
        self.architecture = facts.architecture
        self.vocab_size = facts.vocab_size
        self.num_layers = facts.num_layers
        self.max_model_len = facts.max_model_len
        self.default_eos_token_id = facts.eos_token_id
        self.kv_caches: list[torch.Tensor] = []  # per layer, shaped by its group's backend
        self.kv_groups: tuple[KVCacheGroup, ...] = ()  # the model's KV cache groups
        self.requests: dict[str, CachedRequestState] = {}
        self.paused_generators: dict[str, torch.Generator] = {}  # of preempted requests
        self.sampler = Sampler(build_sampling_kernels(stack, self.device))  # (and verifies drafts)
        self.logits_processors = LogitsProcessorSet()  # plugin processors, by load_model
        self.pooling = PoolingRequests(host, facts.pooling)  # pooler states (model: load_model)
        self.offload: OffloadWorker | None = None  # the KV offload tier, when one is on
        self.apply_token_bitmask = bitmask_kernel(stack.get("structured_output"))  # (torch: CPU)
        self.cuda_graphs: CudaGraphRunner | None = None  # decode graphs (CUDA, after the KV cache)
        self.piecewise: PiecewiseGraphRunner | None = None  # mixed steps' graphs (CUDA)
        self.lookahead: DecodeLookahead | None = None  # decode steps launched ahead (CUDA)
        self.spec_lookahead: SpecLookahead | None = None  # verifications launched ahead
        self.drafter: DraftRunner | None = None  # a runner-hosted proposer (EAGLE head)
        self.tree = tree_of(config, stack)  # speculative.tree: draft trees (None: chains)
        # KV slots per request the scheduler reserves so decode steps can launch ahead
        self.num_lookahead_slots = max(decode_lookahead_slots(config, stack),
                                       spec_lookahead_slots(config, stack))

    # ------------------------------------------------------------------ setup

    def load_model(self) -> None:
        """Build the model for the config's architecture and load its weights."""
        self.hf_config = hf_config = load_hf_config(self.model_dir)
        registration = self.host.registry.get("model", self.architecture)
        attention = self.stack.get("attention")
        if attention is None:
            raise ModelLoadError("no attention backend was resolved for this stack")
        check_load_format(self.config, self.stack)
        quant = quantization_method(self.stack, self.facts)
        ctx = ModelBuildContext(
            dtype=self.dtype, device=self.device, block_size=self.block_size,
            attention_cls=attention.spec.load(), attention_options=self.stack.options["attention"],
            tp_rank=self.tp_rank, tp_size=self.tp_size, tp_group=self.tp_group,
            quantization=quant, kv_cache_dtype=kv_cache_torch_dtype(self.config))
        model_cls = model_class(registration)
        check_tensor_parallel(model_cls, registration, self.architecture, ctx, self.facts)
        head = build_draft_proposer(self.config, self.stack, model_cls, self.architecture,
                                    hf_config)  # checked against the target before any load
        model = build("model", model_cls, hf_config, ctx, plugin=registration.origin)
        model.load_weights(weight_source(self.config, self.model_dir, hf_config, quant,
                                         self.dtype, self.device))
        self.kv_groups = kv_cache_groups(model, model_cls.kv_cache_specs(hf_config),
                                         self.num_layers, ctx.kv_cache_dtype)
        if isinstance(model, torch.nn.Module):
            model.eval()
        self.model = model
        self.pooling.model = model
        sched = self.config.scheduler
        procs = self.config.logits_processors
        self.logits_processors = LogitsProcessorSet.from_registry(
            self.host.registry, procs.enable, procs.options, self.vocab_size,
            sched.max_num_seqs, self.device)
        self.input_batch = InputBatch(sched.max_num_seqs, self.max_model_len, self.block_size,
                                      sched.max_num_batched_tokens,
                                      pin_memory=self.device.type == "cuda")
        self._device_inputs = DeviceInputs(self.device) if self.device.type != "cpu" else None
        set_kv_cache_scales(self.config.cache.kv_cache_scales, self.kv_groups, self.model_dir,
                            self.dummy_step_model, self.vocab_size)  # an FP8 cache's scales
        if head is not None:
            spec = self.config.speculative
            self.drafter = DraftRunner.load(
                head, DraftHeadContext(model, hf_config, ctx), spec.num_speculative_tokens,
                self.input_batch, self.max_model_len, self.requests, self.vocab_size,
                None if spec.catch_up_when_off else spec.disable_by_batch_size)
            self.drafter.tree = self.tree
        logger.info("loaded %s (%s) on %s in %s%s", self.model_dir, self.architecture,
                    self.device, self.stack.dtype,
                    f", rank {self.tp_rank} of {self.tp_size}" if self.tp_size > 1 else "")

    def kv_bytes_per_block(self) -> int:
        """Bytes of one KV block over every layer of every group (the draft head's too)."""
        head = self.drafter.kv_bytes_per_block() if self.drafter is not None else 0
        return memory.kv_bytes_per_block(self.kv_groups) + head

    def kv_window(self) -> int | None:
        """How many of the latest keys any layer (the draft head's too) reads when every
        layer slides, else ``None`` (:attr:`lmkit.api.ModelInfo.kv_window`)."""
        head = self.drafter.kv_groups() if self.drafter is not None else ()
        return kv_window((*self.kv_groups, *head))

    def available_kv_bytes(self) -> int:
        """Memory the KV cache may take on this device (CUDA: measured by profiling)."""
        if self.device.type != "cuda":
            cfg = self.config
            return memory.cpu_kv_budget(cfg.cache.kv_cache_memory_gb, self.kv_bytes_per_block(),
                                        self.block_size, cfg.scheduler.max_num_seqs,
                                        self.max_model_len)
        return memory.cuda_kv_budget(self.device, self.config.cache.gpu_memory_utilization,
                                     lambda: profile_run(self.dummy_step_model()),
                                     baseline=self._baseline_bytes,
                                     reserve_for_graphs=not self.config.executor.enforce_eager)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` zeroed KV blocks per layer."""
        self.kv_caches = memory.allocate_kv_caches(self.kv_groups, num_blocks, self.device)
        self.num_blocks = num_blocks
        if self.drafter is not None:  # the head's KV: same blocks, its own tensors
            self.drafter.allocate(num_blocks)
        caches, groups = self.kv_caches, self.kv_groups
        if self.drafter is not None and self.config.offload.backend != "none":
            # the tier carries the head's KV blocks too (same block ids as the target's)
            memory.check_head_blocks_offloadable(self.kv_caches, self.drafter.kv_caches)
            caches, groups = caches + self.drafter.kv_caches, groups + self.drafter.kv_groups()
        self.offload = build_offload_worker(self.config, self.stack, caches, groups)
        if self.device.type == "cuda":
            warm_up_step_shapes(self.dummy_step_model())
        aux_layers = tuple(self.drafter.proposer.target_layers if self.drafter is not None else ())
        self.cuda_graphs = maybe_capture(self.config, self.stack, self.model, self.kv_caches,
                                         self.device, self.max_model_len, aux_layers)
        self.piecewise = maybe_capture_piecewise(self.config, self.model, self.kv_caches,
                                                 self.device, len(self.kv_groups), aux_layers,
                                                 self.tp_size)
        if self.drafter is not None:  # (with a tree: the catch-up graphs only)
            self.drafter.capture_graphs(self.cuda_graphs, self.config.scheduler.max_num_seqs,
                                        self.dtype)
        if self.facts.generates:  # (a pooling model never decodes)
            self.lookahead, self.spec_lookahead = build_lookaheads(
                self.config, self.stack, self.cuda_graphs, self.model, self.input_batch,
                self.requests, self.max_model_len, self.drafter, self.sampler,
                self.logits_processors.affects_greedy)
            self.sampler.kernels.warm_up(self.vocab_size, self.config.scheduler.max_num_seqs)

    def dummy_step_model(self) -> DummyStepModel:
        """What :mod:`lmkit.worker.dummy_steps` needs of this runner (eager forward); the
        dummy steps of a pooling-only model (no language-model head) end at its hidden
        states."""
        head = self.model.compute_logits if self.facts.generates else (lambda hidden: hidden)
        return DummyStepModel(self.config.scheduler, self.max_model_len, self.block_size,
                              self.device, self.kv_groups, self._forward, head)

    def offload_lookup(self, block_hashes: Sequence[bytes]) -> tuple[int, int]:
        """``(held, resident)`` leading blocks of ``block_hashes`` in the offload tier."""
        return self.offload.lookup(block_hashes) if self.offload is not None else (0, 0)

    def offload_stats(self) -> dict[str, int]:
        """The offload tier's runner-side counters; none without offload."""
        return self.offload.stats() if self.offload is not None else {}

    def close_offload(self) -> None:
        """Close the offload tier (finishes pending writes); nothing without offload."""
        if self.offload is not None:
            self.offload.close()

    def release(self) -> None:
        """Drop everything holding device memory (graphs, lookaheads, the draft head, the
        offload worker, KV caches, the model): the runner cannot step afterwards. The
        executor's shutdown calls it so another engine in the process gets the memory."""
        self.lookahead = self.spec_lookahead = self.drafter = self.offload = None
        # the piecewise graphs' buffers hold the KV caches and weights too
        self.cuda_graphs, self.piecewise, self.kv_caches, self.model = None, None, [], None
        self.requests.clear()

    def _finished_kv_loads(self, wait: bool = False) -> dict[int, bool]:
        return self.offload.finished_loads(wait) if self.offload is not None else {}

    # ------------------------------------------------------------------ one step

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step; returns sampled tokens per scheduled request."""
        so = scheduler_output
        self._update_states(so)
        if self.offload is not None:  # this step's stores, then its loads, before the forward
            self.offload.start(so.kv_transfers)
        if not so.total_num_scheduled_tokens:
            return ModelRunnerOutput(finished_kv_loads=self._finished_kv_loads(wait=True))
        ahead = None if self.pooling else take_ahead(self.lookahead, self.spec_lookahead, so)
        if ahead is not None:  # the step launched ahead
            ahead.finished_kv_loads = self._finished_kv_loads()
            return ahead
        order, step = self._prepare_step(so)
        # a draft head that reads chosen target layers (EAGLE-3) gets their inputs here
        aux: list[torch.Tensor] | None = (
            [] if self.drafter is not None and self.drafter.proposer.target_layers else None)
        with torch.inference_mode():
            hidden = self._forward(step, self.kv_caches, aux)
            if self.offload is not None and self.drafter is None:
                self.offload.after_forward(so.kv_transfers)  # they read what it wrote
            plan = sampling_plan(order, step, so.scheduled_spec_decode_tokens, self.requests)
            pooled = None
            if self.pooling:  # pooling requests pool their chunks and never sample
                pooling = self.pooling.states
                plan = [p for p in plan if order[p[0]] not in pooling]
                pooled = self.pooling.pool_step(hidden, order, step)
            drafts, targets = None, early_greedy_targets(self, hidden, order, plan, so)
            if targets is not None:  # the head's passes queued before the tokens are read
                drafts = head_drafts(self, hidden, aux, step, order, plan, [0] * len(plan),
                                     so, sampled=targets)
            verified = (sample_step(self, hidden, order, plan, so, step, aux)
                        if targets is None else read_greedy(targets))
            prompt_logprobs = step_prompt_logprobs(self.model, self.requests,
                                                   hidden, order, step)
        out = commit_tokens(order, plan, verified, prompt_logprobs, self.requests,
                            self.input_batch)
        out.no_allowed_token = {order[plan[n][0]]: j for n, j in verified.no_allowed_token.items()}
        out.pooled = pooled
        if self.drafter is not None:  # the head drafts the next step's tokens, now
            if drafts is None:
                drafts = head_drafts(self, hidden, aux, step, order, plan,
                                     verified.num_accepted, so)
            out.draft_token_ids = {order[i]: d for i, d in drafts.items()}
            if self.offload is not None:  # write-through stores: after the head's KV too
                self.offload.after_forward(so.kv_transfers)
        if self.lookahead is not None:
            self.lookahead.after_step(so, order, step, drafted=bool(out.draft_token_ids))
        if self.spec_lookahead is not None:
            self.spec_lookahead.after_step(so, order, out.draft_token_ids)
        out.finished_kv_loads = self._finished_kv_loads()
        return out

    def _update_states(self, so: SchedulerOutput) -> None:
        """Drop finished and preempted requests, add new ones, extend block tables."""
        batch = self.input_batch
        CachedRequestState.pause_generators(so, self.requests, self.paused_generators)
        for rid in (*so.finished_req_ids, *so.preempted_req_ids):
            self._drop(rid)
        for new in so.scheduled_new_reqs:
            self._drop(new.req_id)  # resent (resumed) without a preemption notice
            state = CachedRequestState.from_new(new, self.device, self.default_eos_token_id,
                                                self.paused_generators)
            self.requests[new.req_id] = state
            batch.add_request(state, list(new.block_ids))
            if new.pooling_params is not None:  # prefill only: pooled, never sampled
                self.pooling.add(new.req_id, new.pooling_params, len(new.prompt_token_ids))
            else:
                self.logits_processors.add(new.req_id, new.sampling_params,
                                           state.prompt_token_ids, state.output_token_ids)
        cached = so.scheduled_cached_reqs
        for rid, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                 cached.num_computed_tokens, strict=True):
            state = self.requests[rid]
            row = batch.row_of[rid]
            state.num_computed_tokens = num_computed
            batch.num_computed[row] = num_computed
            if new_blocks:
                batch.append_block_ids(row, new_blocks)

    def _drop(self, rid: str) -> None:
        """Forget a request's state, its batch row, processor slot and pooling state."""
        if self.requests.pop(rid, None) is not None:
            self.input_batch.remove_request(rid)
            self.logits_processors.remove(rid)
            self.sampler.forget(rid)
            if self.pooling:
                self.pooling.remove(rid)

    def _prepare_step(self, so: SchedulerOutput) -> tuple[list[str], StepInputs]:
        """Order the scheduled requests (decodes first) and pack their inputs."""
        spec = so.scheduled_spec_decode_tokens
        decodes: list[str] = []
        others: list[str] = []
        for rid, n in so.num_scheduled_tokens.items():
            (decodes if n == 1 and rid not in spec else others).append(rid)
        order = decodes + others
        batch = self.input_batch
        row_of = batch.row_of
        rows = np.fromiter((row_of[r] for r in order), dtype=np.int64, count=len(order))
        num_scheduled = np.fromiter((so.num_scheduled_tokens[r] for r in order),
                                    dtype=np.int64, count=len(order))
        for rid, drafts in spec.items():
            if drafts:
                batch.write_draft_tokens(row_of[rid], drafts)
        if self._device_inputs is not None:
            self._device_inputs.wait_for_copies()  # the host buffers are about to change
        return order, mark_tree_rows(batch.prepare(rows, num_scheduled, len(decodes)), order,
                                     spec, self.tree)

    def _forward(self, step: StepInputs, kv_caches: list[torch.Tensor],
                 aux: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Plan attention once, run the model; returns hidden ``[num_tokens, hidden]``.
        With ``aux``, the inputs of the draft head's target layers are appended to it
        (captured graphs return them too)."""
        graphs = self.cuda_graphs
        own = kv_caches is self.kv_caches  # the target's forward (graphs hold its caches)
        if graphs is not None and own and graphs.can_replay(step):
            return graphs.replay(step, aux)  # decode or verification: a captured CUDA graph
        dev = self._device_inputs.copy(step) if self._device_inputs is not None else step
        md = step.attention_metadata(dev)
        for group in self.kv_groups:  # every group's backend, once per step
            group.attn.plan(md)
        pieces = self.piecewise
        if pieces is not None and own and pieces.can_run(step.num_tokens):
            return pieces.run(dev, step.num_tokens, aux)  # graphs between attention calls
        attn = self.model.attn
        if aux is None:
            return self.model(dev.input_ids, dev.positions, ForwardContext(attn, kv_caches))
        assert self.drafter is not None
        ctx = ForwardContext(attn, kv_caches, self.drafter.proposer.target_layers)
        hidden = self.model(dev.input_ids, dev.positions, ctx)
        aux.extend(ctx.aux_hidden_states)
        return hidden

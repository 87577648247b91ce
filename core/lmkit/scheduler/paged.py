"""The paged scheduler: continuous batching over a paged KV cache with prefix caching.

Each step (vLLM v1's design): running requests first, in admission order, each
getting ``min(remaining tokens, token budget)``: a decode (1 token plus its draft
tokens) or the next chunk of a prefill. When the KV pool cannot hold a running
request's new tokens, a victim chosen by the policy is preempted (its blocks freed,
recomputed later) until it fits or the request itself is the victim. Then, only if
nothing was preempted, waiting requests are admitted in queue order, each starting
after its prefix-cache hit, while the budget, ``max_num_seqs`` and the pool allow.

Subclasses set the policy with two small hooks (and an optional third):
:meth:`PagedScheduler.make_waiting_queue`, :meth:`PagedScheduler.choose_preemption_victim`
and :meth:`PagedScheduler.choose_admission_victim`. The defaults are first come,
first served.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from lmkit.api.request import Request, RequestStatus
from lmkit.api.scheduler import Scheduler, SchedulerContext
from lmkit.api.scheduler_output import SchedulerOutput
from lmkit.config.schema import LMKitConfig
from lmkit.errors import ConfigError, InvalidRequestError
from lmkit.kv_cache.manager import KVCacheManager, cdiv
from lmkit.offload.coordinator import OffloadCoordinator
from lmkit.scheduler.queues import FCFSWaitingQueue, WaitingQueue
from lmkit.scheduler.step_outputs import StepOutputs
from lmkit.scheduler.step_plan import StepPlan


class PagedScheduler(StepOutputs, Scheduler):
    """Token-budget continuous batching with chunked prefill, prefix-cache-aware
    admission and preemption by recompute.

    Args:
        config: reads ``cache.block_size``, ``cache.enable_prefix_caching``,
            ``scheduler.max_num_batched_tokens`` / ``max_num_seqs`` /
            ``enable_chunked_prefill``, ``model.max_model_len`` (must be set: the engine
            fills it in from the model before building the scheduler) and
            ``speculative`` (lookahead slots for draft tokens).
        num_blocks: KV pool size in blocks, including the reserved null block 0.
        options: the validated options of the scheduler plugin (unused here).
        context: lookahead slots the runner needs and the KV offload tier
            (:class:`~lmkit.api.SchedulerContext`); None: neither.

    Attributes: ``requests`` (id -> unfinished request), ``waiting``, ``running``
    (admission order), ``kv_cache_manager``, ``offload`` (the
    :class:`~lmkit.offload.OffloadCoordinator` over ``context.prefix_tier``, or None),
    ``num_preemptions``.
    """

    supports_prefix_tier = True

    def __init__(self, config: LMKitConfig, num_blocks: int, options: Any = None,
                 context: SchedulerContext | None = None) -> None:
        max_model_len = config.model.max_model_len
        if not isinstance(max_model_len, int):
            raise ConfigError(
                "model.max_model_len must be set to an integer before the scheduler is "
                f"built (got {max_model_len!r}); the engine sets it from the model config"
            )
        sched = config.scheduler
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < max_model_len:
            raise ConfigError(
                f"with chunked prefill off, scheduler.max_num_batched_tokens "
                f"({sched.max_num_batched_tokens}) must be at least model.max_model_len "
                f"({max_model_len}) so that any prompt fits in one step; raise it, lower "
                "max_model_len, or turn scheduler.enable_chunked_prefill on"
            )
        self.config = config
        self.options = options
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = sched.max_num_batched_tokens
        self.max_num_seqs = sched.max_num_seqs
        self.enable_chunked_prefill = sched.enable_chunked_prefill
        context = context if context is not None else SchedulerContext()
        spec = config.speculative
        # KV slots past the scheduled tokens: draft tokens, or decode steps the runner
        # launches ahead of scheduling (lmkit.worker.gpu_lookahead)
        self.num_draft_slots = spec.num_speculative_tokens if spec.backend != "none" else 0
        self.num_lookahead_tokens = max(self.num_draft_slots, context.num_lookahead_slots)
        self.kv_cache_manager = KVCacheManager(
            num_blocks, self.block_size, config.cache.enable_prefix_caching, max_model_len,
            sliding_window=context.kv_window,
        )
        self.requests: dict[str, Request] = {}
        self.waiting: WaitingQueue = self.make_waiting_queue()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # since the last schedule(), for the runner
        self.num_preemptions = 0
        tier = context.prefix_tier
        self.offload: OffloadCoordinator | None = None if tier is None else OffloadCoordinator(
            self.kv_cache_manager, tier.lookup, tier.stats, tier.write_through)
        self._taken_back: set[str] = set()  # admissions undone since the last schedule()

    # -- policy hooks -------------------------------------------------------------

    def make_waiting_queue(self) -> WaitingQueue:
        """The queue that orders admission (called once, in ``__init__``).
        Default: arrival order, preempted requests first."""
        return FCFSWaitingQueue()

    def choose_preemption_victim(self, running: Sequence[Request]) -> Request:
        """Which running request to preempt when the KV pool is full.

        Called while scheduling running requests; ``running`` is non-empty and includes
        the request that needs blocks (choosing it stops scheduling running requests
        this step). Default: the latest arrival.
        """
        return max(reversed(running), key=lambda r: r.arrival_time)

    def choose_admission_victim(
        self, request: Request, running: Sequence[Request]
    ) -> Request | None:
        """Which running request, if any, to preempt so that waiting ``request`` can be
        admitted when the KV pool is full. ``None`` (the default) means wait. Return
        only requests that rank strictly below ``request``, or two requests could keep
        preempting each other."""
        return None

    # -- requests in and out ------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue ``request`` (status WAITING).

        Raises:
            InvalidRequestError: its id is in use, or even alone it could never fit in
                the KV pool.
        """
        if request.request_id in self.requests:
            raise InvalidRequestError(
                f"request id {request.request_id!r} is already in use; ids must be unique "
                "among unfinished requests", param="request_id", code="duplicate_request_id",
            )
        need = cdiv(self._max_slots(request), self.block_size)
        usable = self.kv_cache_manager.block_pool.num_usable_blocks
        if need > usable:
            raise InvalidRequestError(
                f"request {request.request_id!r} may need {need} KV-cache blocks of "
                f"{self.block_size} tokens ({request.num_prompt_tokens} prompt tokens, "
                f"max_tokens={request.max_tokens}) but the KV cache holds only {usable}; "
                "lower max_tokens or the prompt, or give the KV cache more memory "
                "(cache.num_blocks / cache.kv_cache_memory_gb)",
                param="max_tokens", code="kv_cache_too_small",
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def _token_limit(self, request: Request) -> int:
        """The most tokens ``request`` can ever hold (prompt + outputs)."""
        limit = self.max_model_len
        if request.max_tokens is not None:
            limit = min(limit, request.num_prompt_tokens + request.max_tokens)
        return max(limit, request.num_prompt_tokens)

    def _max_slots(self, request: Request) -> int:
        """The most KV slots ``request`` can ever hold: every token but the last,
        plus lookahead slots (clipped to ``max_model_len``)."""
        computed = self._token_limit(request) - 1
        return max(min(computed + self.num_lookahead_tokens, self.max_model_len),
                   request.num_prompt_tokens)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside the step loop (abort, frontend stop string):
        drop them from the queues and free their blocks. Unknown ids are ignored."""
        if not status.is_finished:
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        removed_running = False
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                removed_running = True
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)
        if removed_running:
            self.running = [r for r in self.running if not r.is_finished]

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting, running or preempted."""
        return bool(self.running) or bool(self.waiting)

    # -- one step -----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step within ``max_num_batched_tokens`` and ``max_num_seqs``.

        Advances ``num_computed_tokens`` of every scheduled request by its scheduled
        tokens (draft tokens included; :meth:`update_from_output` takes rejected
        drafts back off)."""
        plan = StepPlan(token_budget=self.max_num_batched_tokens)
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        finished, self.finished_req_ids = self.finished_req_ids, set()
        output = plan.to_output(self.kv_cache_manager.get_block_ids, finished)
        if self.offload is not None:  # blocks to store / load before the forward
            output.kv_transfers = self.offload.take_transfers()
            output.preempted_req_ids |= self._taken_back  # the runner drops their state
            self._taken_back = set()
        return output

    def _schedule_running(self, plan: StepPlan) -> None:
        req_index = 0
        while req_index < len(self.running) and plan.token_budget > 0:
            request = self.running[req_index]
            # never compute a draft position past what the request can keep
            end = max(self._token_limit(request) - 1, request.num_tokens)
            num_new = min(request.num_tokens_with_spec, end) - request.num_computed_tokens
            num_new = min(num_new, plan.token_budget)
            if num_new <= 0:
                req_index += 1
                continue
            new_block_ids = None
            while new_block_ids is None:
                new_block_ids = self.kv_cache_manager.allocate_slots(
                    request, num_new, self.num_lookahead_tokens
                )
                if new_block_ids is None:
                    victim = self.choose_preemption_victim(self.running)
                    if self.running.index(victim) < req_index:
                        req_index -= 1
                    self._preempt(victim, plan)
                    if victim is request:
                        return
            num_drafts = request.num_computed_tokens + num_new - request.num_tokens
            drafts = request.spec_token_ids[:num_drafts] if num_drafts > 0 else None
            plan.schedule(request, num_new, new_block_ids, drafts)
            req_index += 1

    def _schedule_waiting(self, plan: StepPlan) -> None:
        skipped: list[Request] = []  # waiting for their grammar: they keep their place
        try:
            self._admit_waiting(plan, skipped)
        finally:
            for request in reversed(skipped):
                self.waiting.add_front(request)

    def _admit_waiting(self, plan: StepPlan, skipped: list[Request]) -> None:
        manager = self.kv_cache_manager
        while self.waiting and plan.token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            if request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                self.waiting.remove(request)  # (not pop: a queue may count pops as service)
                skipped.append(request)
                continue
            if request.request_id in plan.preempted:
                break  # preempted this very step (for an admission): not back before next
            loaded: list[Any] = []  # blocks an offload load fills before this step's forward
            # (a pooling request reads every prompt position: no prefix is loaded)
            if self.offload is not None and request.pooling_params is None:
                if self.offload.defer_admission(request):
                    return  # its prefix is coming back from the offload tier: admitted after
                loaded = self.offload.loaded_blocks(request)
            hits, num_hit_tokens = manager.get_computed_blocks(request)
            num_hit_tokens += len(loaded) * self.block_size
            while True:
                num_new = request.num_tokens - num_hit_tokens
                if num_new > plan.token_budget:
                    if not self.enable_chunked_prefill:
                        if self.offload is not None and loaded:
                            self.offload.keep_waiting(request)
                        return  # waits (and holds back later arrivals) until the budget frees
                    num_new = plan.token_budget
                # a prompt that completes this step drafts right after: its draft slots
                # too (decode steps are launched ahead only after a decode step)
                lookahead = (self.num_draft_slots if request.pooling_params is None
                             and num_hit_tokens + num_new >= request.num_tokens else 0)
                new_block_ids = manager.allocate_slots(request, num_new, lookahead,
                                                       hits + loaded)
                if new_block_ids is not None:
                    break
                if self.offload is not None and loaded:  # no room beside its loaded
                    self.offload.keep_waiting(request)  # prefix: admitted once it is done
                    return
                victim = self.choose_admission_victim(request, self.running)
                if victim is None or manager.has_pending_shared_blocks(victim):
                    return  # (a victim whose new blocks this step's admissions share stays)
                self._preempt(victim, plan)
                # blocks the victim registered this step left the cache: so do the hits
                # from the first of them on
                for i, block in enumerate(hits):
                    if block.block_hash is None:
                        hits = hits[:i]
                        num_hit_tokens = i * self.block_size
                        break
            popped = self.waiting.pop()
            assert popped is request, "the waiting queue's peek and pop disagree"
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            self.running.append(request)
            plan.schedule(request, num_new, None)

    def _take_back(self, request: Request, num_valid_tokens: int) -> None:
        """Undo ``request``'s admission in the step just run: its prefix load from the
        offload tier failed, so that step computed it on blocks without valid data. Its
        output is discarded, its blocks freed (those registered past its first
        ``num_valid_tokens`` tokens withdrawn from the prefix cache), and it waits at
        the front of the queue to be admitted again."""
        if request.status != RequestStatus.RUNNING:
            return  # finished (aborted) or preempted since: nothing of it is in use
        self.running.remove(request)
        request.num_computed_tokens = num_valid_tokens
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        if not request.output_token_ids:
            request.num_cached_tokens = -1  # set again at its real admission
        request.status = (RequestStatus.PREEMPTED if request.output_token_ids
                          else RequestStatus.WAITING)
        self.waiting.add_front(request)
        self._taken_back.add(request.request_id)

    def _preempt(self, victim: Request, plan: StepPlan) -> None:
        """Preempt by recompute: free the victim's blocks and queue it again."""
        self.running.remove(victim)
        plan.unschedule(victim)
        self.kv_cache_manager.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_front(victim)
        plan.preempted[victim.request_id] = victim

    # -- introspection ------------------------------------------------------------

    def get_stats(self) -> dict[str, Any]:
        """Counters: ``num_running``, ``num_waiting``, ``kv_cache_usage`` (fraction),
        ``prefix_cache_queries`` / ``prefix_cache_hits`` (tokens), ``num_preemptions``
        and ``num_evictions`` (totals since start), plus the ``offload_*`` counters
        when a prefix tier is on."""
        manager = self.kv_cache_manager
        offload = self.offload.stats() if self.offload is not None else {}
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "kv_cache_usage": manager.usage,
            "prefix_cache_queries": manager.prefix_cache_queries,
            "prefix_cache_hits": manager.prefix_cache_hits,
            "num_preemptions": self.num_preemptions,
            "num_evictions": manager.num_evictions,
            **offload,
        }

    def reset_prefix_cache(self) -> int:
        """Forget every cached block hash; returns how many were dropped."""
        if self.offload is not None:  # blocks written through are reused without eviction
            self.offload.fence_writes()
        return self.kv_cache_manager.reset_prefix_cache()

"""Taking a step's output into the paged scheduler: sampled tokens appended with their
stop checks, rejected drafts rolled back, finished and pooled requests freed
(:class:`StepOutputs`, a part of :class:`~lmkit.scheduler.paged.PagedScheduler`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from lmkit.api.outputs import EngineCoreOutput
from lmkit.api.request import Request, RequestStatus
from lmkit.api.runner_output import ModelRunnerOutput
from lmkit.api.scheduler_output import SchedulerOutput
from lmkit.scheduler.stop import append_and_check_stop, end_without_allowed_token

if TYPE_CHECKING:
    from lmkit.offload.coordinator import OffloadCoordinator

logger = logging.getLogger(__name__)


class StepOutputs:
    """The paged scheduler's :meth:`update_from_output` (and its pooled-request part),
    over the state :class:`~lmkit.scheduler.paged.PagedScheduler` keeps."""

    requests: dict[str, Request]
    running: list[Request]
    max_model_len: int
    offload: OffloadCoordinator | None

    def _take_back(self, request: Request, num_valid_tokens: int) -> None:
        raise NotImplementedError

    def _free_request(self, request: Request) -> None:
        raise NotImplementedError

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens with stop checks, roll back rejected drafts, free
        finished requests; one output per request that got tokens, finished, or got
        prompt logprobs (a partial prefill chunk otherwise produces none). A request
        with nothing left to sample (``runner_output.no_allowed_token``) keeps the
        tokens before that position and ends with an error
        (:func:`~lmkit.scheduler.stop.end_without_allowed_token`)."""
        if self.offload is not None:
            for loaded, num_valid in self.offload.on_loads_finished(
                    runner_output.finished_kv_loads):
                self._take_back(loaded, num_valid)
        row_of = {rid: i for i, rid in enumerate(runner_output.req_ids)}
        logprobs = runner_output.logprobs
        outputs: list[EngineCoreOutput] = []
        any_finished = False
        for rid in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(rid)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished (aborted) since it was scheduled
            row = row_of.get(rid)
            sampled = runner_output.sampled_token_ids[row] if row is not None else []
            no_token_at = runner_output.no_allowed_token.get(rid)
            if no_token_at is not None:  # drawn where nothing was allowed: garbage
                sampled = sampled[:no_token_at]
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(rid)
            if drafts and (sampled or no_token_at is not None):
                # sampled = accepted drafts + 1; KV of the rejected ones is garbage
                request.num_computed_tokens -= len(drafts) + 1 - len(sampled)
            new_token_ids = (
                append_and_check_stop(request, sampled, self.max_model_len) if sampled else []
            )
            fault = None
            if no_token_at is not None and not request.is_finished:
                fault = end_without_allowed_token(request, new_token_ids,
                                                  scheduler_output.grammar_bitmask)
                if fault.code is None:  # not the request's doing
                    logger.error("request %s: %s", rid, fault.message)
                else:
                    logger.info("request %s: %s", rid, fault.message)
            prompt_logprobs = runner_output.prompt_logprobs.get(rid)
            if not new_token_ids and not request.is_finished and prompt_logprobs is None:
                continue
            row_logprobs = logprobs[row] if logprobs is not None and row is not None else None
            outputs.append(EngineCoreOutput(
                request_id=rid,
                new_token_ids=new_token_ids,
                finish_reason=request.status.finish_reason,
                stop_reason=request.stop_reason,
                new_logprobs=row_logprobs[:len(new_token_ids)] if row_logprobs else None,
                prompt_logprobs=prompt_logprobs,
                num_cached_tokens=max(request.num_cached_tokens, 0),
                error_code=fault.code if fault else None,
                error_param=fault.param if fault else None,
            ))
            if request.is_finished:
                self._free_request(request)
                any_finished = True
        if runner_output.pooled:
            any_finished |= self._finish_pooled(runner_output.pooled, outputs)
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return outputs

    def _finish_pooled(self, pooled: dict[str, Any], outputs: list[EngineCoreOutput]) -> bool:
        """Finish the pooling requests whose prompt the step completed: one output each
        with the pooled vector; their KV blocks are freed (cached blocks stay reusable
        by the prefix cache when it is on)."""
        any_finished = False
        for rid, data in pooled.items():
            request = self.requests.get(rid)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted since it was scheduled
            request.status = RequestStatus.FINISHED_STOPPED
            outputs.append(EngineCoreOutput(
                request_id=rid, new_token_ids=[], finish_reason="stop", pooled=data,
                num_cached_tokens=max(request.num_cached_tokens, 0)))
            self._free_request(request)
            any_finished = True
        return any_finished

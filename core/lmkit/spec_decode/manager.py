"""The engine core's side of speculative decoding: asks the proposer plugin for drafts.

After each step's :meth:`~lmkit.api.Scheduler.update_from_output`, :meth:`ProposerManager.
after_step` collects the requests that got tokens and are still decoding, asks the
proposer for up to ``k`` drafts each in one call (a runner-hosted proposer, an EAGLE
head, has already drafted in the model runner: its drafts arrive in
``ModelRunnerOutput.draft_token_ids``), validates them and sets
``request.spec_token_ids``; the scheduler schedules them (with their KV slots) in the
next step, the model runner verifies them, and the scheduler rolls back the rejected
ones. Drafts are only ever a guess: verification keeps the output distribution the
target model's. With ``speculative.disable_by_batch_size`` set, a step that ran more
requests than that is followed by a plain decode step (nothing proposed): large
batches are compute-bound, and there verifying drafts can cost more than it saves.
With ``speculative.adaptive``, :class:`~lmkit.spec_decode.adaptive.AdaptiveSpeculation`
decides from measured decode throughput whether steps are followed by drafts at all;
each step's plan tells the runner (``SchedulerOutput.spec_drafting``).

A proposer that raises or returns malformed drafts fails the requests concerned (all of
the call's for a raise or a malformed answer, one for a bad draft of its own): as a
phase, :meth:`ProposerManager.take_failed` hands them to the engine, which ends them
with an error naming the proposer and goes on (:mod:`lmkit.spec_decode.validate`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from lmkit.api.contract import build
from lmkit.api.request import Request, RequestStatus
from lmkit.api.spec_decode import RUNNER_HOSTED_FEATURES, Proposal, ProposerInput, SpecProposer
from lmkit.engine.phases import StepPhase
from lmkit.errors import ConfigError
from lmkit.plugin_host.faults import plugin_label, raised_in
from lmkit.spec_decode.adaptive import AdaptiveSpeculation
from lmkit.spec_decode.stats import SpecDecodeStats
from lmkit.spec_decode.tree import configured_tree
from lmkit.spec_decode.validate import CheckedProposal, ProposalError, check_proposal

if TYPE_CHECKING:
    from lmkit.api.outputs import EngineCoreOutput
    from lmkit.api.runner_output import ModelRunnerOutput
    from lmkit.api.scheduler_output import SchedulerOutput
    from lmkit.config.schema import LMKitConfig
    from lmkit.plugin_host.resolve import ResolvedStack

logger = logging.getLogger(__name__)

class ProposerManager(StepPhase):
    """Runs one :class:`~lmkit.api.SpecProposer` for the engine core, as a
    :class:`~lmkit.engine.phases.StepPhase`: :meth:`after_schedule` hands the runner
    the draft distributions, :meth:`after_model_output` sets the next drafts.

    Args:
        proposer: the constructed proposer; ``None`` for a runner-hosted one (its
            drafts come in each step's ``ModelRunnerOutput.draft_token_ids``).
        name: its registered name (for error messages).
        num_speculative_tokens: ``k``.
        vocab_size: draft ids must lie in ``[0, vocab_size)``.
        disable_by_batch_size: propose nothing after a step that ran more requests than
            this (``speculative.disable_by_batch_size``); ``None``: always propose.
        adaptive: the switch that turns drafting off where it measures slower
            (``speculative.adaptive``); ``None``: never.
        plugin: the plugin that registered it (for error messages).
    """

    def __init__(self, proposer: SpecProposer | None, name: str, num_speculative_tokens: int,
                 vocab_size: int, disable_by_batch_size: int | None = None,
                 adaptive: AdaptiveSpeculation | None = None,
                 plugin: str | None = None) -> None:
        self.proposer = proposer
        self.name = name
        self.label = plugin_label("speculative", name, plugin)
        self._failed: dict[str, str] = {}  # request id -> why the proposer failed it
        self._warned_long = False
        self.k = num_speculative_tokens
        self.vocab_size = vocab_size
        self.disable_by_batch_size = disable_by_batch_size
        self.num_steps_off = 0  # steps after which nothing was proposed (batch too large)
        self.requests: dict[str, Request] = {}
        self.num_seen: dict[str, int] = {}  # tokens of each request the proposer has seen
        self.draft_probs: dict[str, Any] = {}  # request id -> [num_drafts, vocab] tensor
        self.spec_stats = SpecDecodeStats(num_speculative_tokens)
        self.propose_time_s = 0.0
        self.adaptive = adaptive
        self._last_step_end: float | None = None

    @classmethod
    def from_stack(cls, config: LMKitConfig, stack: ResolvedStack,
                   vocab_size: int) -> ProposerManager | None:
        """The manager for the stack's proposer, or ``None`` when speculation is off.

        A runner-hosted proposer (``caps.features`` with ``"hidden_states"`` or
        ``"own_kv_cache"``) is built by the model runner, not here; under tensor
        parallelism every rank's runner holds the whole head and drafts the same tokens
        (it reads the replicated hidden states, the target's sharded embedding and LM
        head through their collectives, and samples drafts with the requests' seeded
        generators), and the engine takes rank 0's.
        """
        reg = stack.get("speculative")
        if reg is None:
            return None
        hosted = sorted(RUNNER_HOSTED_FEATURES & reg.spec.caps.features)
        proposer: SpecProposer | None = None
        if not hosted:  # a runner-hosted head is built by the model runner(s)
            proposer = build("speculative", reg.spec.load(), config,
                             options=stack.options["speculative"], plugin=reg.origin)
        k = config.speculative.num_speculative_tokens
        off_above = config.speculative.disable_by_batch_size
        adaptive = AdaptiveSpeculation() if config.speculative.adaptive else None
        logger.info("speculative decoding: proposer %s, %d draft tokens per step%s%s",
                    reg.name, k, f", off above {off_above} running requests" if off_above
                    else "", ", adaptive" if adaptive else "")
        manager = cls(proposer, reg.name, k, vocab_size, off_above, adaptive, reg.origin)
        if (tree := configured_tree(config.speculative)) is not None:  # positions: depths
            manager.spec_stats = SpecDecodeStats(k, tree.depths.tolist())
        return manager

    # ------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        """Track a request the engine accepted (only eligible ones are proposed for)."""
        self.requests[request.request_id] = request

    def remove_requests(self, request_ids: Iterable[str]) -> None:
        """Forget finished or aborted requests (unknown ids are ignored)."""
        ids = {rid for rid in request_ids if rid in self.requests}
        if not ids:
            return
        for rid in ids:
            del self.requests[rid]
            self._reset(rid)
        self._forget(ids)

    def _forget(self, ids: set[str]) -> None:
        """The proposer's ``remove_requests``; its failure is logged (the requests are
        gone either way, and drafts are only ever a guess)."""
        if self.proposer is None:
            return
        try:
            self.proposer.remove_requests(ids)
        except Exception as e:
            logger.error("%s", raised_in(self.label, e, f"forgetting {len(ids)} requests"),
                         exc_info=e)

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        """Forget aborted requests (:meth:`remove_requests`)."""
        self.remove_requests(request_ids)

    def _reset(self, rid: str) -> None:
        self.num_seen.pop(rid, None)
        self.draft_probs.pop(rid, None)

    @staticmethod
    def is_eligible(request: Request) -> bool:
        """Whether ``request`` may speculate: decoding, not opted out, and with two or more
        tokens still to generate (the last one needs no draft). Constrained requests
        speculate too: their grammar gives every draft position its own bitmask row, and
        the engine cuts their drafts to what the grammar allows."""
        params = request.sampling_params
        if request.status != RequestStatus.RUNNING or not params.use_spec_decode:
            return False
        if request.num_computed_tokens != request.num_tokens - 1:
            return False  # prefilling (or scheduled ahead)
        return request.max_tokens is None or request.num_output_tokens + 1 < request.max_tokens

    # ------------------------------------------------------------------ the step

    def after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        """Before execution: :meth:`before_execute`."""
        self.before_execute(scheduler_output)

    def after_model_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput,
                           outputs: list[EngineCoreOutput]) -> None:
        """After the scheduler's update: :meth:`after_step`; requests a proposer's
        fault failed go to :meth:`take_failed` (they get no drafts)."""
        try:
            self.after_step(scheduler_output, runner_output, outputs)
        except ProposalError as e:
            logger.error("%s", e, exc_info=e.__cause__)
            for rid, message in e.failed.items():
                request = self.requests.get(rid)
                if request is not None:
                    request.spec_token_ids = []
                    self._reset(rid)
                    self._failed.setdefault(rid, message)

    def take_failed(self) -> dict[str, str]:
        """Requests a proposer's fault failed since the last call, each with why."""
        failed, self._failed = self._failed, {}
        return failed

    def stats(self) -> dict[str, Any]:
        """:meth:`get_stats`."""
        return self.get_stats()

    def before_execute(self, scheduler_output: SchedulerOutput) -> None:
        """Tell the runner whether to draft after this step (adaptive speculation) and
        hand it the draft distributions of this step's scheduled drafts."""
        if self.adaptive is not None:
            scheduler_output.spec_drafting = self.adaptive.drafting()
        if not self.draft_probs:
            return
        for rid, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            probs = self.draft_probs.pop(rid, None)
            if probs is not None:
                scheduler_output.spec_draft_probs[rid] = probs[:len(drafts)]

    def after_step(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
                   outputs: list[EngineCoreOutput]) -> None:
        """Record the step's verifications, forget finished and preempted requests, and
        set new drafts on the requests that are still decoding."""
        self.spec_stats.record_step(runner_output.num_draft_tokens,
                                    runner_output.num_accepted_tokens)
        if self.adaptive is not None:
            self._record_adaptive(scheduler_output, outputs)
        # finished in the step, or outside it since the last one (aborts, refusals)
        finished = [o.request_id for o in outputs if o.finish_reason is not None]
        self.remove_requests([*finished, *scheduler_output.finished_req_ids])
        preempted = scheduler_output.preempted_req_ids & self.requests.keys()
        if preempted:  # their KV is gone: a proposer's per-request state must go too
            for rid in preempted:
                self._reset(rid)
            self._forget(set(preempted))
        eligible = (r for o in outputs if o.new_token_ids
                    and (r := self.requests.get(o.request_id)) is not None and self.is_eligible(r))
        limit = self.disable_by_batch_size
        off = limit is not None and len(scheduler_output.num_scheduled_tokens) > limit
        if off or not scheduler_output.spec_drafting:
            # the next step decodes plainly (the proposer catches up on the skipped
            # tokens at its next call: num_new_tokens); the first eligible request
            # counts the step, so a batch above the limit is not walked every step
            if next(eligible, None) is not None:
                self.num_steps_off += 1
            return
        batch = list(eligible)
        if not batch:
            return
        if self.proposer is None:
            self.take_runner_drafts(batch, runner_output.draft_token_ids)
        else:
            self.propose(batch)

    def take_runner_drafts(self, requests: list[Request],
                           drafts: dict[str, list[int]]) -> None:
        """Set the drafts a runner-hosted proposer made this step on ``requests``.

        Raises:
            ProposalError: the proposer drafted ids outside the vocabulary (the other
                requests keep their drafts).
        """
        ids = [r.request_id for r in requests]
        proposal = Proposal([drafts.get(rid, []) for rid in ids])
        checked = self._validate(proposal, ids)
        num_proposed = 0
        for request, draft in zip(requests, checked.drafts, strict=True):
            request.spec_token_ids = draft
            num_proposed += len(draft)
        self.spec_stats.record_proposals(num_proposed)
        self._raise_bad(checked.bad)

    def propose(self, requests: list[Request]) -> None:
        """Ask the proposer for drafts for ``requests`` and set their ``spec_token_ids``.

        Raises:
            ProposalError: the proposer raised or returned malformed drafts, naming the
                requests that fail (the others keep their drafts).
        """
        assert self.proposer is not None, "a runner-hosted proposer drafts in the runner"
        ids = [r.request_id for r in requests]
        tokens = [r.all_token_ids for r in requests]
        num_new = [len(t) - self.num_seen.get(rid, 0) for rid, t in zip(ids, tokens, strict=True)]
        started = time.perf_counter()
        try:
            proposal = self.proposer.propose(ProposerInput(ids, tokens, self.k, num_new))
        except Exception as e:
            message = raised_in(self.label, e, f"drafting for {len(ids)} requests")
            raise ProposalError(message, dict.fromkeys(ids, message)) from e
        finally:
            self.propose_time_s += time.perf_counter() - started
        checked = self._validate(proposal, ids)
        num_proposed = 0
        for i, (request, draft) in enumerate(zip(requests, checked.drafts, strict=True)):
            request.spec_token_ids = draft
            num_proposed += len(draft)
            self.num_seen[request.request_id] = len(tokens[i])
            if checked.probs[i] is not None and draft:
                self.draft_probs[request.request_id] = checked.probs[i]
            else:
                self.draft_probs.pop(request.request_id, None)
        self.spec_stats.record_proposals(num_proposed)
        self._raise_bad(checked.bad)

    def _validate(self, proposal: Proposal, ids: list[str]) -> CheckedProposal:
        checked = check_proposal(proposal, ids, self.k, self.vocab_size, self.label)
        if checked.longest > self.k and not self._warned_long:
            self._warned_long = True
            logger.warning("%s drafted %d tokens for a request, more than "
                           "num_speculative_tokens = %d; the ones past %d are dropped",
                           self.label, checked.longest, self.k, self.k)
        return checked

    def _raise_bad(self, bad: dict[str, str]) -> None:
        if bad:
            first = next(iter(bad.values()))
            more = f" (and {len(bad) - 1} more requests)" if len(bad) > 1 else ""
            raise ProposalError(first + more, bad)

    def _record_adaptive(self, so: SchedulerOutput, outputs: list[EngineCoreOutput]) -> None:
        """Give the adaptive switch this step if it was pure decode: its wall time since
        the previous step ended, its tokens, and whether it verified drafts."""
        assert self.adaptive is not None
        now = time.perf_counter()
        last, self._last_step_end = self._last_step_end, now
        spec = so.scheduled_spec_decode_tokens
        decode = not so.scheduled_new_reqs and all(
            n == 1 + len(spec.get(rid, ())) for rid, n in so.num_scheduled_tokens.items())
        if last is None or not decode or not so.num_scheduled_tokens:
            return  # (a step with prompt tokens, or after an idle engine: not comparable)
        self.adaptive.record(any(spec.values()), sum(len(o.new_token_ids) for o in outputs),
                             now - last)

    def get_stats(self) -> dict[str, Any]:
        """Counters for ``EngineCore.stats()`` (see :class:`SpecDecodeStats`), plus the
        time spent proposing and the adaptive switch's state."""
        out = self.spec_stats.as_dict()
        out["spec_propose_time_s"] = self.propose_time_s
        out["spec_num_steps_off"] = self.num_steps_off
        if self.adaptive is not None:
            out.update(self.adaptive.stats())
        return out


def check_runner_hosted(config: LMKitConfig, stack: ResolvedStack) -> None:
    """Refuse, before any model loads, what a runner-hosted proposer (a draft head)
    cannot run with: a KV offload tier under tensor parallelism. The tier carries the
    head's KV blocks beside the target's in one layout, and there each rank holds a
    share of the target's KV heads but all of the head's.

    :raises ConfigError: naming the settings to change.
    """
    reg = stack.get("speculative")
    tp = config.parallel.tensor_parallel_size
    if reg is None or tp == 1 or stack.get("offload") is None:
        return
    if RUNNER_HOSTED_FEATURES & reg.spec.caps.features:
        raise ConfigError(
            f"speculative proposer {reg.name!r} keeps a draft head's KV cache beside the "
            f"target's, and the KV offload tier carries both in one layout; under tensor "
            f"parallelism (parallel.tensor_parallel_size = {tp}) each rank holds 1/{tp} of "
            "the target's KV heads but all of the head's, so they cannot ride together: use "
            "--offload none, --tp 1, or a token-based proposer (--speculative ngram).")

"""Running the next speculative verification before the scheduler asks for it (CUDA
graphs, greedy, a draft head).

With a draft head (EAGLE) each step verifies the drafts the head made at the end of
the step before, and a step on a small target is otherwise serial: the GPU idles while
the host appends the tokens, checks stops, streams and schedules, then the host waits
while the GPU verifies and drafts. After a step in which every request sampled
greedily and the head gave each ``k`` drafts, the next step is known in the runner:
the same requests, each verifying its last token and its drafts at the positions after
its kept tokens. :class:`SpecLookahead` launches that verification right away (a
flattened replay of the decode graphs and the greedy argmax of its ``1 + k`` rows per
request, read back asynchronously), so the GPU runs it while the engine processes the
step before. When the scheduler's next step is that step -- or a subset of it, after
some requests finished -- the runner takes its result: each request's accepted drafts
(:func:`lmkit.sample.drafts.accept_greedy`, verify_greedy's walk, on the same argmax),
the head's catch-up and drafts, then the launch of the verification after it. Anything
else (a new or resumed request, drafts the scheduler cut, a grammar bitmask, offload
transfers, another position) discards the launched step, and the step runs normally.

The launched step writes the target's KV at its ``1 + k`` positions; the scheduler
reserves ``k + 1`` slots past each request's scheduled tokens
(:func:`spec_lookahead_slots`) so that those slots exist even when every draft of
the step before was accepted. A discarded step's writes lie past each request's
computed tokens and are rewritten before anything reads them (the same argument as
:mod:`lmkit.worker.gpu_lookahead`'s). ``LMKIT_SPEC_LOOKAHEAD=0`` turns it off.

Where the head's passes can run without the host (:class:`~lmkit.worker.
spec_device_step.DeviceSpecStep`), the launched verification is followed on the device
by the step after it -- accept, catch-up, drafts and the next verification -- so the host
only reads each step's decisions; taking one queues the next (``2 (k + 1)`` slots).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lmkit.api.runner_output import ModelRunnerOutput
from lmkit.api.spec_decode import RUNNER_HOSTED_FEATURES
from lmkit.platform import switched_off
from lmkit.sample.drafts import accept_greedy
from lmkit.sample.kernels import TorchSamplingKernels
from lmkit.worker.gpu_lookahead import LaunchAhead, decode_lookahead_slots, read_back
from lmkit.worker.input_batch import StepInputs
from lmkit.worker.spec_device_step import (
    DEFAULT_MAX_REQUESTS,
    DeviceSpecStep,
    DeviceStepResult,
    DeviceVerify,
)
from lmkit.worker.spec_device_step import ENV as DEVICE_STEP_ENV
from lmkit.worker.staging import StepStaging
from lmkit.worker.step_plan import commit_tokens, kept_positions, step_drafts

if TYPE_CHECKING:
    from lmkit.api import SamplingKernels
    from lmkit.api.scheduler_output import SchedulerOutput
    from lmkit.config.schema import LMKitConfig
    from lmkit.plugin_host.resolve import ResolvedStack
    from lmkit.sample.sampler import VerifiedTokens
    from lmkit.worker.cuda_graphs import CudaGraphRunner
    from lmkit.worker.draft_runner import DraftRunner
    from lmkit.worker.gpu_lookahead import DecodeLookahead
    from lmkit.worker.input_batch import CachedRequestState, InputBatch
    from lmkit.worker.step_plan import SamplingPlan

ENV = "LMKIT_SPEC_LOOKAHEAD"


@dataclass
class _PendingVerify:
    """A verification launched ahead: its requests, inputs and unread argmax."""

    req_ids: list[str]
    index: dict[str, int]
    start: np.ndarray  # int64 [n], each request's first verified position
    inputs: np.ndarray  # int64 [n, 1 + k]: its last token, then its drafts
    slots: np.ndarray  # int64 [n, 1 + k], where each position's KV went
    # int64 [n * (1 + k)], the (pinned) host copy of the argmax (None: ``after`` has it)
    targets: torch.Tensor | None
    ready: torch.cuda.Event | None  # recorded after the copy (None on the CPU: done)
    features: torch.Tensor  # [n * (1 + k), width], what the draft head reads
    after: DeviceStepResult | None = None  # the device step queued behind it


class SpecLookahead(LaunchAhead):
    """Launches predicted verification steps for a model runner with a draft head.

    Args:
        graphs: the runner's decode graphs (verification replays them flattened).
        model: the runner's model (its LM head gives the launched step's argmax).
        input_batch: the runner's persistent batch; a taken step commits its tokens there.
        requests: the runner's per-request states by id (same objects, kept current).
        max_model_len: no step is launched past this position.
        drafter: the runner's draft head: it catches up and drafts after a taken step.
        disable_by_batch_size: ``speculative.disable_by_batch_size`` (no drafts above it).
        device_step_max_requests: ``speculative.device_step_max_requests`` (the most
            requests of a step queued on the device, :mod:`lmkit.worker.spec_device_step`).
        kernels: the engine's sampling kernels (the verifications' argmax, the device
            steps' bookkeeping).
    """

    def __init__(self, graphs: CudaGraphRunner, model: Any, input_batch: InputBatch,
                 requests: dict[str, CachedRequestState], max_model_len: int,
                 drafter: DraftRunner, disable_by_batch_size: int | None = None,
                 device_step_max_requests: int = DEFAULT_MAX_REQUESTS,
                 kernels: SamplingKernels | None = None) -> None:
        super().__init__(graphs, model, input_batch, requests, max_model_len, drafter)
        self.drafter: DraftRunner = drafter
        self.k = drafter.k
        self.disable_by_batch_size = disable_by_batch_size
        self.pending: _PendingVerify | None = None
        self.kernels = kernels if kernels is not None else TorchSamplingKernels(device=None)
        self.device_step = DeviceSpecStep.maybe(graphs, model, drafter,
                                                device_step_max_requests, self.kernels)
        self.staging = StepStaging(graphs.device)  # a device step's tables and inputs
        self._continued = False  # take() queued the next verification itself

    @classmethod
    def maybe(cls, config: LMKitConfig, stack: ResolvedStack, graphs: CudaGraphRunner | None,
              model: Any, input_batch: InputBatch, requests: dict[str, CachedRequestState],
              max_model_len: int, drafter: DraftRunner | None,
              kernels: SamplingKernels | None = None) -> SpecLookahead | None:
        """A lookahead when a draft head runs beside replayed decode graphs and
        :func:`spec_lookahead_slots` reserves its slots (``kernels``: as for the class)."""
        if graphs is None or drafter is None or not spec_lookahead_slots(config, stack):
            return None
        return cls(graphs, model, input_batch, requests, max_model_len, drafter,
                   config.speculative.disable_by_batch_size,
                   config.speculative.device_step_max_requests, kernels)

    # ------------------------------------------------------------------ launching

    def after_step(self, so: SchedulerOutput, order: list[str],
                   drafts: dict[str, list[int]]) -> None:
        """After a step (run normally or taken): launch the verification of ``drafts``
        if it is predictable -- every request of the step got ``k`` drafts, samples
        greedily and has the slots of its ``1 + k`` positions."""
        if self._continued:  # the taken step's device step queued it already
            self._continued = False
            return
        self.pending = None
        n, k = len(order), self.k
        if (not n or n * (1 + k) > self.graphs.max_bs or so.grammar_bitmask is not None
                or so.kv_transfers or any(len(drafts.get(r, ())) != k for r in order)
                or not self._predictable(order)):
            return
        batch = self.input_batch
        rows = np.fromiter((batch.row_of[r] for r in order), dtype=np.int64, count=n)
        start = batch.num_tokens[rows] - 1  # every token but the last is computed
        last = start + k
        if not (np.all(last // batch.block_size < batch.num_blocks[rows])
                and np.all(last < self.max_model_len)):
            return
        self._launch(order, rows, start, np.array([drafts[r] for r in order], dtype=np.int64))

    def _positions(self, rows: np.ndarray, start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ``1 + k`` positions from ``start`` of each of the batch ``rows`` and their
        cache slots, ``[n, 1 + k]`` each."""
        batch = self.input_batch
        bs = batch.block_size
        positions = start[:, None] + np.arange(1 + self.k)
        slots = (np.take_along_axis(batch.block_table[rows], positions // bs, axis=1)
                 .astype(np.int64) * bs + positions % bs)
        return positions, slots

    def _launch(self, order: list[str], rows: np.ndarray, start: np.ndarray,
                drafts: np.ndarray) -> None:
        """Replay the flattened verification of ``drafts`` for ``order`` and queue its
        greedy argmax's copy to the host."""
        batch = self.input_batch
        bs, width = batch.block_size, 1 + self.k
        inputs = np.concatenate([batch.token_ids[rows, start][:, None], drafts], axis=1)
        positions, slots = self._positions(rows, start)
        seq_lens = (positions + 1).astype(np.int32).reshape(-1)
        blocks = -(-int(seq_lens.max()) // bs)
        if blocks > self.graphs.max_blocks:
            return
        tables = np.repeat(batch.block_table[rows, :blocks], width, axis=0)
        aux: list[torch.Tensor] | None = [] if self.drafter.proposer.target_layers else None
        graphs = self.graphs
        graphs.num_replays += 1
        graphs.num_flattened_replays += 1
        with torch.inference_mode():
            hidden = graphs.run_decode(inputs.reshape(-1), positions.reshape(-1),
                                       slots.reshape(-1), seq_lens, tables, aux=aux)
            # what the head reads, kept past the graph's next replay
            features = hidden.clone() if aux is None else torch.cat(aux, dim=-1)
            # the first maximal index, as verify_greedy takes it (accepted in take())
            targets = self.kernels.argmax(self.model.compute_greedy_logits(hidden))
            step_tables = self._step_tables(order, rows, start)
            after = None
            if step_tables is not None:
                assert self.device_step is not None
                put = self.staging.put
                after = self.device_step.step(
                    DeviceVerify(put(inputs), put(positions), put(slots), features, targets),
                    step_tables)
        self._pend(order, start, inputs, slots, targets, features, after)

    def _pend(self, order: list[str], start: np.ndarray, inputs: np.ndarray,
              slots: np.ndarray, targets: torch.Tensor, features: torch.Tensor,
              after: DeviceStepResult | None) -> None:
        """Hold the verification just queued until the scheduler asks for it; its argmax
        is read back with the device step queued behind it, if any, else on its own."""
        host, ready = (None, None) if after is not None else read_back(targets)
        self.pending = _PendingVerify(list(order), {r: i for i, r in enumerate(order)},
                                      start, inputs, slots, host, ready, features, after)
        self.stats.launched += 1

    def _step_tables(self, order: list[str], rows: np.ndarray,
                     start: np.ndarray) -> torch.Tensor | None:
        """The requests' block tables on the device (int32) when a device step can follow
        their verification from ``start`` (:meth:`DeviceSpecStep.fits`, the head drafts
        for every one of them), else ``None``. Starts the step's staging."""
        step, drafter = self.device_step, self.drafter
        n = len(order)
        if (step is None or drafter.sits_out(n) or not drafter.stale.isdisjoint(order)
                or not step_drafts(n, self.disable_by_batch_size, True)):
            return None
        batch = self.input_batch
        bs = batch.block_size
        capacity = np.minimum(batch.num_blocks[rows] * bs, self.max_model_len)
        blocks = min(batch.block_table.shape[1], -(-(int(start.max()) + 2 * self.k + 2) // bs))
        if not step.fits(n, start, capacity, blocks):
            return None
        self.staging.begin()
        return self.staging.put(batch.block_table[rows, :blocks], torch.int32)

    # ------------------------------------------------------------------ taking

    def take(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """The output of ``so`` if it is (a subset of) the verification launched ahead:
        commits its accepted tokens and runs the head's catch-up and drafts. ``None``:
        run ``so`` normally. Call after the runner applied ``so``'s state changes, then
        :meth:`after_step` with the output's drafts."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        order = list(so.num_scheduled_tokens)
        if not self._matches(so, order, pending):
            self.stats.discarded += 1
            return None
        self.stats.used += 1
        width = 1 + self.k
        idx = np.fromiter((pending.index[r] for r in order), dtype=np.int64, count=len(order))
        if pending.after is not None:
            return self._take_device_step(so, order, idx, pending, pending.after)
        assert pending.targets is not None
        if pending.ready is not None:
            pending.ready.synchronize()
        targets = pending.targets.numpy().reshape(-1, width)[idx]
        out, verified, plan = self._commit(order, pending.inputs[idx, 1:].tolist(), targets)
        step = verify_step_inputs(self.input_batch, order, pending.start[idx],
                                  pending.inputs[idx], pending.slots[idx])
        features = pending.features
        if not np.array_equal(idx, np.arange(len(pending.req_ids))):
            flat = (idx[:, None] * width + np.arange(width)).reshape(-1)
            features = features[torch.from_numpy(flat).to(features.device)]
        kept, drafting = kept_positions(order, step, plan, verified.num_accepted, self.requests,
                                        self.disable_by_batch_size, so.spec_drafting)
        with torch.inference_mode():
            new = self.drafter.propose(features, step, kept, drafting)
        out.draft_token_ids = {order[i]: d for i, d in new.items()}
        return out

    def _commit(self, order: list[str], drafts: list[list[int]], targets: np.ndarray
                ) -> tuple[ModelRunnerOutput, VerifiedTokens, SamplingPlan]:
        """Accept each request's ``drafts`` against the verification's argmax
        (``targets`` ``[n, 1 + k]``, verify_greedy's walk) and commit the tokens; the
        step's output, the verified tokens and the sampling plan."""
        width = 1 + self.k
        verified = accept_greedy(targets.ravel().tolist(), drafts)
        plan = [(i, i * width, d) for i, d in enumerate(drafts)]
        out = commit_tokens(order, plan, verified, {}, self.requests, self.input_batch)
        return out, verified, plan

    def _take_device_step(self, so: SchedulerOutput, order: list[str], idx: np.ndarray,
                          pending: _PendingVerify, after: DeviceStepResult
                          ) -> ModelRunnerOutput:
        """:meth:`take` of a verification whose device step is queued: the head caught up
        and drafted on the device; commit the accepted tokens, hand out the drafts, and
        queue the device step after the next verification (already running) when the
        same requests all draft again."""
        width = 1 + self.k
        self.stats.stepped += 1
        if after.ready is not None:
            after.ready.synchronize()
        decided = after.host.numpy()[idx]  # [n, (1 + k) + 1 + k]
        out, verified, _ = self._commit(order, pending.inputs[idx, 1:].tolist(),
                                        decided[:, :width])
        if list(verified.num_accepted) != decided[:, width].tolist():
            raise RuntimeError("the device step accepted other drafts than the host's walk: "
                               f"{decided[:, width].tolist()} vs {verified.num_accepted}")
        # every request sampled (a verification): each drafts unless the step may not
        # or it opted out, as kept_positions decides after a normally run step
        draft = step_drafts(len(order), self.disable_by_batch_size, so.spec_drafting)
        got = [i for i, r in enumerate(order)
               if draft and self.requests[r].sampling_params.use_spec_decode]
        new = decided[:, width + 1:]
        out.draft_token_ids = {order[i]: new[i].tolist() for i in got}
        self.drafter.sampled.keep(self.input_batch.row_of, [order[i] for i in got],
                                  [new[i].tolist() for i in got], {})
        if len(got) == len(order) and np.array_equal(idx, np.arange(len(pending.req_ids))):
            accepted = np.asarray(verified.num_accepted, dtype=np.int64)
            bonus = decided[np.arange(len(order)), accepted]  # the argmax after the last kept
            self._continue(order, pending.start + accepted + 1,
                           np.concatenate([bonus[:, None], new], axis=1), after.verify)
        return out

    def _continue(self, order: list[str], start: np.ndarray, inputs: np.ndarray,
                  verify: DeviceVerify) -> None:
        """Hold ``verify`` (queued by the device step just taken: ``inputs`` from
        ``start``) as the next launched verification, with the device step after it
        when that fits."""
        if not self._predictable(order):
            return  # (after_step finds so too)
        batch = self.input_batch
        rows = np.fromiter((batch.row_of[r] for r in order), dtype=np.int64, count=len(order))
        _, slots = self._positions(rows, start)
        tables = self._step_tables(order, rows, start)
        with torch.inference_mode():
            assert self.device_step is not None
            after = self.device_step.step(verify, tables) if tables is not None else None
        self._pend(order, start, inputs, slots, verify.targets, verify.features, after)
        self._continued = True

    def _matches(self, so: SchedulerOutput, order: list[str], pending: _PendingVerify) -> bool:
        """``so`` verifies, for requests launched ahead, the same drafts at the same
        positions, and nothing else runs in it."""
        if (not order or so.scheduled_new_reqs or so.grammar_bitmask is not None
                or so.kv_transfers):
            return False
        cached = so.scheduled_cached_reqs
        if len(cached.req_ids) != len(order):
            return False
        spec = so.scheduled_spec_decode_tokens
        width = 1 + self.k
        for rid, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            i = pending.index.get(rid)
            if (i is None or int(pending.start[i]) != computed
                    or so.num_scheduled_tokens[rid] != width
                    or list(spec.get(rid, ())) != pending.inputs[i, 1:].tolist()):
                return False
        return True


def take_ahead(decode: DecodeLookahead | None, spec: SpecLookahead | None,
               so: SchedulerOutput) -> ModelRunnerOutput | None:
    """``so``'s output when it is the decode step (``decode``) or the verification
    (``spec``) launched ahead, with the next verification launched when its drafts
    allow; else ``None``: run ``so`` normally."""
    ahead = decode.take(so) if decode is not None else None
    if ahead is None and spec is not None:
        ahead = spec.take(so)
    if ahead is not None and spec is not None:
        spec.after_step(so, list(so.num_scheduled_tokens), ahead.draft_token_ids)
    return ahead


def verify_step_inputs(batch: InputBatch, order: list[str], start: np.ndarray,
                       inputs: np.ndarray, slots: np.ndarray) -> StepInputs:
    """The :class:`~lmkit.worker.input_batch.StepInputs` of a verification step of
    ``order``: ``inputs`` ``[n, width]`` (each request's last token and its drafts) at
    the positions from ``start``, written to ``slots`` ``[n, width]``, as the runner
    would have packed it (host tensors)."""
    n, width = inputs.shape
    rows = np.fromiter((batch.row_of[r] for r in order), dtype=np.int64, count=n)
    positions = start[:, None] + np.arange(width)
    seq_lens = (start + width).astype(np.int32)
    blocks = int(-(-int(seq_lens.max()) // batch.block_size))
    return StepInputs(
        rows=rows, num_scheduled=np.full(n, width, dtype=np.int64),
        cu_num_tokens=np.arange(1, n + 1, dtype=np.int64) * width, num_computed=start,
        input_ids=torch.from_numpy(inputs.reshape(-1).astype(np.int64)),
        positions=torch.from_numpy(positions.reshape(-1).astype(np.int64)),
        slot_mapping=torch.from_numpy(slots.reshape(-1).astype(np.int64)),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32) * width,
        seq_lens=torch.from_numpy(seq_lens),
        block_tables=torch.from_numpy(np.ascontiguousarray(batch.block_table[rows, :blocks])),
        num_decodes=0)


def spec_lookahead_slots(config: LMKitConfig, stack: ResolvedStack) -> int:
    """KV slots per request the scheduler must reserve past the scheduled tokens for
    the runner to launch verifications ahead: ``k + 1`` with a draft head drafting chains
    where decode steps can be launched ahead (:func:`~lmkit.worker.gpu_lookahead.
    decode_lookahead_slots`) and ``LMKIT_SPEC_LOOKAHEAD`` is not ``0`` -- ``2 (k + 1)``
    unless ``LMKIT_SPEC_DEVICE_STEP`` is ``0`` (a device step writes up to ``2k + 1``
    positions past the first it verifies) --, else 0 (draft trees' verifications are not
    launched ahead)."""
    reg = stack.get("speculative")
    k = config.speculative.num_speculative_tokens
    if (switched_off(ENV) or reg is None or not RUNNER_HOSTED_FEATURES & reg.spec.caps.features
            or k < 1 or config.speculative.tree or not decode_lookahead_slots(config, stack)):
        return 0
    return k + 1 if switched_off(DEVICE_STEP_ENV) else 2 * (k + 1)

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
from lmkit.worker.gpu_lookahead import (
    LaunchAhead,
    decode_lookahead_slots,
    greedy_plain,
    read_back,
)
from lmkit.worker.input_batch import StepInputs
from lmkit.worker.step_plan import commit_tokens, kept_positions

if TYPE_CHECKING:
    from lmkit.api.scheduler_output import SchedulerOutput
    from lmkit.config.schema import LMKitConfig
    from lmkit.plugin_host.resolve import ResolvedStack
    from lmkit.worker.cuda_graphs import CudaGraphRunner
    from lmkit.worker.draft_runner import DraftRunner
    from lmkit.worker.gpu_lookahead import DecodeLookahead
    from lmkit.worker.input_batch import CachedRequestState, InputBatch

ENV = "LMKIT_SPEC_LOOKAHEAD"


@dataclass
class _PendingVerify:
    """A verification launched ahead: its requests, inputs and unread argmax."""

    req_ids: list[str]
    index: dict[str, int]
    start: np.ndarray  # int64 [n], each request's first verified position
    inputs: np.ndarray  # int64 [n, 1 + k]: its last token, then its drafts
    slots: np.ndarray  # int64 [n, 1 + k], where each position's KV went
    targets: torch.Tensor  # int64 [n * (1 + k)], the (pinned) host copy of the argmax
    ready: torch.cuda.Event | None  # recorded after the copy (None on the CPU: done)
    features: torch.Tensor  # [n * (1 + k), width], what the draft head reads


class SpecLookahead(LaunchAhead):
    """Launches predicted verification steps for a model runner with a draft head.

    Args:
        graphs: the runner's decode graphs (verification replays them flattened).
        model: the runner's model (its LM head gives the launched step's argmax).
        input_batch: the runner's persistent batch; a taken step commits its tokens there.
        requests: the runner's per-request states by id (same objects, kept current).
        max_model_len: no step is launched past this position.
        drafter: the runner's draft head: it catches up and drafts after a taken step.
        disable_by_batch_size: ``speculative.disable_by_batch_size`` (drafting stops
            above it, as after a normally run step).
    """

    def __init__(self, graphs: CudaGraphRunner, model: Any, input_batch: InputBatch,
                 requests: dict[str, CachedRequestState], max_model_len: int,
                 drafter: DraftRunner, disable_by_batch_size: int | None = None) -> None:
        super().__init__(graphs, model, input_batch, requests, max_model_len, drafter)
        self.drafter: DraftRunner = drafter
        self.k = drafter.k
        self.disable_by_batch_size = disable_by_batch_size
        self.pending: _PendingVerify | None = None

    @classmethod
    def maybe(cls, config: LMKitConfig, stack: ResolvedStack, graphs: CudaGraphRunner | None,
              model: Any, input_batch: InputBatch, requests: dict[str, CachedRequestState],
              max_model_len: int, drafter: DraftRunner | None) -> SpecLookahead | None:
        """A lookahead when a draft head runs beside replayed decode graphs and
        :func:`spec_lookahead_slots` reserves its slots."""
        if graphs is None or drafter is None or not spec_lookahead_slots(config, stack):
            return None
        return cls(graphs, model, input_batch, requests, max_model_len, drafter,
                   config.speculative.disable_by_batch_size)

    # ------------------------------------------------------------------ launching

    def after_step(self, so: SchedulerOutput, order: list[str],
                   drafts: dict[str, list[int]]) -> None:
        """After a step (run normally or taken): launch the verification of ``drafts``
        if it is predictable -- every request of the step got ``k`` drafts, samples
        greedily and has the slots of its ``1 + k`` positions."""
        self.pending = None
        n, k = len(order), self.k
        if (not n or n * (1 + k) > self.graphs.max_bs or so.grammar_bitmask is not None
                or so.kv_transfers or any(len(drafts.get(r, ())) != k for r in order)):
            return
        requests = self.requests
        for rid in order:
            state = requests[rid]
            if state.prompt_logprobs is not None or not greedy_plain(
                    state.sampling_params, len(state.output_token_ids)):
                return
        batch = self.input_batch
        rows = np.fromiter((batch.row_of[r] for r in order), dtype=np.int64, count=n)
        start = batch.num_tokens[rows] - 1  # every token but the last is computed
        last = start + k
        if not (np.all(last // batch.block_size < batch.num_blocks[rows])
                and np.all(last < self.max_model_len)):
            return
        self._launch(order, rows, start, np.array([drafts[r] for r in order], dtype=np.int64))

    def _launch(self, order: list[str], rows: np.ndarray, start: np.ndarray,
                drafts: np.ndarray) -> None:
        """Replay the flattened verification of ``drafts`` for ``order`` and queue its
        greedy argmax's copy to the host."""
        batch = self.input_batch
        bs, width = batch.block_size, 1 + self.k
        inputs = np.concatenate([batch.token_ids[rows, start][:, None], drafts], axis=1)
        positions = start[:, None] + np.arange(width)
        slots = (np.take_along_axis(batch.block_table[rows], positions // bs, axis=1)
                 .astype(np.int64) * bs + positions % bs)
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
            # first maximal index, as verify_greedy takes it (accepted in take())
            targets = self.model.compute_logits(hidden).max(dim=-1).indices
            host, ready = read_back(targets)
        self.pending = _PendingVerify(list(order), {r: i for i, r in enumerate(order)},
                                      start, inputs, slots, host, ready, features)
        self.stats.launched += 1

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
        if pending.ready is not None:
            pending.ready.synchronize()
        drafts = pending.inputs[idx, 1:].tolist()
        verified = accept_greedy(pending.targets.numpy().reshape(-1, width)[idx].ravel().tolist(),
                                 drafts)
        plan = [(i, i * width, d) for i, d in enumerate(drafts)]
        batch = self.input_batch
        out = commit_tokens(order, plan, verified, {}, self.requests, batch)
        step = verify_step_inputs(batch, order, pending.start[idx], pending.inputs[idx],
                                  pending.slots[idx])
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
    the runner to launch verifications ahead: ``k + 1`` with a draft head where decode
    steps can be launched ahead (:func:`~lmkit.worker.gpu_lookahead.
    decode_lookahead_slots`) and ``LMKIT_SPEC_LOOKAHEAD`` is not ``0``, else 0."""
    reg = stack.get("speculative")
    k = config.speculative.num_speculative_tokens
    if (switched_off(ENV) or reg is None or not RUNNER_HOSTED_FEATURES & reg.spec.caps.features
            or k < 1 or not decode_lookahead_slots(config, stack)):
        return 0
    return k + 1

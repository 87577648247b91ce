"""Running the next decode step before the scheduler asks for it (CUDA graphs, greedy).

A decode step's host work -- scheduling, appending tokens and stop checks, packing
the next inputs -- leaves the GPU idle between steps unless the next step is already
queued. After a pure-decode step in which every request sampled one token greedily,
the next step is predictable: the same requests, one token each, at the next
position, with the tokens just sampled as inputs. :class:`DecodeLookahead` launches
that step right away (graph replay + greedy sampling, no host sync), so the GPU runs
it while the engine processes the step before. When the scheduler's next step is
that step -- or a subset of it, e.g. after some requests finished -- the runner takes
its results instead of running it again, and launches the one after, feeding the
still-unread sampled tokens on the device straight into the graph's inputs. Anything
else (a new or resumed request, draft tokens, a grammar bitmask, offload transfers,
a request at another position) discards the prediction and the step runs normally.

With a draft head (EAGLE) the lookahead runs only where speculation is off -- by batch
size (``speculative.disable_by_batch_size``), or while adaptive speculation holds it
off (``speculative.adaptive``, the step's ``spec_drafting``): after a step whose head
drafted nothing, the next step is a plain decode step and is launched ahead like any
other; the head's catch-up over the features it reads (the final hidden states, or the
inputs of its target layers) is queued right behind the launched step
(:mod:`lmkit.worker.launch_catch_up`; else taking the step runs it,
:meth:`~lmkit.worker.draft_runner.DraftRunner.propose`), so the head's KV cache has no
holes when the batch shrinks and speculation resumes.

A request is predicted only when its next cache slot is already allocated (its
block table covers the next position) and it samples greedily without logprobs,
penalties, logit bias, a pending ``min_tokens`` or structured output, so that the
speculative step computes exactly what the normal path would -- or, with the runner's
sampler given (:class:`DecodeLookahead`), samples as :func:`samples_ahead` allows:
greedily or at random, with temperature, top-k, top-p, min-p, a seed, penalties,
logit bias and allowed ids, but no logprobs, bad words, logits processors, pending
``min_tokens`` or grammar. The launched step draws its token with the same sampler and
the request's kept tensors (:mod:`lmkit.sample.row_cache`), its penalty counts plus the
token the step before drew, still unread on the device; a launched step that is not
taken only wastes a draw, and a seeded request's generator is rewound to its state
before that draw (:meth:`_Pending.rewind`), so the step it runs instead draws what it
would have without the lookahead. Its KV write lands in
the request's own, not yet full block: if the request finished meanwhile the slot is
rewritten by whoever gets the block before it is read. The engine has the scheduler
reserve one slot past each request's scheduled tokens (:func:`decode_lookahead_slots`),
so that the next slot is there even when the next token starts a new block.
``LMKIT_DECODE_LOOKAHEAD=0`` turns it off.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lmkit.api.runner_output import ModelRunnerOutput
from lmkit.platform import switched_off
from lmkit.worker import launch_catch_up
from lmkit.worker.graph_stream import record_event
from lmkit.worker.input_batch import StepInputs
from lmkit.worker.lookahead_sampling import draw_ahead, greedy_plain, samples_ahead

if TYPE_CHECKING:
    from lmkit.api.scheduler_output import SchedulerOutput
    from lmkit.config.schema import LMKitConfig
    from lmkit.plugin_host.resolve import ResolvedStack
    from lmkit.sample.sampler import Sampler
    from lmkit.worker.cuda_graphs import CudaGraphRunner
    from lmkit.worker.draft_runner import DraftRunner
    from lmkit.worker.input_batch import CachedRequestState, InputBatch


@dataclass
class _Pending:
    """A decode step launched ahead: its requests, positions and unread tokens."""

    req_ids: list[str]
    index: dict[str, int]
    positions: np.ndarray  # int64 [n], the position each request computes
    tokens: torch.Tensor  # int64 [n] on the device, sampled greedily
    host_tokens: torch.Tensor  # int64 [n], their (pinned) host copy, valid once ``ready``
    ready: torch.cuda.Event | None  # recorded after the copy (None on the CPU: done)
    slots: np.ndarray | None = None  # int64 [n], the cache slot each request wrote (drafter)
    features: torch.Tensor | None = None  # [n, width], what the draft head reads (drafter)
    # seeded requests' generators and their states before the launched draw: rewound
    # for the requests whose launched step is not taken
    rng_states: dict[str, tuple[torch.Generator, torch.Tensor]] = field(default_factory=dict)
    caught_up: bool = False  # the head's catch-up over it was queued at the launch

    def rewind(self, keep: Collection[str] = ()) -> None:
        """Put back the generators of the requests not in ``keep`` as they were before
        the launched draw, so that the step they run instead draws what it would have."""
        for rid, (generator, state) in self.rng_states.items():
            if rid not in keep:
                generator.set_state(state)


@dataclass
class LookaheadStats:
    """How often predicted steps were launched and used."""

    launched: int = 0
    used: int = 0
    discarded: int = 0
    stepped: int = 0  # used verifications whose device step (accept, drafts) was queued


class LaunchAhead:
    """What a lookahead holds of its model runner (shared by the decode steps' and the
    verifications' lookaheads): its decode graphs, model, persistent batch, request
    states, context limit and draft head (or ``None``), and the launch counters."""

    def __init__(self, graphs: CudaGraphRunner, model: Any, input_batch: InputBatch,
                 requests: dict[str, CachedRequestState], max_model_len: int,
                 drafter: DraftRunner | None, sampler: Sampler | None = None) -> None:
        self.graphs = graphs
        self.model = model
        self.input_batch = input_batch
        self.requests = requests
        self.max_model_len = max_model_len
        self.drafter = drafter
        self.sampler = sampler  # None: greedy requests only
        self.stats = LookaheadStats()

    def _predictable(self, order: list[str]) -> bool:
        """Every request samples greedily as a launched argmax does (no logprobs,
        penalties, pending ``min_tokens`` or grammar), or, with a sampler, as
        :func:`~lmkit.worker.lookahead_sampling.samples_ahead` allows."""
        requests, sampler = self.requests, self.sampler
        return all(s.prompt_logprobs is None and (
            greedy_plain(s.sampling_params, len(s.output_token_ids))
            or (sampler is not None and samples_ahead(s.sampling_params,
                                                      len(s.output_token_ids))))
            for s in (requests[r] for r in order))


class DecodeLookahead(LaunchAhead):
    """Launches predicted decode steps for a model runner with CUDA graphs.

    Args:
        graphs: the runner's decode graphs (they run the launched steps).
        model: the runner's model (its LM head picks the launched steps' tokens).
        input_batch: the runner's persistent batch (token ids, block tables, positions);
            a step taken from the lookahead appends its tokens there.
        requests: the runner's per-request states by id (same objects, kept current).
        max_model_len: no step is launched past this position.
        drafter: the runner's draft head, if any: steps are then launched ahead only
            where the head drafts nothing -- batches of more than ``min_batch``
            requests, or a step whose plan turns drafting off (``spec_drafting``) --
            and the head's catch-up over each is queued at its launch (or run when it
            is taken).
        min_batch: see ``drafter`` (``speculative.disable_by_batch_size``, else
            ``scheduler.max_num_seqs`` with ``speculative.adaptive``).
    """

    def __init__(self, graphs: CudaGraphRunner, model: Any, input_batch: InputBatch,
                 requests: dict[str, CachedRequestState], max_model_len: int,
                 drafter: DraftRunner | None = None, min_batch: int = 0,
                 sampler: Sampler | None = None) -> None:
        super().__init__(graphs, model, input_batch, requests, max_model_len, drafter, sampler)
        self.min_batch = min_batch if drafter is not None else 0
        self.launch_catch_ups = launch_catch_up.enabled()  # the head's, at the launch
        self.pending: _Pending | None = None

    @classmethod
    def maybe(cls, config: LMKitConfig, stack: ResolvedStack, graphs: CudaGraphRunner | None,
              model: Any, input_batch: InputBatch, requests: dict[str, CachedRequestState],
              max_model_len: int, drafter: DraftRunner | None = None,
              sampler: Sampler | None = None) -> DecodeLookahead | None:
        """A lookahead when decode graphs are replayed and
        :func:`decode_lookahead_slots` reserves its slot (no offload tier, not off);
        with a draft head only when speculation can be off (``speculative.
        disable_by_batch_size`` set, or ``speculative.adaptive``)."""
        if graphs is None or not decode_lookahead_slots(config, stack):
            return None
        if drafter is None:
            return cls(graphs, model, input_batch, requests, max_model_len, sampler=sampler)
        limit = config.speculative.disable_by_batch_size
        if limit is None and not config.speculative.adaptive:
            return None  # the head drafts after every step: nothing to predict
        if limit is None:  # only the adaptive switch turns drafting off
            limit = config.scheduler.max_num_seqs
        return cls(graphs, model, input_batch, requests, max_model_len, drafter, limit, sampler)

    # ------------------------------------------------------------------ launching

    def after_step(self, so: SchedulerOutput, order: list[str], step: StepInputs,
                   drafted: bool = False) -> None:
        """After a normally run step: launch the next decode step if it is predictable
        (not after a step whose draft head ``drafted``: the next one verifies)."""
        if self.pending is not None:  # (take() hands every launched step on or rewinds it)
            self.pending.rewind()
        self.pending = None
        n = len(order)
        if not (n and step.num_decodes == n and step.num_tokens == n and _plain(so)):
            return
        if drafted or self._head_drafts(order, so):
            return
        batch = self.input_batch
        rows = np.fromiter((batch.row_of[r] for r in order), dtype=np.int64, count=n)
        # each request got exactly one token: its next input is known
        if not np.array_equal(batch.num_tokens[rows], batch.num_computed[rows] + 2):
            return
        if self._launchable(order, rows):
            self._launch(order, rows, None)

    def take(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """The output of ``so`` if it is (a subset of) the step launched ahead: commits
        its tokens and launches the following step first. ``None``: run ``so`` normally.

        Call after the runner applied ``so``'s state changes (finished requests, blocks).
        """
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        order = list(so.num_scheduled_tokens)
        if not self._matches(so, order, pending):
            pending.rewind()
            self._count("discarded")
            return None
        self._count("used")
        pending.rewind(keep=set(order))  # requests that left (finished, preempted) rewind
        idx = [pending.index[r] for r in order]
        tokens = pending.tokens
        if idx != list(range(len(pending.req_ids))):
            tokens = tokens[torch.tensor(idx, dtype=torch.int64).to(tokens.device,
                                                                    non_blocking=True)]
        batch = self.input_batch
        rows = np.fromiter((batch.row_of[r] for r in order), dtype=np.int64, count=len(order))
        head_drafts = self._head_drafts(order, so)
        if not head_drafts and self._launchable(order, rows):
            self._launch(order, rows, tokens)  # queued before this step's tokens are read
        if pending.ready is not None:
            pending.ready.synchronize()  # this step's tokens only, not the one just queued
        host = pending.host_tokens.tolist()
        sampled = [host[i] for i in idx]
        requests = self.requests
        for rid, row, token in zip(order, rows.tolist(), sampled, strict=True):
            requests[rid].output_token_ids.append(token)
            batch.append_tokens(row, [token])
        out = ModelRunnerOutput(req_ids=order, sampled_token_ids=[[t] for t in sampled])
        if self.drafter is not None:
            out.draft_token_ids = self._catch_up(order, rows, pending, idx, head_drafts)
        return out

    def _catch_up(self, order: list[str], rows: np.ndarray, pending: _Pending,
                  idx: list[int], head_drafts: bool) -> dict[str, list[int]]:
        """The draft head's pass over a taken step (one position per request, its
        features kept at launch); drafts where ``head_drafts`` (the batch is small enough
        to speculate and the step's plan lets it)."""
        assert self.drafter is not None and pending.slots is not None
        if pending.features is None:  # launched as a step the head sits out
            self.drafter.stale.update(order)
            return {}
        if pending.caught_up and not head_drafts:  # nothing left to do for the head
            return {}
        n = len(order)
        features = pending.features
        if idx != list(range(len(pending.req_ids))):
            features = features[torch.tensor(idx, dtype=torch.int64).to(features.device)]
        positions = pending.positions[idx]
        step = decode_step_inputs(rows, positions, pending.slots[idx], self.input_batch)
        drafting = np.array([head_drafts and self.requests[r].sampling_params.use_spec_decode
                             for r in order], dtype=bool)
        with torch.inference_mode():
            drafts = self.drafter.propose(features, step, np.ones(n, dtype=np.int64), drafting)
        return {order[i]: d for i, d in drafts.items()}

    def _head_drafts(self, order: list[str], so: SchedulerOutput) -> bool:
        """Whether the draft head drafts after a step of ``order`` (then the next step
        verifies, and is not launched ahead): the batch is small enough to speculate,
        the step's plan lets it, and the head has not left all of ``order`` for good
        (requests that ran above the limit with ``catch_up_when_off`` false)."""
        return (self.drafter is not None and len(order) <= self.min_batch
                and so.spec_drafting and not _head_left(self.drafter, order))

    def _matches(self, so: SchedulerOutput, order: list[str], pending: _Pending) -> bool:
        if not order or so.scheduled_new_reqs or not _plain(so):
            return False
        if any(n != 1 for n in so.num_scheduled_tokens.values()):
            return False
        cached = so.scheduled_cached_reqs
        if len(cached.req_ids) != len(order):
            return False
        for rid, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            i = pending.index.get(rid)
            if i is None or int(pending.positions[i]) != computed:
                return False
        return True

    def _launchable(self, order: list[str], rows: np.ndarray) -> bool:
        """Greedy, plain requests whose next position has an allocated slot."""
        if len(order) > self.graphs.max_bs or not self._predictable(order):
            return False
        batch = self.input_batch
        nxt = batch.num_computed[rows] + 1
        return bool(np.all(nxt // batch.block_size < batch.num_blocks[rows])
                    and np.all(nxt < self.max_model_len))

    def _launch(self, order: list[str], rows: np.ndarray, device_ids: torch.Tensor | None
                ) -> None:
        """Replay the decode graph for ``order`` at each request's next position."""
        batch = self.input_batch
        bs = batch.block_size
        positions = batch.num_computed[rows] + 1
        ids = None if device_ids is not None else batch.token_ids[rows, positions]
        slots = batch.block_table[rows, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = (positions + 1).astype(np.int32)
        tables = batch.block_table[rows, :int(-(-int(seq_lens.max()) // bs))]
        drafter = self.drafter
        if drafter is not None and _head_left(drafter, order):
            drafter = None  # no features to keep
        taps = drafter.proposer.target_layers if drafter is not None else ()
        aux: list[torch.Tensor] | None = [] if taps else None
        with torch.inference_mode():
            hidden = self.graphs.run_decode(ids, positions, slots, seq_lens, tables, device_ids,
                                            aux=aux)
            features = None
            if drafter is not None:  # what the head reads, kept past the next replay
                features = hidden.clone() if aux is None else torch.cat(aux, dim=-1)
            states = [self.requests[r] for r in order]
            rng_states = {} if self.sampler is None else {  # (greedy only without one)
                r: (s.generator, s.generator.get_state())
                for r, s in zip(order, states, strict=True)
                if s.generator is not None and s.sampling_params.temperature > 0}
            tokens = draw_ahead(self.sampler, states, order, self.model, hidden, device_ids)
            host, ready = read_back(tokens)
            # the head's catch-up behind the step (after the read: the tokens need not wait)
            caught_up = (drafter is not None and features is not None and self.launch_catch_ups
                         and launch_catch_up.catch_up_at_launch(drafter, order, features, tokens,
                                                                positions, slots, tables))
        self.pending = _Pending(list(order), {r: i for i, r in enumerate(order)},
                                positions.copy(), tokens, host, ready, slots, features,
                                rng_states, caught_up)
        self._count("launched")

    def _count(self, what: str) -> None:
        setattr(self.stats, what, getattr(self.stats, what) + 1)


def _head_left(drafter: DraftRunner, order: list[str]) -> bool:
    """Whether the draft head does no work for a step of ``order``: it sits the step out
    (:meth:`~lmkit.worker.draft_runner.DraftRunner.sits_out`) or has left every one of
    its requests for good (:attr:`~lmkit.worker.draft_runner.DraftRunner.stale`)."""
    return drafter.sits_out(len(order)) or drafter.stale.issuperset(order)


def read_back(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """``tokens``' copy to the host, queued (CUDA: into pinned memory, asynchronously,
    ahead of any later launch) and the event to wait on before reading it (``None`` on
    the CPU: the tensor itself, ready)."""
    if not tokens.is_cuda:
        return tokens, None
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    return host, record_event()


def decode_step_inputs(rows: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                       input_batch: InputBatch) -> StepInputs:
    """The :class:`~lmkit.worker.input_batch.StepInputs` of a decode step of the batch
    ``rows`` (one token each, at ``positions``, written to ``slots``), as the runner
    would have packed it (host tensors)."""
    n = len(rows)
    seq_lens = (positions + 1).astype(np.int32)
    width = int(-(-int(seq_lens.max()) // input_batch.block_size))
    return StepInputs(
        rows=rows, num_scheduled=np.ones(n, dtype=np.int64),
        cu_num_tokens=np.arange(1, n + 1, dtype=np.int64), num_computed=positions,
        input_ids=torch.from_numpy(input_batch.token_ids[rows, positions].astype(np.int64)),
        positions=torch.from_numpy(positions.astype(np.int64)),
        slot_mapping=torch.from_numpy(slots.astype(np.int64)),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.from_numpy(seq_lens),
        block_tables=torch.from_numpy(np.ascontiguousarray(
            input_batch.block_table[rows, :width])), num_decodes=n)


def decode_lookahead_slots(config: LMKitConfig, stack: ResolvedStack) -> int:
    """KV slots per request the scheduler must reserve past the scheduled tokens for the
    runner to launch decode steps ahead: 1 when it will (CUDA, graphs on, a backend that
    can be captured, no offload tier, ``LMKIT_DECODE_LOOKAHEAD`` not ``0``), else 0."""
    if switched_off("LMKIT_DECODE_LOOKAHEAD"):
        return 0
    attention = stack.get("attention")
    if (stack.device != "cuda" or config.executor.enforce_eager or attention is None
            or "cuda_graphs" not in attention.spec.caps.features
            or config.offload.backend != "none"):
        return 0
    return 1


def _plain(so: SchedulerOutput) -> bool:
    """No drafts, grammar bitmask or offload transfers in ``so``."""
    return (not any(so.scheduled_spec_decode_tokens.values())
            and so.grammar_bitmask is None and not so.kv_transfers)

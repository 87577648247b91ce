"""A speculative step queued on the device behind the verification it follows.

With verifications launched ahead (:mod:`lmkit.worker.spec_lookahead`) the GPU still
waits on the host once per step: the host reads the verification's argmax, walks the
accepted drafts, and only then queues the head's catch-up and drafts and the next
verification; on a small target that host work is as long as the target's own step.
Everything that host work computes follows from the verification on the device, so
:class:`DeviceSpecStep` queues it there, behind the verification, before anything is
read back:

1. **Accept**: per request, the drafts equal to the target's argmax before the first
   that is not (``a``, the greedy walk of :func:`lmkit.sample.drafts.accept_greedy`),
   and the bonus token (the argmax after the last accepted draft).
2. **Catch up** over all ``1 + k`` verified positions of each request, each paired with
   the target's argmax there: for the kept ones (``j <= a``) that is the next token;
   the others write the head's KV at positions past the kept tokens, rewritten before
   anything reads them (the argument of :mod:`lmkit.worker.draft_runner`).
3. **Draft**: draft 1 from each request's row ``a``, drafts ``2..k`` from one replay of
   the chained draft passes at positions ``start + a + 1 ..`` (cache slots looked up on
   the device from the block tables).
4. One copy to the host: the verification's argmax, ``a`` and the new drafts.
5. **Verify the next drafts**: the bonus token and the new drafts at positions from
   ``start + a + 1``, through the flattened decode graphs, and their argmax.

The host reads (4) when the engine asks for the step, while the GPU already runs (5);
taking that step queues the device step after (5) in turn, so in steady state the GPU
runs verification after verification without waiting for the host. A device step
writes KV at most ``2k + 1`` positions past the first one it verifies: the scheduler
reserves ``2 (k + 1)`` lookahead slots (:func:`~lmkit.worker.spec_lookahead.
spec_lookahead_slots`) and :meth:`DeviceSpecStep.fits` checks the blocks are there.
``LMKIT_SPEC_DEVICE_STEP=0`` turns it off (verifications are still launched ahead).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lmkit.platform import switched_off
from lmkit.sample.kernels import TorchSamplingKernels
from lmkit.worker.gpu_lookahead import read_back

if TYPE_CHECKING:
    from lmkit.api import SamplingKernels
    from lmkit.worker.cuda_graphs import CudaGraphRunner
    from lmkit.worker.draft_runner import DraftRunner

ENV = "LMKIT_SPEC_DEVICE_STEP"

#: the default of ``speculative.device_step_max_requests``: the most requests of a
#: device step. It catches the head up on all ``1 + k`` verified positions of every
#: request, kept or not, a few more head rows per step; above it the runner reads each
#: verification and plans the head's passes on the host, which at 32 requests left the
#: GPU idle 73% of a step (SmolLM2-135M, H200, session 25). On CUDA with graphs every
#: device step replays graphs captured at engine start, one pair per request count.
DEFAULT_MAX_REQUESTS = 32


@dataclass
class DeviceVerify:
    """A verification queued on the device: ``n`` requests of ``1 + k`` rows each.

    Tensors on the device: ``inputs`` int64 ``[n, 1 + k]`` (each request's last token,
    then its drafts), ``positions`` and ``slots`` int64 ``[n, 1 + k]``, ``features`` (what
    the head reads, ``[n * (1 + k), width]``) and ``targets`` (the greedy argmax of every
    row, int64 ``[n * (1 + k)]``).
    """

    inputs: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    features: torch.Tensor
    targets: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Its tensors, in field order."""
        return self.inputs, self.positions, self.slots, self.features, self.targets


@dataclass
class DeviceStepResult:
    """A device step queued behind a verification: the next verification, and the host
    copy of what the step decided, ``[n, (1 + k) + 1 + k]`` per request: the verified
    argmax, the number of accepted drafts, the new drafts (valid once ``ready``)."""

    verify: DeviceVerify
    host: torch.Tensor
    ready: torch.cuda.Event | None


class DeviceSpecStep:
    """Queues speculative steps on the device for a runner with a draft head.

    Args:
        graphs: the target's decode graphs (verifications replay them flattened).
        model: the target (its LM head gives the verifications' argmax).
        drafter: the draft head's runner, with captured catch-up passes that take their
            drafts and, for ``k > 1``, the greedy draft passes chained in one replay.
        max_requests: the most requests of a device step
            (``speculative.device_step_max_requests``).
        kernels: the engine's sampling kernels, whose
            :meth:`~lmkit.api.SamplingKernels.plan_device_step` and
            :meth:`~lmkit.api.SamplingKernels.finish_device_step` do each step's
            bookkeeping (default: torch ops).
    """

    def __init__(self, graphs: CudaGraphRunner, model: Any, drafter: DraftRunner,
                 max_requests: int = DEFAULT_MAX_REQUESTS,
                 kernels: SamplingKernels | None = None) -> None:
        self.graphs = graphs
        self.model = model
        self.drafter = drafter
        self.max_requests = max_requests
        #: plans each step's acceptance, positions and slots (plan_device_step,
        #: finish_device_step): the engine's sampling kernels
        self.kernels = kernels if kernels is not None else TorchSamplingKernels(device=None)
        self.k = drafter.k
        self.block_size = drafter.block_size
        self._captured: dict[int, _StepGraphs] = {}  # by request count
        self.num_steps = 0  # device steps queued

    @classmethod
    def maybe(cls, graphs: CudaGraphRunner, model: Any, drafter: DraftRunner,
              max_requests: int = DEFAULT_MAX_REQUESTS,
              kernels: SamplingKernels | None = None) -> DeviceSpecStep | None:
        """A device step when the head's passes can be queued without the host: its
        catch-up graphs take the drafts, ``k > 1`` drafts come from chained passes, no
        backend is planned per replay (their plans read host values),
        ``LMKIT_SPEC_DEVICE_STEP`` is not ``0`` and ``max_requests`` is at least 1."""
        catch_up, passes = drafter.catch_up_graphs, drafter.graphs
        if (switched_off(ENV) or max_requests < 1 or catch_up is None
                or not catch_up.drafts_in_graph):
            return None
        runners = [graphs, catch_up.runner]
        if drafter.k > 1:
            if passes is None or passes.chain != drafter.k - 1:
                return None
            runners.append(passes.runner)
        if any(r.use_graphs and r.plans_replays for r in runners):
            return None
        step = cls(graphs, model, drafter, max_requests, kernels)
        step.capture(range(1, min(max_requests, graphs.max_num_seqs) + 1))
        return step

    def capture(self, sizes: range) -> None:
        """Capture the step graphs for those of these request counts that fit
        (:meth:`fits_rows`), largest first, into one memory pool (the graphs never run at
        once, and what a step leaves for the next lives outside the pool). Called at
        engine start with every count a step can have (up to :attr:`max_requests` and
        ``scheduler.max_num_seqs``), so that no request waits for a capture (~40 ms each
        on SmolLM2-135M, H200). No-op without graphs."""
        if not self.graphs.use_graphs:
            return
        catch_up = self.drafter.catch_up_graphs
        assert catch_up is not None
        features = catch_up.feature_rows(1)
        width = 1 + self.k
        pool = torch.cuda.graph_pool_handle()
        for n in sorted((n for n in sizes if self.fits_rows(n)), reverse=True):
            ids = torch.zeros(n, width, dtype=torch.int64, device=features.device)
            like = DeviceVerify(ids, ids, ids, features.new_zeros(n * width, features.shape[1]),
                                ids.view(-1))
            self._captured[n] = _StepGraphs.capture(self, like, pool)

    def fits_rows(self, n: int) -> bool:
        """Whether a step of ``n`` requests is small enough for a device step
        (:attr:`max_requests`) and for every pass's graphs."""
        catch_up, passes = self.drafter.catch_up_graphs, self.drafter.graphs
        assert catch_up is not None
        return (n <= self.max_requests
                and n * (1 + self.k) <= min(self.graphs.max_bs, catch_up.max_rows)
                and (passes is None or n <= passes.max_rows))

    @property
    def captured_sizes(self) -> list[int]:
        """The request counts whose device steps replay captured graphs."""
        return sorted(self._captured)

    def fits(self, n: int, start: np.ndarray, capacity: np.ndarray, blocks: int) -> bool:
        """Whether a step after verifying ``n`` requests from positions ``start`` stays
        within each request's ``capacity`` (allocated slots, at most the context limit)
        and the graphs' sizes: it writes up to ``start + 2k + 1`` and reads ``blocks``
        block-table columns."""
        catch_up = self.drafter.catch_up_graphs
        assert catch_up is not None
        return (self.fits_rows(n)
                and blocks <= min(self.graphs.max_blocks, catch_up.max_blocks)
                and bool(np.all(start + 2 * self.k + 1 < capacity)))

    def verify(self, inputs: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               tables: torch.Tensor, inline: bool = False) -> DeviceVerify:
        """Queue the verification of ``inputs`` ``[n, 1 + k]`` at ``positions`` into
        ``slots`` over the requests' block ``tables`` (int32 ``[n, width]``); ``inline``:
        inside a capture (the target's forward itself, not its graph)."""
        width = inputs.shape[1]
        taps = self.drafter.proposer.target_layers
        aux: list[torch.Tensor] | None = [] if taps else None
        hidden = self.graphs.run_decode_device(
            inputs.reshape(-1), positions.reshape(-1), slots.reshape(-1),
            positions.reshape(-1) + 1, tables.repeat_interleave(width, dim=0), aux=aux,
            inline=inline)
        # what the head reads, kept past the graph's next replay
        features = hidden.clone() if aux is None else torch.cat(aux, dim=-1)
        # the first maximal index, as verify_greedy takes it (the engine's kernels')
        targets = self.kernels.argmax(self.model.compute_greedy_logits(hidden))
        return DeviceVerify(inputs, positions, slots, features, targets)

    def step(self, v: DeviceVerify, tables: torch.Tensor) -> DeviceStepResult:
        """Queue the step after verification ``v`` (see the module docstring) over the
        requests' current block ``tables`` (int32 ``[n, width]``, covering ``2k + 2``
        positions from the first verified one); returns the next verification and the
        host copy of the step's decisions. On CUDA with graphs the step replays two
        graphs captured per request count (:class:`_StepGraphs`); elsewhere it queues the
        same work pass by pass. ``v``'s request count must pass :meth:`fits`."""
        n = v.inputs.shape[0]
        self.num_steps += 1
        captured = self.graphs.use_graphs
        self._count(head_passes=captured)
        if captured:  # every count that passes fits() was captured at engine start
            return self._captured[n].run(v, tables)
        n, width = v.inputs.shape
        decided = v.inputs.new_empty(n, 2 * width)
        inputs, positions, slots = (torch.empty_like(v.inputs) for _ in range(3))
        self._draft(v, tables, (decided, inputs, positions, slots))
        # read back before the next verification is queued: the host takes this step
        # while the GPU verifies the next one
        host, ready = read_back(decided)
        nxt = self.verify(inputs, positions, slots, tables)
        return DeviceStepResult(nxt, host, ready)

    def _count(self, head_passes: bool) -> None:
        """Count a step's passes where the runners count theirs: the verification and
        the catch-up, and with ``head_passes`` (captured steps, whose passes run
        ``inline``, uncounted) the head's passes."""
        graphs, drafter = self.graphs, self.drafter
        graphs.num_replays += 1
        graphs.num_flattened_replays += 1
        drafter.num_flattened_catch_ups += 1
        if not head_passes:
            return
        if drafter.catch_up_graphs is not None:
            drafter.catch_up_graphs.num_passes += 1
        if self.k > 1 and drafter.graphs is not None:
            drafter.graphs.num_passes += drafter.graphs.chain

    def _draft(self, v: DeviceVerify, tables: torch.Tensor,
               out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
               inline: bool = False) -> None:
        """Accept, catch up and draft after ``v``, writing into ``out``: the step's
        decisions ``[n, (1 + k) + 1 + k]`` (``v``'s argmax, accepted drafts, new drafts),
        and the next verification's inputs, positions and slots ``[n, 1 + k]`` (they may
        be ``v``'s own buffers: written last)."""
        n, width = v.inputs.shape
        drafter = self.drafter
        targets = v.targets.view(n, width)
        accepted, last, last_rows, chain = self.kernels.plan_device_step(
            targets, v.inputs, v.positions[:, 0], tables, self.block_size)
        catch_up = drafter.catch_up_graphs
        assert catch_up is not None
        catch_up.feature_rows(n * width).copy_(v.features)
        hidden = catch_up.run_device(v.targets, None, v.positions.reshape(-1),
                                     v.slots.reshape(-1), tables.repeat_interleave(width, dim=0),
                                     inline=inline)
        first = catch_up.drafts(n * width).index_select(0, last_rows)  # at the last kept row
        rest = None
        if self.k > 1:  # pass j writes position last + j (chain[j - 1])
            passes = drafter.graphs
            assert passes is not None
            passes.run_device(first, hidden.index_select(0, last_rows), chain[0, 0], chain[0, 1],
                              tables, chain_rows=chain[1:], inline=inline)
            rest = passes.chain_drafts(n)
        self.kernels.finish_device_step(targets, accepted, last, first, rest, tables,
                                        self.block_size, *out)


class _StepGraphs:
    """A device step of ``n`` requests as two CUDA graphs over fixed buffers: the draft
    graph (accept, catch-up, drafts; it writes the step's decisions and the next
    verification's inputs) and the verify graph (the next verification; it writes its
    features and argmax). The buffers (:attr:`state`) hold the verification a step
    follows: the one the verify graph computed last, or one copied in. The host reads
    the decisions back between the two replays.

    The graphs contain the forwards themselves (target, the head's catch-up and chained
    passes, captured ``inline``), not replays of the runners' graphs, so one replay
    launches a whole phase of the step.
    """

    def __init__(self, state: DeviceVerify, tables: torch.Tensor, decided: torch.Tensor,
                 draft: torch.cuda.CUDAGraph, verify: torch.cuda.CUDAGraph) -> None:
        self.state = state
        self.tables = tables
        self.decided = decided
        self.draft = draft
        self.verify = verify

    @classmethod
    def capture(cls, step: DeviceSpecStep, like: DeviceVerify, pool: Any) -> _StepGraphs:
        """Capture both graphs for ``like``'s request count (its shapes and dtypes) into
        the memory ``pool`` (``torch.cuda.graph_pool_handle()``)."""
        from lmkit.worker.graph_stream import capture_stream

        n, width = like.inputs.shape
        device = like.inputs.device
        state = DeviceVerify(*(torch.zeros_like(t) for t in like.tensors()))
        with torch.inference_mode():  # the one kernel the runners' captures did not compile
            step.model.compute_greedy_logits(step.graphs.hidden_like(n * width))
            torch.cuda.synchronize(device)
        tables = torch.zeros(n, step.graphs.max_blocks, dtype=torch.int32, device=device)
        decided = torch.zeros(n, 2 * width, dtype=torch.int64, device=device)
        stream = capture_stream(device)
        draft, verify = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.inference_mode():
            with torch.cuda.graph(draft, pool=pool, stream=stream):
                step._draft(state, tables, (decided, state.inputs, state.positions,
                                            state.slots), inline=True)
            with torch.cuda.graph(verify, pool=pool, stream=stream):
                nxt = step.verify(state.inputs, state.positions, state.slots, tables,
                                  inline=True)
                state.features.copy_(nxt.features)
                state.targets.copy_(nxt.targets)
        return cls(state, tables, decided, draft, verify)

    def run(self, v: DeviceVerify, tables: torch.Tensor) -> DeviceStepResult:
        """Replay the step after ``v`` (copied into :attr:`state` unless it is the
        verification the verify graph made last) over ``tables``."""
        state = self.state
        if v is not state:
            for dst, src in zip(state.tensors(), v.tensors(), strict=True):
                dst.copy_(src)
        self.tables[:, :tables.shape[1]].copy_(tables)
        self.draft.replay()
        host, ready = read_back(self.decided)  # before the verification: read meanwhile
        self.verify.replay()
        return DeviceStepResult(state, host, ready)

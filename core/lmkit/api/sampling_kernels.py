"""What a sampling-kernels plugin implements: the sampler's two heavy device steps.

The sampler (:mod:`lmkit.sample`) owns the pipeline: raw logprobs, logit adjustments
(bias, bans, allowed ids, penalties, plugin logits processors; the grammar bitmask
before it), greedy argmax, the greedy acceptance of drafts and the host copy. Two steps
of random sampling, the greedy rows' argmax and the penalties go through a
:class:`SamplingKernels` object, chosen per engine by the ``sampling_kernels`` kind
(``--sampling-kernels``):

- :meth:`SamplingKernels.sample`: adjusted logits -> one draw per row (temperature,
  min-p, top-k, top-p, then the draw), a step without drafts;
- :meth:`SamplingKernels.verify`: target distributions -> rejection sampling of the
  drafts (each draft's test, each row's recovered or bonus draw);
- :meth:`SamplingKernels.argmax` (optional, plugin API 1.1): the adjusted logits' argmax
  per row, ``torch.argmax`` unless a kernel set overrides it;
- :meth:`SamplingKernels.plan_device_step` and :meth:`SamplingKernels.finish_device_step`
  (optional, plugin API 1.4): the greedy acceptance of a speculative step queued on the
  device (``lmkit.worker.spec_device_step``) and the positions, cache slots and inputs
  that follow from it; torch ops unless a kernel set overrides them;
- :meth:`SamplingKernels.apply_penalties` (optional, plugin API 1.7): the repetition,
  frequency and presence penalties of a step's rows (:class:`PenaltyRows`), in place;
  :func:`lmkit.sample.penalties.apply_penalties` (torch) unless a kernel set overrides it;
- :meth:`SamplingKernels.warm_up` (optional, plugin API 1.8): run the kernel variants
  serving will meet at startup, so that JIT compiles happen there; nothing by default.

The core's default is the torch implementation,
:class:`lmkit.sample.kernels.TorchSamplingKernels` (``lmkit.api.TorchSamplingKernels``;
registered as ``torch``). A plugin usually subclasses it, overrides a method and calls
``super()`` for the rows or shapes its kernels do not serve exactly or fast: a
per-request seed (``rows.generators``) must keep drawing from that generator alone.
Greedy rows' results are ignored (the sampler takes :meth:`SamplingKernels.argmax`), so
a kernel set may treat them as it likes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RandomRows:
    """The random-sampling parameters of a step's rows (one row per sampled position:
    with drafts, ``k + 1`` consecutive rows per request, its parameters repeated).

    Greedy rows carry neutral values (temperature 1.0, filters off).
    """

    is_greedy: torch.Tensor  # bool [num_rows]
    all_random: bool  # no row is greedy
    temperature: torch.Tensor | None  # float32 [num_rows], > 0; None: 1.0
    top_k: torch.Tensor | None  # int64 [num_rows]; >= vocab is off; None: off everywhere
    max_top_k: int  # the largest active top_k (0 when top_k is None)
    top_p: torch.Tensor | None  # float32 [num_rows]; 1.0 is off; None: off everywhere
    min_p: torch.Tensor | None  # float32 [num_rows]; 0.0 is off; None: off everywhere
    # row -> that request's own generator (seeded requests): the row's randomness must
    # come from it alone, whatever else is in the batch
    generators: Mapping[int, torch.Generator]


@dataclass(frozen=True)
class DraftRows:
    """Where a step's drafts sit among its rows: request ``i`` with ``k_i`` drafts owns
    rows ``row_starts[i] .. row_starts[i] + k_i`` (the last one its bonus row)."""

    num_drafts: list[int]  # k_i per request
    row_starts: list[int]  # first row of each request
    rows: torch.Tensor  # int64 [num_drafts_total], the row of each draft
    token_ids: torch.Tensor  # int64 [num_drafts_total]
    req: torch.Tensor  # int64 [num_drafts_total], the request of each draft
    pos: torch.Tensor  # int64 [num_drafts_total], its position among the request's drafts


@dataclass(frozen=True)
class PenaltyRows:
    """The repetition / frequency / presence penalties of a step's rows: which logits
    rows have them, the tokens they act on, and every row's parameters.

    The token tables are kept across steps by the sampler
    (:class:`lmkit.sample.row_cache.SamplingCache`), one row (slot) per request, and
    are read, never written, by :meth:`SamplingKernels.apply_penalties`. A request's
    ``k + 1`` rows of a speculative step share its slot; the drafts before a row count
    as generated for that row alone (``draft_counts``). A token generated is always
    seen: ``counts[s, t] > 0`` implies ``seen[s, t]``, and ``draft_counts[i, t] > 0``
    makes ``t`` seen for row ``i``.
    """

    rows: torch.Tensor  # int64 [P], the logits rows with penalties (distinct)
    slots: torch.Tensor  # int64 [P], each one's row of counts and seen
    counts: torch.Tensor  # int32 [num_slots, vocab], tokens generated (the kept table)
    # bool [num_slots, vocab], tokens seen: generated, or in the prompt where a
    # repetition penalty asks (the kept table, not a copy per step)
    seen: torch.Tensor
    repetition: torch.Tensor  # float32 [num_rows] (every logits row), 1.0 = off
    frequency: torch.Tensor  # float32 [num_rows], 0.0 = off
    presence: torch.Tensor  # float32 [num_rows], 0.0 = off
    # int32 [P, vocab], the tokens of the drafts before each row; None: no row has any
    draft_counts: torch.Tensor | None = None

    def row_counts(self) -> torch.Tensor:
        """int32 ``[P, vocab]``: each row's generated-token counts, drafts included (a
        new tensor)."""
        counts = self.counts.index_select(0, self.slots)
        if self.draft_counts is not None:
            counts += self.draft_counts
        return counts

    def row_seen(self) -> torch.Tensor:
        """bool ``[P, vocab]``: the tokens each row has seen, drafts included (a new
        tensor)."""
        seen = self.seen.index_select(0, self.slots)
        if self.draft_counts is not None:
            seen |= self.draft_counts > 0
        return seen


class SamplingKernels(ABC):
    """The sampler's random-sampling steps on one device (see the module docstring).

    Built once per engine as ``cls(*, device, options)``: ``device`` the
    :class:`torch.device` the logits live on, ``options`` the validated instance of the
    spec's options model (or ``None``). Methods are called once per step with batched
    tensors; no Python loop per request belongs in them.
    """

    def __init__(self, *, device: Any, options: BaseModel | None = None) -> None:
        self.device = device
        self.options = options

    @abstractmethod
    def sample(self, logits: torch.Tensor, rows: RandomRows) -> torch.Tensor:
        """Draw one token per row: softmax of ``logits / temperature`` restricted by
        min-p, then top-k, then top-p (measured after top-k), as
        :func:`lmkit.sample.filters.logits_to_probs` defines them.

        Args:
            logits: float32 ``[num_rows, vocab]``, already adjusted; may be changed in
                place.
            rows: the rows' parameters; rows in ``rows.generators`` draw only from
                their generator.

        Returns:
            int64 ``[num_rows]`` on the logits' device (greedy rows: any valid id).
        """

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's argmax, exactly as ``torch.argmax(logits, dim=-1)``: the first index
        of the largest value, a NaN counting as larger than everything. The sampler's
        greedy rows take it, and so do the greedy steps the runner launches ahead on
        CUDA (decode steps, speculative verifications), one of them inside a captured
        CUDA graph (a device step's next verification): no host synchronisation. Added
        in plugin API 1.1; the default is ``torch.argmax``.

        Args:
            logits: ``[num_rows, vocab]`` (float32, or the model's dtype when nothing
                adjusted them); not modified.

        Returns:
            int64 ``[num_rows]`` on the logits' device.
        """
        return logits.argmax(dim=-1)

    def plan_device_step(self, targets: torch.Tensor, inputs: torch.Tensor,
                         start: torch.Tensor, tables: torch.Tensor, block_size: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The greedy acceptance of a verification queued on the device, and where the
        draft head's chained passes after it write. Called inside a captured CUDA graph:
        no host synchronisation, no allocation that depends on values. Added in plugin
        API 1.4; the default is torch ops.

        Args:
            targets: int64 ``[n, 1 + k]``, the verification's argmax per row.
            inputs: int64 ``[n, 1 + k]``, each request's last token then its ``k`` drafts.
            start: int64 ``[n]`` (any stride), each request's first verified position.
            tables: int32 ``[n, blocks]``, the requests' block tables.
            block_size: tokens per cache block.

        Returns:
            int64 ``(accepted [n], last [n], last_rows [n], chain [k - 1, 3, n])``: the
            drafts equal to the argmax before the first that is not; ``start +
            accepted``; ``i (1 + k) + accepted``; and for ``j = 1 .. k - 1`` the position
            ``last + j``, its cache slot and ``last + j + 1``.
        """
        import torch

        n, width = targets.shape
        k = width - 1
        accepted = (targets[:, :k] == inputs[:, 1:]).long().cumprod(dim=1).sum(dim=1)
        last = start + accepted
        rows = torch.arange(n, device=targets.device) * width + accepted
        pos = last[None, :] + torch.arange(1, k, device=targets.device)[:, None]
        chain = torch.stack([pos, _slots(tables, pos.T, block_size).T, pos + 1], dim=1)
        return accepted, last, rows, chain

    def finish_device_step(self, targets: torch.Tensor, accepted: torch.Tensor,
                           last: torch.Tensor, first: torch.Tensor, rest: torch.Tensor | None,
                           tables: torch.Tensor, block_size: int, decided: torch.Tensor,
                           inputs: torch.Tensor, positions: torch.Tensor,
                           slots: torch.Tensor) -> None:
        """Write a device step's decisions and the next verification's inputs, positions
        and cache slots into the given buffers (inside a captured CUDA graph, as
        :meth:`plan_device_step`). Added in plugin API 1.4; the default is torch ops.

        Args:
            targets: int64 ``[n, 1 + k]``; ``accepted``, ``last``: from
                :meth:`plan_device_step`.
            first: int64 ``[n]``, each request's first new draft; ``rest``: int64 ``[k -
                1, n]``, the others (``None`` for ``k = 1``).
            tables, block_size: as for :meth:`plan_device_step` (covering ``last + k +
                1``).
            decided: int64 ``[n, 2 (1 + k)]``, written: the argmax row, ``accepted``, the
                new drafts.
            inputs: int64 ``[n, 1 + k]``, written: ``targets[i, accepted[i]]`` then the
                new drafts; ``positions``: ``last + 1 .. last + k + 1``; ``slots``: their
                cache slots. They may be the buffers ``inputs`` and ``start`` were read
                from.
        """
        import torch

        width = targets.shape[1]
        drafts = first[:, None] if rest is None else torch.cat([first[None], rest]).T
        decided.copy_(torch.cat([targets, accepted[:, None], drafts], dim=1))
        inputs.copy_(torch.cat([targets.gather(1, accepted[:, None]), drafts], dim=1))
        nxt = (last + 1)[:, None] + torch.arange(width, device=targets.device)
        positions.copy_(nxt)
        slots.copy_(_slots(tables, nxt, block_size))

    def apply_penalties(self, logits: torch.Tensor, penalties: PenaltyRows) -> torch.Tensor:
        """Apply the repetition, then the frequency and presence penalties of
        ``penalties.rows``, in place. Added in plugin API 1.7; the default is
        :func:`lmkit.sample.penalties.apply_penalties` (torch: a scan of the seen tokens
        on the CPU, whole-row passes on other devices).

        The result must equal the default's bit for bit. For each row ``r =
        rows[i]`` and token ``t`` seen by it (``seen[slots[i], t]``, or
        ``draft_counts[i, t] > 0``), with ``c = counts[slots[i], t] + draft_counts[i,
        t]`` (int32, then float32):

        1. repetition (CTRL): ``x = logits[r, t]`` becomes ``x / repetition[r]`` if
           ``x > 0``, else ``x * repetition[r]`` (IEEE float32, correctly rounded: no
           approximate division);
        2. frequency and presence (OpenAI), where ``c > 0``: ``x - (frequency[r] * c +
           presence[r])``, each operation rounded on its own (no fused multiply-add).

        Every other logit (rows not in ``rows``, tokens not seen) keeps its value bit
        for bit; NaN and infinities follow the same arithmetic. ``seen``, ``counts`` and
        ``draft_counts`` are not modified.

        Args:
            logits: float32 ``[num_rows, vocab]``, the logits after the bias, bans and
                allowed ids; modified in place.
            penalties: the step's :class:`PenaltyRows` (on the logits' device).

        Returns:
            ``logits``.
        """
        from lmkit.sample.penalties import apply_penalties

        return apply_penalties(logits, penalties)

    def warm_up(self, vocab_size: int, max_rows: int) -> None:
        """Run the kernel variants serving will meet, so that a just-in-time compiler
        (Triton) compiles them here, at startup, and not inside a busy step (each
        compile stalls the engine for a fraction of a second). Added in plugin API 1.8;
        the default does nothing (torch's kernels need no compiling).

        The model runner calls it once, after the KV cache is allocated and the decode
        graphs are captured, with the logits' width and the most rows a step samples
        (``scheduler.max_num_seqs``), on any device: a kernel set with nothing to
        compile there returns. It must leave no state a later call depends on and keep
        its scratch memory small (a few rows of logits, or as few as take each
        variant).

        Args:
            vocab_size: the logits' width.
            max_rows: the most rows a step's logits have.
        """
        return None

    @abstractmethod
    def verify(self, probs: torch.Tensor, rows: RandomRows, drafts: DraftRows,
               draft_probs: Sequence[torch.Tensor | None] | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rejection sampling (see :mod:`lmkit.sample.rejection`): each draft's test and
        each row's draw from its recovery distribution (draft rows) or target (bonus).

        Args:
            probs: float32 ``[num_rows, vocab]``, each row's target distribution (not
                modified).
            rows: the rows' parameters (``generators``: seeded requests draw their
                uniforms and noise from their own generator).
            drafts: where the drafts are.
            draft_probs: per request ``[k_i, vocab]`` draft distributions, or ``None``
                (deterministic drafts: one-hot).

        Returns:
            ``(row_tokens, accepted)``: int64 ``[num_rows]``, each row's output token if
            the request's output reaches that row (a valid id elsewhere), and bool
            ``[num_drafts_total]`` (only its leading run per request counts).
        """


def _slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The cache slot of each of ``positions`` (int64 ``[n, m]``) through each request's
    row of ``tables``."""
    return tables.gather(1, positions // block_size).long() * block_size + positions % block_size

"""What a sampling-kernels plugin implements: the sampler's two heavy device steps.

The sampler (:mod:`lmkit.sample`) owns the pipeline: raw logprobs, logit adjustments
(bias, bans, allowed ids, penalties, plugin logits processors; the grammar bitmask
before it), greedy argmax, the greedy acceptance of drafts and the host copy. Two steps
of random sampling, and the greedy rows' argmax, go through a :class:`SamplingKernels`
object, chosen per engine by the ``sampling_kernels`` kind (``--sampling-kernels``):

- :meth:`SamplingKernels.sample`: adjusted logits -> one draw per row (temperature,
  min-p, top-k, top-p, then the draw), a step without drafts;
- :meth:`SamplingKernels.verify`: target distributions -> rejection sampling of the
  drafts (each draft's test, each row's recovered or bonus draw);
- :meth:`SamplingKernels.argmax` (optional, plugin API 1.1): the adjusted logits' argmax
  per row, ``torch.argmax`` unless a kernel set overrides it.

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
        greedy rows take it. Added in plugin API 1.1; the default is ``torch.argmax``.

        Args:
            logits: ``[num_rows, vocab]`` (float32, or the model's dtype when nothing
                adjusted them); not modified.

        Returns:
            int64 ``[num_rows]`` on the logits' device.
        """
        return logits.argmax(dim=-1)

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

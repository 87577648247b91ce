"""The core's torch implementation of the sampler's random-sampling steps.

:class:`TorchSamplingKernels` is the default :class:`lmkit.api.SamplingKernels` (the
``torch`` sampling kernels, chosen everywhere no plugin's kernels fit); plugins subclass
it and call ``super()`` for what their kernels do not serve. :func:`random_rows` gives
the step's parameters in the contract's form.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from lmkit.api.contract import build
from lmkit.api.sampling_kernels import DraftRows, RandomRows, SamplingKernels
from lmkit.sample.drafts import sample_and_accept
from lmkit.sample.draws import sample_from_probs
from lmkit.sample.filters import logits_to_probs
from lmkit.sample.metadata import SamplingMetadata

if TYPE_CHECKING:
    from lmkit.plugin_host.resolve import ResolvedStack


def random_rows(md: SamplingMetadata) -> RandomRows:
    """``md``'s random-sampling fields as a :class:`RandomRows` (no copies)."""
    return RandomRows(is_greedy=md.is_greedy, all_random=md.all_random,
                      temperature=md.temperature, top_k=md.top_k, max_top_k=md.max_top_k,
                      top_p=md.top_p, min_p=md.min_p, generators=md.generators)


class TorchSamplingKernels(SamplingKernels):
    """Batched torch on any device: the filters then an inverse-CDF draw per row; the
    rejection sampling of :func:`lmkit.sample.drafts.sample_and_accept`; the contract's
    defaults for the optional methods (``apply_penalties``:
    :func:`lmkit.sample.penalties.apply_penalties`)."""

    def sample(self, logits: torch.Tensor, rows: RandomRows) -> torch.Tensor:
        """See :meth:`lmkit.api.SamplingKernels.sample`."""
        probs = logits_to_probs(logits, rows.temperature, rows.top_k, rows.top_p, rows.min_p,
                                rows.max_top_k)
        return sample_from_probs(probs, dict(rows.generators))

    def verify(self, probs: torch.Tensor, rows: RandomRows, drafts: DraftRows,
               draft_probs: Sequence[torch.Tensor | None] | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """See :meth:`lmkit.api.SamplingKernels.verify`."""
        return sample_and_accept(probs, dict(rows.generators), drafts, draft_probs)


def build_sampling_kernels(stack: ResolvedStack, device: torch.device) -> SamplingKernels:
    """The stack's chosen sampling kernels built for ``device`` (through the kind's
    constructor contract); the torch ones when the stack chose none."""
    reg = stack.get("sampling_kernels")
    if reg is None:
        return TorchSamplingKernels(device=device)
    kernels: SamplingKernels = build("sampling_kernels", reg.spec.load(), device=device,
                                     options=stack.options.get("sampling_kernels"),
                                     plugin=reg.origin)
    return kernels

"""The pipeline's building blocks: logit adjustments, the distribution, one draw per row.

Everything is batched torch; the only per-row Python is one noise draw per seeded row,
so that row's randomness comes from its own generator alone and does not depend on
what else is in the batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lmkit.sample.filters import logits_to_probs
from lmkit.sample.metadata import SamplingMetadata
from lmkit.sample.penalties import (
    apply_allowed_tokens,
    apply_logit_bias,
    apply_penalties,
    apply_token_mask,
)

if TYPE_CHECKING:
    from lmkit.api.sampling_kernels import SamplingKernels


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator for one request's sampling noise, seeded with the request's ``seed``."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def adjust_logits(logits: torch.Tensor, md: SamplingMetadata,
                  kernels: SamplingKernels | None = None) -> torch.Tensor:
    """Apply the argmax-changing steps in place (greedy rows too): logit bias, token
    bans (min_tokens, bad_words), allowed token ids, penalties (by ``kernels``'
    :meth:`~lmkit.api.SamplingKernels.apply_penalties`; ``None``: the core's torch
    path), then the plugin logits processors in use. They come before greedy
    selection."""
    if md.bias_rows is not None and md.bias_token_ids is not None and md.bias_values is not None:
        apply_logit_bias(logits, md.bias_rows, md.bias_token_ids, md.bias_values)
    if md.banned_rows is not None and md.banned_token_ids is not None:
        apply_token_mask(logits, md.banned_rows, md.banned_token_ids)
    if md.allowed_rows is not None and md.allowed_mask is not None:
        apply_allowed_tokens(logits, md.allowed_rows, md.allowed_mask)
    if md.penalties is not None:
        if kernels is None:
            apply_penalties(logits, md.penalties)
        else:
            kernels.apply_penalties(logits, md.penalties)
    if md.processor_slots is not None:
        for processor in md.logits_processors:
            logits = _applied(processor, logits, md.processor_slots)
    return logits


def _applied(processor: Any, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``processor.apply(logits, slots)``, checked: an exception, or an answer that is
    not a tensor of the logits' shape (narrowed logits would be sampled as if they were
    the whole vocabulary), raises :class:`~lmkit.errors.PluginError` naming the
    processor (O(1): shapes only)."""
    from lmkit.errors import PluginError
    from lmkit.plugin_host.faults import raised_in

    label = f"logits processor {type(processor).__qualname__} ({type(processor).__module__})"
    try:
        out = processor.apply(logits, slots)
    except Exception as e:
        raise PluginError(raised_in(label, e, "adjusting the logits")) from e
    if not isinstance(out, torch.Tensor) or out.shape != logits.shape:
        what = (f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor)
                else type(out).__name__)
        raise PluginError(f"{label} broke its contract: apply() returned {what}; it must "
                          f"return the logits' shape {tuple(logits.shape)} (the rows as "
                          "given, every token of the vocabulary)")
    return out


def compute_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The distribution random rows sample from: temperature, min-p, top-k, top-p, softmax.

    ``logits`` (already through :func:`adjust_logits`) is modified in place. Greedy rows
    get their unfiltered softmax at temperature 1 (the sampler takes their argmax).
    Returns float32 ``[num_rows, vocab]``.
    """
    return logits_to_probs(logits, md.temperature, md.top_k, md.top_p, md.min_p, md.max_top_k)


def sample_from_probs(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draw one token per row by inverting the row's cumulative distribution.

    Each row uses a single uniform number ``u``: the token is the first whose cumulative
    probability exceeds ``u * total``. A token with zero probability does not raise the
    cumulative sum, so it can never be drawn. Rows in ``generators`` draw ``u`` from
    their own generator (one number per step, whatever else is in the batch); the other
    rows share one draw from the default generator. Returns int64 ``[num_rows]``.
    """
    num_rows = probs.shape[0]
    cdf = probs.cumsum(dim=-1)  # [num_rows, vocab]
    u = torch.empty(num_rows, 1, dtype=cdf.dtype, device=cdf.device)
    if len(generators) < num_rows:
        u.uniform_()
    for row, generator in generators.items():
        u[row].uniform_(generator=generator)
    total = cdf[:, -1:]
    # Stay strictly below the total, which rounding in u * total could otherwise reach.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    # The clamp only matters for rows that are NaN (e.g. a model that produced NaN logits).
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)

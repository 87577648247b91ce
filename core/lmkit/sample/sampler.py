"""The sampler: adjusted logits -> one token per row, with optional logprobs.

Per step: raw logprobs (if any row asks) -> logit bias -> min_tokens ban -> penalties
-> greedy argmax; then, for random rows, temperature -> min-p -> top-k -> top-p ->
softmax -> exponential-race sample. Everything is batched torch; the only per-row
Python is one noise draw per seeded row, so that row's randomness comes from its own
generator alone and does not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmkit.api.outputs import TokenLogprob
from lmkit.sample.filters import logits_to_probs
from lmkit.sample.logprobs import compute_prompt_logprobs, to_token_logprobs
from lmkit.sample.metadata import SamplingMetadata
from lmkit.sample.penalties import apply_logit_bias, apply_penalties, apply_token_mask

__all__ = [
    "Sampler", "SamplerOutput", "adjust_logits", "compute_probs", "compute_prompt_logprobs",
    "make_generator", "sample_from_probs",
]


@dataclass
class SamplerOutput:
    """The sampled token per row and, for rows that asked, its logprobs."""

    sampled_token_ids: torch.Tensor  # int64 [num_rows]
    logprobs: list[TokenLogprob | None] | None  # per row; None when no row asks


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator for one request's sampling noise, seeded with the request's ``seed``."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def adjust_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Apply logit bias, the min_tokens ban and penalties in place (greedy rows too).

    These steps change which token is the argmax, so they come before greedy selection.
    """
    if md.bias_rows is not None:
        apply_logit_bias(logits, md.bias_rows, md.bias_token_ids, md.bias_values)
    if md.banned_rows is not None:
        apply_token_mask(logits, md.banned_rows, md.banned_token_ids)
    if md.penalties is not None:
        apply_penalties(logits, md.penalties)
    return logits


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


class Sampler:
    """Samples one token per row from a step's logits (see the module docstring)."""

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """Sample from ``logits`` (float32 ``[num_rows, vocab]``, left unmodified).

        Greedy rows are exactly ``torch.argmax`` of the adjusted logits (first index on
        ties). Logprobs, for rows asking, are from the raw logits.
        """
        if logits.dim() != 2 or logits.shape[0] != md.num_rows:
            raise ValueError(f"Sampler expects logits [num_rows={md.num_rows}, vocab]; "
                             f"got shape {tuple(logits.shape)}")
        logprobs = None
        if md.logprob_rows is not None:
            raw_logprobs = logits[md.logprob_rows].float().log_softmax(dim=-1)
        if md.needs_logit_adjustment or not md.all_greedy:
            logits = adjust_logits(logits.to(torch.float32, copy=True), md)
        greedy_ids = None if md.all_random else logits.argmax(dim=-1)
        if md.all_greedy:
            sampled = greedy_ids
        else:
            random_ids = sample_from_probs(compute_probs(logits, md), md.generators)
            sampled = random_ids if greedy_ids is None else torch.where(
                md.is_greedy, greedy_ids, random_ids)
        if md.logprob_rows is not None:
            asking = to_token_logprobs(
                sampled[md.logprob_rows], raw_logprobs,
                [n for n in md.num_logprobs if n is not None])
            logprobs = [None] * md.num_rows
            rows = [i for i, n in enumerate(md.num_logprobs) if n is not None]
            for row, entry in zip(rows, asking, strict=True):
                logprobs[row] = entry
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

"""Logit adjustments that follow from a request's own tokens and explicit asks: logit
bias, token bans (min_tokens, bad_words), allowed token ids, and repetition /
frequency / presence penalties.

Every function acts in place on float32 logits ``[num_rows, vocab]`` and is vectorised
over the batch; the tensors they take are built once per step by
:class:`lmkit.sample.metadata.SamplingMetadata`. Rows that do not ask for an adjustment
carry neutral values (penalty 1.0 or 0.0) and no token pairs, so their logits are not
touched.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from lmkit.api.sampling_kernels import PenaltyRows
from lmkit.api.sampling_params import SamplingParams
from lmkit.sample.row_cache import SamplingCache, put_scalar


def build_penalty_tensors(
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device,
    cache: SamplingCache | None = None,
    keys: Sequence[Hashable] | None = None,
) -> PenaltyRows | None:
    """The step's :class:`~lmkit.api.sampling_kernels.PenaltyRows`, or ``None`` when no
    row uses penalties.

    With a ``cache`` (and each row's request ``keys``) a request's counts carry over
    from its last step and only its new tokens are added; without one every row counts
    its tokens afresh. Only rows with penalties are read; the prompt only for a
    repetition penalty.
    """
    rows = [i for i, p in enumerate(params) if p.needs_penalties]
    if not rows:
        return None
    if cache is None:
        cache, keys = SamplingCache(vocab_size, device), None
    return cache.penalty_rows(keys if keys is not None else range(len(params)), params,
                              prompt_token_ids, output_token_ids, rows)


def apply_penalties(logits: torch.Tensor, penalties: PenaltyRows) -> torch.Tensor:
    """Apply repetition, then frequency and presence penalties, in place: the torch
    implementation of :meth:`lmkit.api.SamplingKernels.apply_penalties` (which states
    the arithmetic exactly).

    Repetition (CTRL, Keskar et al. 2019) acts on every token seen in the prompt or the
    output: positive logits are divided by the penalty, negative ones multiplied.
    Frequency and presence (OpenAI) act on output tokens only:
    ``logit -= frequency * count + presence * (count > 0)``. Tokens a row has not seen
    keep their logits bit for bit.

    Args:
        logits: float32 ``[num_rows, vocab]``, modified in place.
        penalties: this step's :class:`~lmkit.api.sampling_kernels.PenaltyRows`.

    Returns:
        ``logits``.
    """
    # on the CPU, the few tokens each row has seen, found in one scan, cost less than
    # passes over whole rows; on CUDA those passes need no host sync, a scan would
    if logits.device.type == "cpu":
        return _apply_scanned(logits, penalties)
    return _apply_dense(logits, penalties)


def _apply_scanned(logits: torch.Tensor, penalties: PenaltyRows) -> torch.Tensor:
    t = penalties
    at, tokens = t.row_seen().nonzero(as_tuple=True)
    counts = t.counts[t.slots[at], tokens]
    if t.draft_counts is not None:
        counts = counts + t.draft_counts[at, tokens]
    rows = t.rows[at]
    logits[rows, tokens] = _penalized(logits[rows, tokens], counts, t.repetition[rows],
                                      t.frequency[rows], t.presence[rows])
    return logits


def _apply_dense(logits: torch.Tensor, penalties: PenaltyRows) -> torch.Tensor:
    t = penalties
    before = logits.index_select(0, t.rows)
    after = _penalized(before, t.row_counts(), *(v[t.rows][:, None] for v in (
        t.repetition, t.frequency, t.presence)))
    logits[t.rows] = torch.where(t.row_seen(), after, before)
    return logits


def _penalized(values: torch.Tensor, counts: torch.Tensor, repetition: torch.Tensor,
               frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    # apply_penalties' arithmetic on the values of seen tokens (the parameters broadcast
    # against them): repetition on all of them (1.0 leaves a value as it is), frequency
    # and presence on the generated ones
    counts = counts.to(torch.float32)
    values = torch.where(values > 0, values / repetition, values * repetition)
    return torch.where(counts > 0, values - (frequency * counts + presence), values)


def apply_logit_bias(
    logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, values: torch.Tensor
) -> torch.Tensor:
    """Add ``values[i]`` to ``logits[rows[i], token_ids[i]]`` in place (OpenAI logit_bias).

    Args:
        logits: float32 ``[num_rows, vocab]``.
        rows, token_ids: int64 ``[num_entries]``; values: float32 ``[num_entries]``.
    """
    logits.index_put_((rows, token_ids), values, accumulate=True)
    return logits


def apply_token_mask(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Forbid ``token_ids[i]`` in row ``rows[i]`` (logit set to -inf), in place.

    Used for min_tokens (EOS and the stop token ids are forbidden until a request has
    generated ``min_tokens`` tokens) and for bad_words.
    """
    put_scalar(logits, (rows, token_ids), float("-inf"))
    return logits


def apply_allowed_tokens(logits: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor
                         ) -> torch.Tensor:
    """Forbid, in each of ``rows``, every token its ``mask`` row does not allow, in place.

    Args:
        logits: float32 ``[num_rows, vocab]``.
        rows: int64 ``[num_allowed_rows]``, the rows with ``allowed_token_ids``.
        mask: bool ``[num_allowed_rows, vocab]``, True where a token is allowed.
    """
    logits[rows] = logits[rows].masked_fill_(~mask, float("-inf"))
    return logits

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

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from lmkit.api.sampling_params import SamplingParams


@dataclass
class PenaltyTensors:
    """Per-row penalty parameters and, sparsely, the tokens they act on.

    Penalties only touch tokens a request has seen, so they are stored as (row, token)
    pairs rather than ``[num_rows, vocab]`` tables: applying them costs O(tokens seen),
    not O(rows x vocab). Rows without penalties contribute no pairs.
    """

    repetition: torch.Tensor  # float32 [num_rows], 1.0 = off
    frequency: torch.Tensor  # float32 [num_rows], 0.0 = off
    presence: torch.Tensor  # float32 [num_rows], 0.0 = off
    # Distinct generated tokens and how often each was generated.
    output_rows: torch.Tensor  # int64 [num_pairs]
    output_token_ids: torch.Tensor  # int64 [num_pairs]
    output_counts: torch.Tensor  # float32 [num_pairs]
    # Distinct tokens in prompt or output, for rows with a repetition penalty (else None).
    seen_rows: torch.Tensor | None = None  # int64 [num_seen]
    seen_token_ids: torch.Tensor | None = None  # int64 [num_seen]


def _distinct_pairs(
    token_ids: Sequence[Sequence[int]], rows: Sequence[int], vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct (row, token id) pairs of the token lists of ``rows``, as flat indices
    ``row * vocab_size + token`` (int64) and the number of times each occurs."""
    lengths = torch.tensor([len(token_ids[r]) for r in rows], dtype=torch.int64)
    row_idx = torch.repeat_interleave(torch.tensor(list(rows), dtype=torch.int64), lengths)
    tok_idx = torch.tensor(list(chain.from_iterable(token_ids[r] for r in rows)), dtype=torch.int64)
    # Token ids outside the logits' width cannot be penalised (they can't be sampled).
    keep = (tok_idx >= 0) & (tok_idx < vocab_size)
    flat = row_idx[keep] * vocab_size + tok_idx[keep]
    return torch.unique(flat, return_counts=True)


def build_penalty_tensors(
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device,
) -> PenaltyTensors | None:
    """Build the penalty tensors for one step, or ``None`` when no row uses penalties.

    Only rows with penalties are scanned, so a batch where one request asks for a
    penalty pays for that request's tokens only; the prompt is scanned only for a
    repetition penalty.
    """
    rows = [i for i, p in enumerate(params) if p.needs_penalties]
    if not rows:
        return None
    out_flat, out_counts = _distinct_pairs(output_token_ids, rows, vocab_size)
    pen = PenaltyTensors(
        repetition=torch.tensor([p.repetition_penalty for p in params],
                                dtype=torch.float32).to(device),
        frequency=torch.tensor([p.frequency_penalty for p in params],
                               dtype=torch.float32).to(device),
        presence=torch.tensor([p.presence_penalty for p in params],
                              dtype=torch.float32).to(device),
        output_rows=(out_flat // vocab_size).to(device),
        output_token_ids=(out_flat % vocab_size).to(device),
        output_counts=out_counts.to(torch.float32).to(device),
    )
    rep_rows = [i for i in rows if params[i].repetition_penalty != 1.0]
    if rep_rows:
        prompt_flat, _ = _distinct_pairs(prompt_token_ids, rep_rows, vocab_size)
        rep_out = out_flat[torch.isin(out_flat // vocab_size, torch.tensor(rep_rows))]
        seen = torch.unique(torch.cat([prompt_flat, rep_out]))
        pen.seen_rows = (seen // vocab_size).to(device)
        pen.seen_token_ids = (seen % vocab_size).to(device)
    return pen


def apply_penalties(logits: torch.Tensor, penalties: PenaltyTensors) -> torch.Tensor:
    """Apply repetition, then frequency and presence penalties, in place.

    Repetition (CTRL, Keskar et al. 2019) acts on every token seen in the prompt or the
    output: positive logits are divided by the penalty, negative ones multiplied.
    Frequency and presence (OpenAI) act on output tokens only:
    ``logit -= frequency * count + presence * (count > 0)``.

    Args:
        logits: float32 ``[num_rows, vocab]``, modified in place.
        penalties: this step's :class:`PenaltyTensors`.

    Returns:
        ``logits``.
    """
    if penalties.seen_rows is not None:
        rows, token_ids = penalties.seen_rows, penalties.seen_token_ids
        values = logits[rows, token_ids]  # [num_seen]
        scale = penalties.repetition[rows]
        logits[rows, token_ids] = torch.where(values > 0, values / scale, values * scale)
    rows, token_ids = penalties.output_rows, penalties.output_token_ids
    if rows.numel():
        # Pairs are distinct, so a plain indexed write is exact.
        logits[rows, token_ids] -= (penalties.frequency[rows] * penalties.output_counts
                                    + penalties.presence[rows])
    return logits


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
    logits[rows, token_ids] = float("-inf")
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

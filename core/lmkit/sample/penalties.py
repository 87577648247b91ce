"""Logit adjustments that follow from a request's own tokens and explicit asks: logit
bias, the min_tokens mask, and repetition / frequency / presence penalties.

Every function acts in place on float32 logits ``[num_rows, vocab]`` and is vectorised
over the batch; the tensors they take are built once per step by
:class:`lmkit.sample.metadata.SamplingMetadata`. Rows that do not ask for an adjustment
carry neutral values (penalty 1.0 or 0.0), which leave their logits bit-for-bit unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from lmkit.engine.sampling_params import SamplingParams


@dataclass
class PenaltyTensors:
    """Per-row penalty parameters and the token statistics they act on.

    ``prompt_mask`` is ``None`` when no row has a repetition penalty (the prompt matters
    only to that one); ``output_counts`` is always present. Rows without penalties have
    empty statistics and neutral parameters.
    """

    repetition: torch.Tensor  # float32 [num_rows], 1.0 = off
    frequency: torch.Tensor  # float32 [num_rows], 0.0 = off
    presence: torch.Tensor  # float32 [num_rows], 0.0 = off
    output_counts: torch.Tensor  # int32 [num_rows, vocab]: times each token was generated
    prompt_mask: torch.Tensor | None  # bool [num_rows, vocab]: token occurs in the prompt


def _scatter_rows(
    token_ids: Sequence[Sequence[int]], rows: Sequence[int], vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten the token lists of ``rows`` into (row index, token id) int64 tensors."""
    lengths = torch.tensor([len(token_ids[r]) for r in rows], dtype=torch.int64)
    row_idx = torch.repeat_interleave(torch.tensor(list(rows), dtype=torch.int64), lengths)
    tok_idx = torch.tensor(list(chain.from_iterable(token_ids[r] for r in rows)), dtype=torch.int64)
    # Token ids outside the logits' width cannot be penalised (they can't be sampled).
    keep = (tok_idx >= 0) & (tok_idx < vocab_size)
    return row_idx[keep], tok_idx[keep]


def build_penalty_tensors(
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device,
) -> PenaltyTensors | None:
    """Build the penalty tensors for one step, or ``None`` when no row uses penalties.

    Only rows with penalties contribute token statistics, so a batch where one request
    asks for a penalty pays for that request's tokens only (O(its tokens)).
    """
    rows = [i for i, p in enumerate(params) if p.needs_penalties]
    if not rows:
        return None
    num_rows = len(params)
    counts = torch.zeros(num_rows, vocab_size, dtype=torch.int32)
    row_idx, tok_idx = _scatter_rows(output_token_ids, rows, vocab_size)
    counts.index_put_((row_idx, tok_idx), torch.ones_like(tok_idx, dtype=torch.int32),
                      accumulate=True)
    prompt_mask = None
    rep_rows = [i for i in rows if params[i].repetition_penalty != 1.0]
    if rep_rows:
        prompt_mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool)
        row_idx, tok_idx = _scatter_rows(prompt_token_ids, rep_rows, vocab_size)
        prompt_mask[row_idx, tok_idx] = True
        prompt_mask = prompt_mask.to(device)
    return PenaltyTensors(
        repetition=torch.tensor([p.repetition_penalty for p in params],
                                dtype=torch.float32).to(device),
        frequency=torch.tensor([p.frequency_penalty for p in params],
                               dtype=torch.float32).to(device),
        presence=torch.tensor([p.presence_penalty for p in params],
                              dtype=torch.float32).to(device),
        output_counts=counts.to(device),
        prompt_mask=prompt_mask,
    )


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
    output_mask = penalties.output_counts > 0  # [num_rows, vocab]
    if penalties.prompt_mask is not None:
        seen = output_mask | penalties.prompt_mask
        scale = torch.where(seen, penalties.repetition.unsqueeze(1), 1.0)  # [num_rows, vocab]
        logits.copy_(torch.where(logits > 0, logits / scale, logits * scale))
    logits -= penalties.frequency.unsqueeze(1) * penalties.output_counts
    logits -= penalties.presence.unsqueeze(1) * output_mask
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

    Used for min_tokens: EOS and the stop token ids are forbidden until a request has
    generated ``min_tokens`` tokens.
    """
    logits[rows, token_ids] = float("-inf")
    return logits

"""The mathematics of speculative verification, as batched torch over flat rows.

Layout (the model runner's): request ``i`` with ``k_i`` drafts owns ``k_i + 1``
consecutive rows; row ``j < k_i`` holds the target distribution at draft ``j`` (given
the drafts before it), the last row the bonus position after every draft. Draft rows
are addressed by ``draft_rows`` (int64 ``[num_drafts]``, the flat row of each draft).

Rejection sampling (Leviathan et al. 2023; Chen et al. 2023) accepts draft ``d`` drawn
from ``q`` with probability ``min(1, p(d) / q(d))``; at the first rejection the output
is drawn from ``norm(max(0, p - q))``, and when every draft is accepted a bonus token is
drawn from the target at the last row. The tokens emitted are then distributed exactly
as if sampled from ``p`` one at a time. A deterministic draft is the one-hot ``q``:
accepted with probability ``p(d)``, recovered from ``p`` with ``d`` removed. Greedy
requests accept the longest prefix of drafts equal to the target's argmax.
"""

from __future__ import annotations

import torch

from lmkit.sample.row_cache import put_scalar


def recovery_weights(probs: torch.Tensor, draft_rows: torch.Tensor,
                     draft_token_ids: torch.Tensor, q_rows: torch.Tensor | None = None,
                     q: torch.Tensor | None = None) -> torch.Tensor:
    """The (unnormalised) distribution each row's output is drawn from if reached.

    Draft rows get ``max(0, p - q)`` (one-hot ``q`` when a draft has no distribution:
    ``p`` with the draft token zeroed); every other row (bonus rows) keeps ``p``.

    Args:
        probs: float32 ``[num_rows, vocab]`` target distributions (not modified).
        draft_rows: int64 ``[num_drafts]``, the row of each draft.
        draft_token_ids: int64 ``[num_drafts]``.
        q_rows: int64 ``[num_q]``, the rows (a subset of ``draft_rows``) whose drafts
            come with a distribution; ``None`` when none does.
        q: float32 ``[num_q, vocab]``, those distributions.

    Returns:
        float32 ``[num_rows, vocab]`` non-negative weights.
    """
    weights = probs.clone()
    put_scalar(weights, (draft_rows, draft_token_ids), 0.0)
    if q_rows is not None and q is not None and q_rows.numel():
        weights[q_rows] = (probs[q_rows] - q).clamp_(min=0.0)
    return weights


def accept_probabilistic(probs: torch.Tensor, draft_rows: torch.Tensor,
                         draft_token_ids: torch.Tensor, q_at_draft: torch.Tensor,
                         uniform: torch.Tensor) -> torch.Tensor:
    """Whether each draft passes its test ``u < p(d) / q(d)`` (i.e. ``u * q(d) < p(d)``).

    Args:
        probs: float32 ``[num_rows, vocab]`` target distributions.
        draft_rows, draft_token_ids: int64 ``[num_drafts]``.
        q_at_draft: float32 ``[num_drafts]``, each draft's own probability under its
            draft distribution (1.0 for deterministic drafts).
        uniform: float32 ``[num_drafts]`` in ``[0, 1)``.

    Returns:
        bool ``[num_drafts]``. A draft the target gives zero probability never passes.
    """
    p_at_draft = probs[draft_rows, draft_token_ids]
    return uniform * q_at_draft < p_at_draft


def count_accepted(accepted: torch.Tensor, draft_req: torch.Tensor, draft_pos: torch.Tensor,
                   num_reqs: int, max_drafts: int) -> torch.Tensor:
    """Per request, the length of the leading run of accepted drafts.

    Args:
        accepted: bool ``[num_drafts]``.
        draft_req: int64 ``[num_drafts]``, the request of each draft.
        draft_pos: int64 ``[num_drafts]``, its position among that request's drafts.
        num_reqs: requests in the step (including those without drafts).
        max_drafts: the most drafts of any request.

    Returns:
        int64 ``[num_reqs]``, each in ``[0, k_i]``.
    """
    grid = torch.zeros(num_reqs, max(max_drafts, 1), dtype=torch.int64,
                       device=accepted.device)  # [num_reqs, max_drafts]; padding rejects
    grid[draft_req, draft_pos] = accepted.to(torch.int64)
    return grid.cumprod(dim=1).sum(dim=1)


def select_output_tokens(row_tokens: torch.Tensor, draft_rows: torch.Tensor,
                         draft_token_ids: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """Each row's output token if the request's output reaches that row: the draft
    where it was accepted, else the row's own sample (recovered or bonus token).

    Args:
        row_tokens: int64 ``[num_rows]``, the token sampled at each row (greedy rows:
            the argmax; random rows: a draw from :func:`recovery_weights`).
        draft_rows, draft_token_ids: int64 ``[num_drafts]``.
        accepted: bool ``[num_drafts]``.

    Returns:
        int64 ``[num_rows]`` (a new tensor).
    """
    out = row_tokens.clone()
    out[draft_rows] = torch.where(accepted, draft_token_ids, row_tokens[draft_rows])
    return out

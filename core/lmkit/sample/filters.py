"""Temperature and truncation filters (min-p, top-k, top-p) and the final softmax.

Each function takes per-row parameter tensors, not requests, so the same steps serve
plain sampling (one row per request) and speculative-decoding verification (several
rows per request, the parameters repeated per row). All act in place on float32 logits
``[num_rows, vocab]``; a filtered-out token gets logit ``-inf``. The order follows
vLLM v1: temperature, min-p, then top-k and top-p (top-p measured on the distribution
left by top-k).
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature (float32 ``[num_rows]``, all > 0), in place."""
    return logits.div_(temperature.unsqueeze(1))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep tokens whose probability is at least ``min_p`` times the row's top probability.

    Args:
        logits: float32 ``[num_rows, vocab]`` (after temperature), modified in place.
        min_p: float32 ``[num_rows]``; 0.0 keeps every token.
    """
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [num_rows, 1]
    return logits.masked_fill_(probs < threshold, _NEG_INF)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits (ties with the k-th value are kept too).

    Args:
        logits: float32 ``[num_rows, vocab]``, modified in place.
        top_k: int64 ``[num_rows]``; a value >= vocab turns the filter off for that row.
        max_top_k: the largest ``top_k`` below vocab over the rows (bounds the topk call);
            0 to compute it here (one device-to-host sync).
    """
    vocab_size = logits.shape[-1]
    if max_top_k <= 0:
        max_top_k = int(top_k.max())
    max_top_k = min(max_top_k, vocab_size)
    values = logits.topk(max_top_k, dim=-1).values  # [num_rows, max_top_k], descending
    k = top_k.clamp(min=1, max=max_top_k)
    kth = values.gather(1, (k - 1).unsqueeze(1))  # [num_rows, 1]
    kth.masked_fill_((top_k >= vocab_size).unsqueeze(1), _NEG_INF)
    return logits.masked_fill_(logits < kth, _NEG_INF)


# Top-p first looks for the nucleus among this many most likely tokens; rows whose
# nucleus is larger (very flat distributions) fall back to a full sort.
_TOP_P_CANDIDATES = 256


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
    max_top_k: int = 0,
) -> torch.Tensor:
    """Apply top-k, then top-p (nucleus), in place; either may be ``None`` (off for all rows).

    Top-p keeps the most likely tokens while the probability mass before them (in
    order of decreasing probability) is below ``top_p``, measured on the distribution
    left by top-k; the most likely token is always kept. Tokens tied with the last kept
    one are kept too, as in top-k. Most nuclei lie within a few hundred tokens, so a
    ``topk`` of candidates replaces the full sort for the rows where that is enough.

    Args:
        logits: float32 ``[num_rows, vocab]``.
        top_k: int64 ``[num_rows]`` (>= vocab: off) or ``None``.
        top_p: float32 ``[num_rows]`` in (0, 1] (1.0: off) or ``None``.
        max_top_k: largest active ``top_k`` (bounds the ``topk`` call; 0: compute it).
    """
    if top_k is not None:
        apply_top_k(logits, top_k, max_top_k)
    if top_p is None:
        return logits
    probs = logits.softmax(dim=-1)
    num_candidates = min(_TOP_P_CANDIDATES, logits.shape[-1])
    cand_probs = probs.topk(num_candidates, dim=-1).values  # [num_rows, num_candidates]
    mass_before = cand_probs.cumsum(dim=-1) - cand_probs  # exclusive cumulative sum
    is_off = top_p >= 1.0
    # The nucleus fits among the candidates once their total mass reaches top_p.
    fits = is_off | (mass_before[:, -1] + cand_probs[:, -1] >= top_p)
    num_kept = (mass_before < top_p.unsqueeze(1)).sum(dim=-1).clamp(min=1)  # [num_rows]
    threshold = cand_probs.gather(1, (num_kept - 1).unsqueeze(1))  # [num_rows, 1]
    threshold.masked_fill_(~fits.unsqueeze(1) | is_off.unsqueeze(1), 0.0)
    logits.masked_fill_(probs < threshold, _NEG_INF)
    if not bool(fits.all()):
        rows = torch.nonzero(~fits).flatten()
        logits[rows] = _top_p_by_sort(logits[rows], top_p[rows])
    return logits


def _top_p_by_sort(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p over a full ascending sort of each row (returns a new tensor)."""
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    cum_probs = logits_sort.softmax(dim=-1).cumsum(dim=-1)  # this token + less likely ones
    drop = cum_probs <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False  # always keep the most likely token
    logits_sort.masked_fill_(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, logits_idx, logits_sort)


def logits_to_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    max_top_k: int = 0,
) -> torch.Tensor:
    """Turn (already biased and penalised) logits into the distribution to sample from.

    Applies temperature, min-p, top-k and top-p in that order and returns the softmax,
    float32 ``[num_rows, vocab]``. ``logits`` is modified in place. Any argument left
    ``None`` is off for every row.
    """
    if temperature is not None:
        apply_temperature(logits, temperature)
    if min_p is not None:
        apply_min_p(logits, min_p)
    apply_top_k_top_p(logits, top_k, top_p, max_top_k)
    return logits.softmax(dim=-1)

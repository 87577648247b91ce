"""Log-probabilities of chosen tokens, their ranks, and the top alternatives.

Values come from the raw distribution, ``log_softmax`` of the model's logits before any
bias, penalty, temperature or filter (vLLM's default ``raw_logprobs``). The work is one
batched ``gather`` / ``topk`` / compare plus a single device-to-host copy; building the
:class:`TokenLogprob` objects is O(rows) Python (the alternatives are sliced out of two
packed byte strings).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmkit.api.outputs import TokenLogprob


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chosen-token logprob and rank, and the ``num_top`` best alternatives, per row.

    Args:
        logprobs: float32 ``[num_rows, vocab]`` log-probabilities.
        token_ids: int64 ``[num_rows]``, the chosen (sampled or target) tokens.
        num_top: alternatives to return per row (0 for none).

    Returns:
        ``(token_logprobs [num_rows], ranks [num_rows], top_ids [num_rows, num_top],
        top_logprobs [num_rows, num_top])``. A rank is 1 + the number of tokens with a
        strictly larger logprob, so the most likely token has rank 1.
    """
    token_logprobs = logprobs.gather(1, token_ids.unsqueeze(1))  # [num_rows, 1]
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    num_top = min(num_top, logprobs.shape[-1])
    if num_top > 0:
        top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    else:
        top_logprobs = logprobs.new_empty(logprobs.shape[0], 0)
        top_ids = token_ids.new_empty(logprobs.shape[0], 0)
    return token_logprobs.squeeze(1), ranks, top_ids, top_logprobs


def _packed(t: torch.Tensor, dtype: torch.dtype, layout: str) -> bytes:
    """``t``'s values as host bytes in ``layout`` (a numpy dtype: little-endian, 8 bytes)."""
    return t.detach().to("cpu", dtype).numpy().astype(layout, copy=False).tobytes()


def to_token_logprobs(
    token_ids: torch.Tensor, logprobs: torch.Tensor, num_tops: Sequence[int]
) -> list[TokenLogprob]:
    """Build one :class:`TokenLogprob` per row, keeping ``num_tops[i]`` alternatives.

    Args:
        token_ids: int64 ``[num_rows]``, the chosen tokens.
        logprobs: float32 ``[num_rows, vocab]`` raw log-probabilities of those rows.
        num_tops: alternatives wanted per row.
    """
    max_top = max(num_tops, default=0)
    token_lp, ranks, top_ids, top_lp = gather_logprobs(logprobs, token_ids, max_top)
    # Host copies once per call, never per row: the alternatives come over as two byte
    # strings in TokenLogprob's packed layout, and each row takes a slice of them.
    ids_l, lp_l, rank_l = token_ids.tolist(), token_lp.tolist(), ranks.tolist()
    k = top_ids.shape[1]
    raw_ids, raw_lps = _packed(top_ids, torch.int64, "<i8"), _packed(top_lp, torch.float64, "<f8")
    make = TokenLogprob.from_packed
    entries = []
    for i, n in enumerate(num_tops):
        start = 8 * i * k
        end = start + 8 * min(n, k)
        entries.append(make(ids_l[i], lp_l[i], rank_l[i], raw_ids[start:end],
                            raw_lps[start:end]))
    return entries


def compute_prompt_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, num_top: int
) -> list[TokenLogprob]:
    """Logprobs of prompt tokens: row ``i`` of ``logits`` scores ``target_ids[i]``.

    Args:
        logits: ``[num_positions, vocab]``, the model's raw logits at the positions
            before each target (any float dtype; computed in float32).
        target_ids: int64 ``[num_positions]``, the prompt token that followed.
        num_top: alternatives per position (the request's ``prompt_logprobs``).

    Returns:
        One :class:`TokenLogprob` per position, in order.
    """
    if logits.shape[0] != target_ids.shape[0]:
        raise ValueError(f"compute_prompt_logprobs needs one target per logits row; got "
                         f"{logits.shape[0]} rows and {target_ids.shape[0]} targets")
    if logits.shape[0] == 0:
        return []
    logprobs = logits.float().log_softmax(dim=-1)
    target_ids = target_ids.to(device=logits.device, dtype=torch.int64)
    return to_token_logprobs(target_ids, logprobs, [num_top] * logits.shape[0])

"""Grammar bitmasks: packed int32 masks of allowed tokens, applied to logits.

A bitmask row has ``ceil(vocab / 32)`` int32 words; token ``t`` is allowed when bit
``t % 32`` of word ``t // 32`` is set (xgrammar's and llguidance's layout, so their
matchers fill rows directly). The scheduler side fills one row per sampled position of
each constrained request (``SchedulerOutput.grammar_bitmask``, rows located by
``SchedulerOutput.structured_output_request_ids``); the model runner scatters those rows
onto the logits rows the sampler sees (:func:`logits_bitmask`) and masks the logits in
place before sampling (:func:`apply_token_bitmask`, or the structured-output backend's
own kernel on GPU).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

BITS_PER_WORD = 32

ApplyBitmask = Callable[[torch.Tensor, torch.Tensor, "Sequence[int] | None"], None]


def bitmask_words(vocab_size: int) -> int:
    """Words per bitmask row for a vocabulary of ``vocab_size`` tokens."""
    return -(-vocab_size // BITS_PER_WORD)


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """A CPU int32 bitmask ``[num_rows, ceil(vocab_size / 32)]`` allowing every token."""
    return torch.full((num_rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


_BIT_CACHE: dict[torch.device, torch.Tensor] = {}


def _bits(device: torch.device) -> torch.Tensor:
    """int32 ``[32]``: ``1 << i`` (bit 31 is the sign bit, ``-2**31``)."""
    bits = _BIT_CACHE.get(device)
    if bits is None:
        bits = (torch.ones(BITS_PER_WORD, dtype=torch.int64) << torch.arange(BITS_PER_WORD))
        bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).to(device)
        _BIT_CACHE[device] = bits
    return bits


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool ``[num_rows, vocab_size]``: which tokens each row allows."""
    # bitmask: [rows, words] -> [rows, words, 32] -> [rows, words * 32]
    allowed = (bitmask.unsqueeze(-1) & _bits(bitmask.device)) != 0
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab_size]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        indices: Sequence[int] | None = None) -> None:
    """Set ``logits[i, t] = -inf`` where ``bitmask[i]`` does not allow ``t``, for rows
    ``i`` in ``indices`` (every row when ``None``); in place, vectorised torch.

    ``logits``: float ``[num_rows, vocab]``; ``bitmask``: int32 ``[num_rows, words]``
    with ``words >= ceil(vocab / 32)``, on the same device (the semantics of xgrammar's
    ``apply_token_bitmask_inplace``). Tokens past ``words * 32`` are masked.
    """
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"apply_token_bitmask needs logits [rows, vocab] and an int32 bitmask "
                         f"[rows, words]; got {tuple(logits.shape)} and "
                         f"{bitmask.dtype} {tuple(bitmask.shape)}")
    vocab = logits.shape[1]
    width = min(vocab, bitmask.shape[1] * BITS_PER_WORD)
    if indices is None:
        if bitmask.shape[0] != logits.shape[0]:
            raise ValueError(f"bitmask has {bitmask.shape[0]} rows for {logits.shape[0]} "
                             "logits rows; pass indices or one bitmask row per logits row")
        _mask_rows(logits, bitmask, width)
        return
    index = torch.as_tensor(list(indices), dtype=torch.int64).to(logits.device)
    rows = logits.index_select(0, index)
    _mask_rows(rows, bitmask.index_select(0, index), width)
    logits.index_copy_(0, index, rows)


def _mask_rows(logits: torch.Tensor, bitmask: torch.Tensor, width: int) -> None:
    logits[:, :width].masked_fill_(~unpack_bitmask(bitmask, width), float("-inf"))
    if width < logits.shape[1]:
        logits[:, width:] = float("-inf")


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor,
                                  indices: Sequence[int] | None = None) -> None:
    """Token-by-token reference of :func:`apply_token_bitmask` (tests only: slow)."""
    rows = range(logits.shape[0]) if indices is None else indices
    for i in rows:
        for t in range(logits.shape[1]):
            word, bit = divmod(t, BITS_PER_WORD)
            if word >= bitmask.shape[1] or not (int(bitmask[i, word]) >> bit) & 1:
                logits[i, t] = float("-inf")


def logits_bitmask(bitmask: torch.Tensor, first_row_of: Mapping[str, int],
                   sampled_req_ids: Sequence[str], num_samples: Sequence[int]
                   ) -> tuple[torch.Tensor, list[int]] | None:
    """Reorder the scheduler's bitmask rows to the sampler's logits rows.

    The sampler's logits hold, for each sampling request in ``sampled_req_ids`` order,
    ``num_samples[k]`` consecutive rows (1, or 1 + its draft tokens). A constrained
    request owns as many consecutive bitmask rows from ``first_row_of[req_id]``.
    Returns ``(bitmask aligned with the logits rows, constrained logits rows)``, or
    ``None`` when no sampling request is constrained.
    """
    logit_rows: list[int] = []
    mask_rows: list[int] = []
    row = 0
    for rid, n in zip(sampled_req_ids, num_samples, strict=True):
        first = first_row_of.get(rid)
        if first is not None:
            logit_rows.extend(range(row, row + n))
            mask_rows.extend(range(first, first + n))
        row += n
    if not logit_rows:
        return None
    if logit_rows == mask_rows and row == bitmask.shape[0]:
        return bitmask, logit_rows  # already aligned (every sampled row constrained, in order)
    aligned = torch.full((row, bitmask.shape[1]), -1, dtype=torch.int32)
    aligned.index_copy_(0, torch.tensor(logit_rows),
                        bitmask.index_select(0, torch.tensor(mask_rows)))
    return aligned, logit_rows


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                          first_row_of: Mapping[str, int], sampled_req_ids: Sequence[str],
                          num_samples: Sequence[int],
                          apply: ApplyBitmask = apply_token_bitmask) -> None:
    """Mask the sampler's ``logits`` in place with the scheduler's ``bitmask`` (see
    :func:`logits_bitmask` for the row layout); ``apply`` is the kernel (the
    structured-output backend's ``apply_token_bitmask``)."""
    aligned = logits_bitmask(bitmask, first_row_of, sampled_req_ids, num_samples)
    if aligned is None:
        return
    mask, rows = aligned
    pin = logits.device.type == "cuda"
    mask = (mask.pin_memory() if pin else mask).to(logits.device, non_blocking=pin)
    apply(logits, mask, rows)


def bitmask_kernel(registration: Any) -> ApplyBitmask:
    """The structured-output backend's ``apply_token_bitmask`` (the registration chosen
    for ``structured_output``, loaded on first call), or :func:`apply_token_bitmask`
    when there is none."""
    if registration is None:
        return apply_token_bitmask

    def apply(logits: torch.Tensor, bitmask: torch.Tensor,
              indices: Sequence[int] | None = None) -> None:
        registration.spec.load().apply_token_bitmask(logits, bitmask, indices)

    return apply

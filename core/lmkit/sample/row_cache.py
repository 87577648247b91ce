"""What a request's own sampling parameters make of its logits, kept across steps.

Logit bias, allowed token ids and the repetition / frequency / presence penalties
depend on a request's parameters (fixed for its life) and, for the penalties, on its
tokens (which only grow). Built from scratch every step, they cost O(tokens) of host
work per step: at 256 requests of 1,024 tokens each with a repetition penalty, ~80 ms
of Python and ``torch.unique`` per step, an order of magnitude more than the GPU's
decode step; 256 requests with 2,048 ``allowed_token_ids`` each, ~160 ms (a
``[rows, vocab]`` mask filled on the host and copied over every step).

:class:`SamplingCache` keeps them per request instead, on the logits' device:

* the logit bias as two small tensors (token ids, values), checked once;
* the allowed token ids as a row of a ``bool [slots, vocab]`` table, written once;
* the penalties as a row of an ``int32 [slots, vocab]`` table of output-token counts
  and a row of a ``bool [slots, vocab]`` table of the tokens the request has seen (its
  output's, and its prompt's for a repetition penalty), to which each step adds only
  the tokens generated since the last (one upload).

A step gathers its rows' allowed-ids rows on the device; the penalties go to the
sampling kernels as the tables themselves and each row's slot
(:class:`~lmkit.api.sampling_kernels.PenaltyRows`), no copy per step. Tables grow by doubling and are
allocated only when a request asks for what they hold (``slots x vocab`` x 5 bytes
for the penalties, x 1 for allowed ids). Entries belong to a request id; the runner
drops those of requests it no longer holds (:meth:`SamplingCache.forget`). An entry
is rebuilt when its request's parameters or output list are not the objects it was
built from (a request re-added after preemption), or the output got shorter.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from lmkit.api.sampling_kernels import PenaltyRows
from lmkit.api.sampling_params import SamplingParams
from lmkit.errors import InvalidRequestError


def upload(values: Sequence[Any] | torch.Tensor, dtype: torch.dtype, device: torch.device
           ) -> torch.Tensor:
    """``values`` (a sequence, or a host tensor) as a tensor of ``dtype`` on ``device``; to
    CUDA through pinned memory, asynchronously, so the host does not wait for the device's
    queued work (a decode step launched ahead builds its sampling tensors behind its own
    forward)."""
    cuda = device.type == "cuda"
    if isinstance(values, torch.Tensor):
        host = values.to(dtype)
        host = host.pin_memory() if cuda else host
    else:
        host = torch.tensor(values, dtype=dtype, pin_memory=cuda)
    return host.to(device, non_blocking=True)


def put_scalar(target: torch.Tensor, index: tuple[torch.Tensor, ...], value: float) -> None:
    """``target[index] = value`` for index tensors, without waiting for the device.

    Indexing assignment of a Python number copies the number to the device from
    pageable host memory, which waits for all the work queued on the stream: on CUDA,
    behind a decode step launched ahead, ``seen[rows, tokens] = True`` held every
    penalised step's host ~10 ms (session 31). The number is made on the device here."""
    target.index_put_(index, torch.full((), value, dtype=target.dtype, device=target.device))


class SlotTable:
    """Rows of ``width`` values of ``dtype`` on ``device``, handed out as slots; the
    tensor (:attr:`data`) doubles when full, so a slot's row moves but keeps its index."""

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device) -> None:
        self.width, self.dtype, self.device = width, dtype, device
        self.data = torch.zeros(0, width, dtype=dtype, device=device)
        self._free: list[int] = []

    def take(self) -> int:
        """A free slot, its row zeroed."""
        if not self._free:
            old = self.data.shape[0]
            grown = torch.zeros(max(4, 2 * old), self.width, dtype=self.dtype, device=self.device)
            grown[:old] = self.data
            self.data = grown
            self._free = list(range(grown.shape[0] - 1, old - 1, -1))
        slot = self._free.pop()
        self.data[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        """Give ``slot`` back."""
        self._free.append(slot)


@dataclass
class _Entry:
    params: SamplingParams
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # token ids, values
    allowed: int | None = None  # slot in the allowed table
    penalty: int | None = None  # slot in the counts and seen tables
    output: Sequence[int] | None = None  # the output list counted so far
    counted: int = 0  # its tokens already in the counts


class SamplingCache:
    """Per-request sampling tensors kept across steps (see the module docstring).

    Args:
        vocab_size: the logits' width.
        device: where the logits live.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._entries: dict[Hashable, _Entry] = {}
        self._allowed = SlotTable(vocab_size, torch.bool, device)
        self._counts = SlotTable(vocab_size, torch.int32, device)
        self._seen = SlotTable(vocab_size, torch.bool, device)

    def __len__(self) -> int:
        return len(self._entries)

    def forget(self, key: Hashable) -> None:
        """Drop the entry of request ``key``, if any."""
        if key in self._entries:
            self._drop(key)

    def _drop(self, key: Hashable) -> None:
        entry = self._entries.pop(key)
        if entry.allowed is not None:
            self._allowed.free(entry.allowed)
        if entry.penalty is not None:
            self._counts.free(entry.penalty)
            self._seen.free(entry.penalty)

    def _entry(self, key: Hashable, params: SamplingParams) -> _Entry:
        entry = self._entries.get(key)
        if entry is not None and entry.params is not params:
            self._drop(key)
            entry = None
        if entry is None:
            entry = self._entries[key] = _Entry(params)
        return entry

    def bias(self, key: Hashable, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """``params.logit_bias`` as (token ids int64, values float32) on the device.

        Raises:
            InvalidRequestError: a token id outside the vocabulary.
        """
        entry = self._entry(key, params)
        if entry.bias is None:
            bias = params.logit_bias or {}
            self._check_ids(bias, "logit_bias")
            entry.bias = (upload(list(bias), torch.int64, self.device),
                          upload(list(bias.values()), torch.float32, self.device))
        return entry.bias

    def allowed_slot(self, key: Hashable, params: SamplingParams) -> int:
        """The row of :meth:`allowed_table` that holds ``params.allowed_token_ids``.

        Raises:
            InvalidRequestError: a token id outside the vocabulary.
        """
        entry = self._entry(key, params)
        if entry.allowed is None:
            ids = params.allowed_token_ids or []
            self._check_ids(ids, "allowed_token_ids")
            slot = self._allowed.take()
            ids_at = upload(ids, torch.int64, self.device)
            put_scalar(self._allowed.data, (torch.full_like(ids_at, slot), ids_at), True)
            entry.allowed = slot
        return entry.allowed

    def allowed_table(self) -> torch.Tensor:
        """bool ``[slots, vocab]``: allowed token ids by slot."""
        return self._allowed.data

    def penalty_rows(self, keys: Sequence[Hashable], params: Sequence[SamplingParams],
                     prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                     rows: Sequence[int]) -> PenaltyRows:
        """The penalties of ``rows`` (each with its request ``keys[row]``,
        ``params[row]``, ``prompts[row]`` and ``outputs[row]``: the request's output
        itself, or that output extended by drafts (``DraftExtendedTokens``; those
        tokens count for the row alone, not for the request)), with every row's
        parameters (``params``: one per logits row)."""
        from lmkit.spec_decode.rows import DraftExtendedTokens

        slots: list[int] = []
        new_slots: list[int] = []
        new_tokens: list[int] = []
        draft_rows: list[int] = []
        draft_tokens: list[int] = []
        for i, row in enumerate(rows):
            p, out = params[row], outputs[row]
            base: Sequence[int] = out
            if isinstance(out, DraftExtendedTokens):
                base, drafts = out.base, out.drafts[:out.num_drafts]
                draft_rows.extend([i] * len(drafts))
                draft_tokens.extend(drafts)
            entry = self._entry(keys[row], p)
            size = len(base)
            if entry.penalty is None or entry.output is not base or size < entry.counted:
                self._start_counts(entry, p, prompts[row], base)
            slot, counted = entry.penalty, entry.counted
            if size == counted + 1:  # the usual decode step: one new token
                new_slots.append(slot)  # type: ignore[arg-type]
                new_tokens.append(base[counted])
                entry.counted = size
            elif size > counted:
                new_slots.extend([slot] * (size - counted))  # type: ignore[list-item]
                new_tokens.extend(base[counted:])
                entry.counted = size
            slots.append(slot)  # type: ignore[arg-type]
        counts, seen = self._counts.data, self._seen.data
        if new_tokens:
            at = self._pairs(new_slots, new_tokens)
            counts.index_put_(at, torch.ones_like(at[1], dtype=counts.dtype), accumulate=True)
            put_scalar(seen, at, True)
        # one upload for the three parameters: rows of a [3, width] tensor whose width
        # is a multiple of 4, so that each row starts 16-byte aligned (a kernel compiled
        # for aligned pointers is not recompiled at another batch size)
        n = len(params)
        pad = [0.0] * (-n % 4)
        values = upload([[p.repetition_penalty for p in params] + pad,
                         [p.frequency_penalty for p in params] + pad,
                         [p.presence_penalty for p in params] + pad], torch.float32,
                        self.device)[:, :n]
        table = PenaltyRows(upload(list(rows), torch.int64, self.device),
                            upload(slots, torch.int64, self.device), counts, seen, *values)
        if draft_tokens:
            draft_counts = torch.zeros(len(rows), self.vocab_size, dtype=counts.dtype,
                                       device=self.device)
            at = self._pairs(draft_rows, draft_tokens)
            draft_counts.index_put_(at, torch.ones_like(at[1], dtype=counts.dtype),
                                    accumulate=True)
            table = replace(table, draft_counts=draft_counts)
        return table

    def _start_counts(self, entry: _Entry, params: SamplingParams, prompt: Sequence[int],
                      output: Sequence[int]) -> None:
        if entry.penalty is None:
            entry.penalty = self._counts.take()
            taken = self._seen.take()
            assert taken == entry.penalty, "the counts and seen tables hand out slots together"
        else:
            self._counts.data[entry.penalty].zero_()
            self._seen.data[entry.penalty].zero_()
        if params.repetition_penalty != 1.0:
            ids = upload([t for t in prompt if 0 <= t < self.vocab_size], torch.int64,
                         self.device)
            put_scalar(self._seen.data, (torch.full_like(ids, entry.penalty), ids), True)
        entry.output, entry.counted = output, 0

    def _pairs(self, rows: list[int], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        # (row, token) index tensors on the device; tokens outside the logits' width
        # cannot be sampled, so nothing penalises them
        vocab = self.vocab_size
        kept = [(r, t) for r, t in zip(rows, tokens, strict=True) if 0 <= t < vocab]
        return (upload([r for r, _ in kept], torch.int64, self.device),
                upload([t for _, t in kept], torch.int64, self.device))

    def _check_ids(self, ids: Sequence[int] | dict[int, float], param: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"{param} names token id {bad}, but the model's vocabulary has ids "
                f"0..{self.vocab_size - 1}; remove it or use a valid id",
                param=param, code="invalid_value")


def with_row_tokens(penalties: PenaltyRows, tokens: torch.Tensor) -> PenaltyRows:
    """``penalties`` with one more generated token per row, counted for that row alone
    (in ``draft_counts``, made when ``None``; the kept tables are not touched): the
    token a request drew in a step whose output the host has not read yet.

    Args:
        penalties: a step's penalties (its ``draft_counts`` may be updated in place:
            they belong to the step).
        tokens: int64 ``[P]`` on the device, one per penalty row, in the vocabulary.
    """
    draft_counts = penalties.draft_counts
    if draft_counts is None:
        draft_counts = torch.zeros(tokens.numel(), penalties.counts.shape[1],
                                   dtype=torch.int32, device=tokens.device)
    at = (torch.arange(tokens.numel(), device=tokens.device), tokens)
    draft_counts.index_put_(at, torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
    return replace(penalties, draft_counts=draft_counts)

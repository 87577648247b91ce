"""A training step's inputs for ``lmkit spec train-eagle``, built as padded batch tensors.

Row ``p`` of a sequence ``s`` (``0 <= p < len(s) - 2``) pairs the embedding of token
``p + 1`` and the target's tapped features at ``p`` with the target's distribution over
the draft vocabulary at ``p + 1`` (its final hidden state there through the draft rows
of its language-model head). A step's sequences are right-padded into ``[batch, rows,
...]`` tensors at once: one embedding lookup, one product and one softmax for the whole
batch, instead of a handful of small operations per sequence.

Features read from a :class:`~lmkit_plugins.spec.eagle_features.FeatureCache` live on the
CPU; on CUDA they are gathered into pinned staging buffers and copied without blocking
the host, two buffers in turn, so the host builds the next step's batch while the device
still runs this one (a buffer is refilled only after its last copy finished). Padding
rows hold zeros (finite values: the loss masks them by multiplication).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

__all__ = ["StepBatch", "StepBatcher"]


@dataclass
class StepBatch:
    """One step's padded inputs (on the training device): ``embeds`` float32 ``[batch,
    rows, hidden]``, ``taps`` float32 ``[batch, rows, width]``, ``want`` float32 ``[batch,
    rows, draft vocab]`` (the target's distribution), ``lengths`` int64 ``[batch]`` (real
    rows per sequence) and ``starts`` int64 ``[batch]`` (each sequence's first row that
    trains)."""

    embeds: torch.Tensor
    taps: torch.Tensor
    want: torch.Tensor
    lengths: torch.Tensor
    starts: torch.Tensor


class StepBatcher:
    """Builds :class:`StepBatch` es for ``target`` (a
    :class:`~lmkit_plugins.spec.eagle_features.TargetFeatures`) on ``device``;
    ``draft_rows`` float32 ``[draft vocab, hidden]`` on ``device``."""

    def __init__(self, target: Any, draft_rows: torch.Tensor, device: str) -> None:
        self.target, self.draft_rows, self.device = target, draft_rows, device
        self._slots: list[dict[str, Any]] = [{}, {}]
        self._turn = 0

    def __call__(self, sequences: list[list[int]],
                 features: list[tuple[torch.Tensor, torch.Tensor]], starts: list[int]
                 ) -> StepBatch:
        """The batch of ``sequences`` (each at least 3 tokens), their ``(taps, final)``
        features (the cache's CPU views, or tensors on the device) and first rows that
        train. Small host tensors go through pinned memory, so nothing here waits for the
        device."""
        lengths = [len(s) - 2 for s in sequences]
        tokens = pad_sequence([torch.tensor(s[1:-1]) for s in sequences], batch_first=True)
        if features[0][0].device.type == "cpu" and self.device != "cpu":
            taps, final = self._staged(features, lengths)
        else:  # already where training runs: the CPU, or the target's own output
            taps = pad_sequence([t[:-2] for t, _ in features], batch_first=True)
            final = pad_sequence([f[1:-1] for _, f in features], batch_first=True)
        embeds = self.target.embed(self._moved(tokens))
        with torch.no_grad():
            want = torch.softmax(final.float() @ self.draft_rows.T, -1)
        return StepBatch(embeds, taps.float(), want,
                         self._moved(torch.tensor(lengths)), self._moved(torch.tensor(starts)))

    def _moved(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` on the device, through pinned memory without blocking on CUDA."""
        if self.device == "cpu":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _staged(self, features: list[tuple[torch.Tensor, torch.Tensor]], lengths: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather CPU features into this turn's pinned buffers and start their copies
        to the device (not blocking the host)."""
        slot = self._slots[self._turn]
        self._turn ^= 1
        if "done" in slot:
            slot["done"].synchronize()  # its previous copies have left the buffers
        rows, (t0, f0) = max(lengths), features[0]
        shape = (len(lengths), rows)
        taps, final = (_pinned(slot, name, shape, x) for name, x in (("taps", t0), ("final", f0)))
        for row, ((t, f), n) in enumerate(zip(features, lengths, strict=True)):
            taps[row, :n].copy_(t[:-2])
            final[row, :n].copy_(f[1:-1])
            taps[row, n:].zero_()
            final[row, n:].zero_()
        on_device = (taps.to(self.device, non_blocking=True),
                     final.to(self.device, non_blocking=True))
        slot["done"] = torch.cuda.Event()
        slot["done"].record()
        return on_device


def _pinned(slot: dict[str, Any], name: str, shape: tuple[int, int], like: torch.Tensor
            ) -> torch.Tensor:
    """A contiguous ``[*shape, width]`` view of the slot's pinned buffer ``name`` (grown,
    never shrunk, so steps of other lengths reuse it)."""
    size = shape[0] * shape[1] * like.shape[-1]
    if slot.get(name) is None or slot[name].numel() < size:
        slot[name] = torch.empty(size, dtype=like.dtype, pin_memory=True)
    return slot[name][:size].view(*shape, like.shape[-1])

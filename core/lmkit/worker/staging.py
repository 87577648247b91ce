"""Small host arrays to the device without a host synchronisation.

``torch.as_tensor(array).to(device)`` from pageable memory makes the host wait for the
device stream (a blocking copy synchronises it): between a draft head's kernels, each
such copy stalls the host until the device has caught up. :class:`StepStaging` copies
through page-locked host buffers instead (``non_blocking``), filled front to back
within one step, so a step's copies queue behind its kernels and the host runs ahead.
Two sets of buffers take turns, step by step: a step's staging waits only for the
copies of the step before the last one, never for the last step's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from lmkit.worker.graph_stream import record_event

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32}


class CopyFences:
    """``n`` host staging slots used in turn, each fenced by an event recorded behind the
    asynchronous copies that last read it: :meth:`advance` moves to the next slot and
    waits (only) for that slot's copies, :meth:`mark` fences the current slot's."""

    def __init__(self, n: int, enabled: bool) -> None:
        self.enabled = enabled  # CUDA: copies are asynchronous; elsewhere nothing to wait on
        self.slot = 0
        self._events: list[torch.cuda.Event | None] = [None] * max(1, n)

    def mark(self) -> None:
        """The copies queued so far read the current slot: fence them."""
        if self.enabled:
            self._events[self.slot] = record_event()

    def advance(self) -> int:
        """Move to the next slot once the copies that last read it are done; its index."""
        self.slot = (self.slot + 1) % len(self._events)
        event = self._events[self.slot]
        if event is not None:
            event.synchronize()
            self._events[self.slot] = None
        return self.slot


class StepStaging:
    """Pinned host staging for one step's index arrays, per dtype, double-buffered.

    Call :meth:`begin` at the start of each step, then :meth:`put` each array; a put's
    device tensor stays valid through the next step too (steps alternate between two
    sets of buffers; a step reuses the set of the step before the last).

    Args:
        device: where the arrays go.
        capacity: initial elements per dtype (grows on demand).
        stage: copy through the buffers (default: off the CPU; on the CPU the arrays are
            wrapped as they are, ``True`` there runs the staging path with plain copies).
    """

    def __init__(self, device: torch.device, capacity: int = 1024,
                 stage: bool | None = None) -> None:
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        self.stage = self.device.type != "cpu" if stage is None else stage
        self.capacity = capacity
        # two sets, per dtype: host buffer, device buffer; the step's set is the fences' slot
        self._sets: list[tuple[dict[torch.dtype, torch.Tensor], dict[torch.dtype, torch.Tensor]]]
        self._sets = [({}, {}), ({}, {})]
        self._fences = CopyFences(2, self.pin)
        self._host, self._device = self._sets[0]
        self._used: dict[torch.dtype, int] = {}

    def begin(self) -> None:
        """A new step, in the other set of buffers: the copies of the step that last
        used it (the step before the last) must have read them. One event marks the
        finished step's copies (recorded here, behind them in stream order)."""
        if self._used:
            self._fences.mark()
        self._host, self._device = self._sets[self._fences.advance()]
        self._used.clear()

    def put(self, array: np.ndarray | Sequence[int],
            dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """``array`` (any shape) as a ``dtype`` tensor on the device, copied asynchronously."""
        a = np.asarray(array)
        if not self.stage:  # the CPU: the host array is the device array
            return torch.from_numpy(np.ascontiguousarray(a, dtype=_NUMPY[dtype]))
        n = a.size
        used = self._used.get(dtype, 0)
        host = self._host.get(dtype)
        if host is None or used + n > len(host):
            # a new, larger pair; tensors handed out before keep the old one alive
            size = max(self.capacity, 2 * (used + n), len(host) if host is not None else 0)
            with torch.inference_mode(False):  # normal tensors: writable in and out of it
                host = torch.zeros(size, dtype=dtype, pin_memory=self.pin)
                self._device[dtype] = torch.zeros(size, dtype=dtype, device=self.device)
            self._host[dtype] = host
            used = 0
        src = host[used:used + n]
        src.numpy()[:] = a.reshape(-1)
        dst = self._device[dtype][used:used + n]
        dst.copy_(src, non_blocking=self.pin)
        self._used[dtype] = used + n
        return dst.view(a.shape)

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

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32}


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
        # two sets, per dtype: host buffer, device buffer; the step's set is _sets[_turn]
        self._sets: list[tuple[dict[torch.dtype, torch.Tensor], dict[torch.dtype, torch.Tensor]]]
        self._sets = [({}, {}), ({}, {})]
        self._turn = 0
        self._host, self._device = self._sets[0]
        self._used: dict[torch.dtype, int] = {}
        # per set: recorded after its step's copies were queued (None: none in flight)
        self._copied: list[torch.cuda.Event | None] = [None, None]

    def begin(self) -> None:
        """A new step, in the other set of buffers: the copies of the step that last
        used it (the step before the last) must have read them. One event marks the
        finished step's copies (recorded here, behind them in stream order)."""
        if self.pin and self._used:
            done = torch.cuda.Event()
            done.record()
            self._copied[self._turn] = done
        self._turn ^= 1
        self._host, self._device = self._sets[self._turn]
        pending = self._copied[self._turn]
        if pending is not None:
            pending.synchronize()
            self._copied[self._turn] = None
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

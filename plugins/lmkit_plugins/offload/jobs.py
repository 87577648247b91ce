"""Transfer jobs a tier has started and not yet reported through ``poll()``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from lmkit.api import TransferJob


class JobBook:
    """Hands out job ids and remembers each job until it is reported once.

    A job finishes with a success flag and, on CUDA, an event: it is reported by
    :meth:`poll` once the event has completed.
    """

    def __init__(self) -> None:
        self._ids = itertools.count()
        self._open: list[tuple[TransferJob, bool, Any]] = []  # (job, ok, event or None)

    def new(self, kind: str, block_hashes: Sequence[bytes], block_ids: Sequence[int]
            ) -> TransferJob:
        """A job with a fresh id."""
        return TransferJob(next(self._ids), kind, tuple(block_hashes), tuple(block_ids))

    def finish(self, job: TransferJob, ok: bool, event: Any = None) -> TransferJob:
        """Record the outcome of ``job`` (complete once ``event`` is, if given)."""
        self._open.append((job, ok, event))
        return job

    def poll(self) -> list[tuple[TransferJob, bool]]:
        """Jobs whose copies are complete, each once, in the order they finished."""
        done, still = [], []
        for job, ok, event in self._open:
            if event is None or event.query():
                done.append((job, ok))
            else:
                still.append((job, ok, event))
        self._open = still
        return done

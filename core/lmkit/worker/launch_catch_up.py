"""The draft head's catch-up over a decode step launched ahead, queued at the launch.

With speculation off -- above ``speculative.disable_by_batch_size``, or while the adaptive
switch holds it off -- and the head catching up (``speculative.catch_up_when_off``, the
default), decode steps are launched ahead like any other (:mod:`lmkit.worker.
gpu_lookahead`), and the head still runs its catch-up pass over every step, so that its
KV cache has no holes when drafting resumes. That pass needs nothing the launch does not
already hold on the device: the step's features (the inputs of the head's target layers,
or the final hidden states), the tokens the step just drew (the head's input at each
position is the token after it), and the step's positions, cache slots and block tables
(the head's KV cache is addressed through the target's). So it is queued right behind the
launched step, one replay of the head's catch-up graph with those arrays, instead of
running through the general drafting path (:meth:`~lmkit.worker.draft_runner.
DraftRunner.propose`) when the step is taken: host work on every step of a batch too
large to speculate, which is the batch where the step is bound by the host.

A launched step that is not taken wrote the head's KV at positions past each request's
computed tokens, as it wrote the target's; whatever step runs instead catches the head up
there again before anything reads them. A taken step whose requests draft after it (the
batch drained to the limit) runs the general path as before, catch-up included (the same
KV written again, and the drafts). ``LMKIT_LAUNCH_CATCH_UP=0`` (read when the lookahead
is built: :func:`enabled`) leaves every catch-up to the taking.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from lmkit.platform import switched_off

if TYPE_CHECKING:
    from lmkit.worker.draft_runner import DraftRunner

ENV = "LMKIT_LAUNCH_CATCH_UP"


def enabled() -> bool:
    """Whether catch-ups are queued at the launch (``LMKIT_LAUNCH_CATCH_UP`` not ``0``)."""
    return not switched_off(ENV)


def catch_up_at_launch(drafter: DraftRunner, order: list[str], features: torch.Tensor,
                       ids: torch.Tensor, positions: np.ndarray, slots: np.ndarray,
                       tables: np.ndarray) -> bool:
    """Queue the head's catch-up over a decode step just launched ahead, if its catch-up
    graphs take it; returns whether it was queued (else the taking runs it).

    Args:
        drafter: the runner's draft head.
        order: the step's requests (if the head left one of them for good, ``stale``,
            nothing is queued).
        features: ``[n, width]``, what the head reads of the step's ``n`` rows.
        ids: ``[n]`` int64 on the device, the tokens the step drew (not read back yet).
        positions, slots: ``[n]`` int64, each row's position and KV cache slot.
        tables: ``[n, blocks]`` int32, each row's block table (wide enough for it).
    """
    graphs = drafter.catch_up_graphs
    n = len(order)
    if (graphs is None or n > graphs.max_rows
            or tables.shape[1] > graphs.max_blocks or not drafter.stale.isdisjoint(order)
            or features.shape[1] != graphs.width):
        return False
    graphs.run(ids, features, positions, slots, tables)
    drafter.num_launch_catch_ups += 1
    return True

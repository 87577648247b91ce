"""CUDA graphs for a draft head's draft passes.

After the catch-up pass, an EAGLE head drafts ``k - 1`` more tokens, each a pass of one
query token per drafting request, fed the previous draft and the head's own output.
Eagerly, each pass is a few dozen short kernels launched from Python: on a small
target that costs as much as the target's own (captured) decode step. Those passes
have the shape of a decode step, so they replay through a :class:`CudaGraphRunner`
over the head, with the head's features in a fixed buffer: :class:`HeadPass` adapts
``proposer.forward(ids, positions, features, ctx)`` to the graph runner's
``model(ids, positions, ctx)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from lmkit.api.kv_cache_spec import one_kv_cache_group
from lmkit.api.model import ForwardContext
from lmkit.worker.cuda_graphs import CudaGraphRunner

if TYPE_CHECKING:
    from lmkit.api.kv_cache_spec import KVCacheGroup
    from lmkit.api.spec_decode import RunnerProposer


class HeadPass:
    """A draft head as a ``model(ids, positions, ctx) -> hidden`` whose features come
    from :attr:`features` (rows ``0..n``), a buffer with a fixed address.

    Args:
        proposer: the loaded head (its ``attn`` is the graphs' attention backend).
        max_rows: the largest pass (rows of :attr:`features`).
        width: the features' width (the head's hidden size: passes after the first).
        dtype, device: of the features.
    """

    def __init__(self, proposer: RunnerProposer, max_rows: int, width: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.proposer = proposer
        self.attn = proposer.attn
        self.features = torch.zeros(max_rows, width, dtype=dtype, device=device)

    def kv_cache_groups(self, num_layers: int) -> tuple[KVCacheGroup, ...]:
        """One group: the head's layers on its own backend."""
        return one_kv_cache_group(self.attn, num_layers)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 ctx: ForwardContext) -> torch.Tensor:
        return self.proposer.forward(input_ids, positions, self.features[:len(input_ids)], ctx)


class DraftPassGraphs:
    """Captured draft passes of one head, one graph per padded number of requests.

    Args:
        proposer: the loaded head.
        kv_caches: the head's KV caches (fixed for the graphs' lifetime).
        width: the head's hidden size; ``dtype``: its activations' dtype.
        device: the CUDA device (any device with ``use_graphs=False``).
        max_num_seqs: the most requests that draft in one step.
        max_model_len: the context limit; ``block_size``: tokens per KV block.
        use_graphs: ``False`` runs the same padded, fixed-buffer passes eagerly (tests).
    """

    def __init__(self, proposer: RunnerProposer, kv_caches: list[torch.Tensor], width: int,
                 dtype: torch.dtype, device: torch.device, max_num_seqs: int,
                 max_model_len: int, block_size: int, use_graphs: bool = True) -> None:
        self.head = HeadPass(proposer, max_num_seqs, width, dtype, device)
        self.runner = CudaGraphRunner(self.head, kv_caches, device, max_num_seqs,
                                      max_model_len, block_size, use_graphs=use_graphs)
        self.num_passes = 0  # passes run through :meth:`run`

    @property
    def max_rows(self) -> int:
        """The most requests one replayed pass takes."""
        return self.runner.max_bs

    def capture(self) -> None:
        """Capture the graphs (no-op without ``use_graphs``)."""
        self.runner.capture()

    def run(self, draft_ids: torch.Tensor, features: torch.Tensor, positions: np.ndarray,
            slots: np.ndarray, block_tables: np.ndarray) -> torch.Tensor:
        """One draft pass of ``n`` requests (``n <= max_rows``): token ``draft_ids[i]``
        (device) at ``positions[i]`` with ``features[i]``, its K/V written to
        ``slots[i]``, attending over ``block_tables[i]`` up to and including itself.
        Returns the head's output ``[n, width]``, a view valid until the next pass."""
        n = len(positions)
        self.head.features[:n].copy_(features)
        self.num_passes += 1
        return self.runner.run_decode(None, positions, slots, (positions + 1).astype(np.int32),
                                      block_tables, device_input_ids=draft_ids)


def maybe_capture_draft_passes(proposer: RunnerProposer, kv_caches: list[torch.Tensor],
                               target_graphs: CudaGraphRunner | None, k: int, width: int,
                               dtype: torch.dtype, max_num_seqs: int, max_model_len: int,
                               block_size: int) -> DraftPassGraphs | None:
    """Graphs for the head's draft passes when the target's decode runs in graphs (the
    same conditions: CUDA, a backend that can be captured, not ``enforce_eager``) and
    there is more than one draft; else ``None`` (the passes run eagerly)."""
    if target_graphs is None or k < 2:
        return None
    graphs = DraftPassGraphs(proposer, kv_caches, width, dtype, target_graphs.device,
                             max_num_seqs, max_model_len, block_size,
                             use_graphs=target_graphs.use_graphs)
    graphs.capture()
    return graphs

"""Host-built index lists of a step's paged contexts, gathered on the device.

Shared by the MLA backends: FlashInfer's page lists (used block ids per request) and
the cache slots of every context token (for decompression). Indices are computed on
the host from ``seq_lens_cpu`` and uploaded from pinned memory (non-blocking); the
block ids themselves are read from the device ``block_tables`` with one gather, so
planning never waits for the device.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (host) on ``device``, through pinned memory so the upload never waits."""
    t = t.contiguous()
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def used_blocks(block_tables: torch.Tensor, num_pages: np.ndarray) -> torch.Tensor:
    """int32 ``[sum(num_pages)]``: the first ``num_pages[r]`` block ids of each row ``r``
    of ``block_tables``, row after row (FlashInfer's ``kv_indices``)."""
    pages = torch.from_numpy(np.asarray(num_pages, dtype=np.int64))
    rows = torch.repeat_interleave(torch.arange(len(pages)), pages)
    starts = torch.cumsum(pages, 0) - pages
    cols = torch.arange(int(pages.sum())) - torch.repeat_interleave(starts, pages)
    flat = to_device(rows * block_tables.shape[1] + cols, block_tables.device)
    return block_tables.reshape(-1).index_select(0, flat)


def context_slots(block_tables: torch.Tensor, seq_lens: np.ndarray, block_size: int
                  ) -> torch.Tensor:
    """int64 ``[sum(seq_lens)]``: the cache slot of every context token of each request
    (``block * block_size + offset``), request after request."""
    lens = torch.from_numpy(np.asarray(seq_lens, dtype=np.int64))
    req = torch.repeat_interleave(torch.arange(len(lens)), lens)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(int(lens.sum())) - torch.repeat_interleave(starts, lens)
    device = block_tables.device
    flat = to_device(req * block_tables.shape[1] + pos // block_size, device)
    blocks = block_tables.reshape(-1).index_select(0, flat).long()
    return blocks * block_size + to_device(pos % block_size, device)

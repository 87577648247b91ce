"""The fixed-address inputs of a runner's decode graphs, and their host staging.

A captured graph reads its inputs from the addresses it was captured with, so
:class:`~lmkit.worker.cuda_graphs.CudaGraphRunner` fills the same device buffers
before every replay (:class:`ReplayBuffers`): the packed ``input_ids | positions |
slot_mapping`` rows, ``seq_lens``, the used block-table columns, ``query_start_loc``
(``0..bs``, never changed) and, for chained passes, the later passes' rows. A replay's
rows come either from the host -- staged in one of ``num_staging`` pinned sets, used in
turn and fenced (:class:`~lmkit.worker.staging.CopyFences`), then copied in one go --
or from device tensors computed by earlier kernels, copied in stream order. Padding
rows hold token 0 at position 0, no cache slot (``-1``) and no context (``seq_lens``
0): the attention kernels return zeros there and the cache write skips them.
"""

from __future__ import annotations

import numpy as np
import torch

from lmkit.worker.staging import CopyFences


class ReplayBuffers:
    """Device buffers for replays of up to ``max_bs`` rows over ``max_blocks`` block-table
    columns, ``links`` chained passes after the first (0: none), and their pinned host
    staging (``num_staging`` sets; ``fenced``: copies are asynchronous, CUDA)."""

    def __init__(self, max_bs: int, max_blocks: int, links: int, device: torch.device,
                 num_staging: int, fenced: bool, tree: bool = False) -> None:
        bs, width = max_bs, max_blocks
        self.links = links
        self.tree = tree
        # a chained pass's rows: positions | slots | seq_lens, and with trees its tree
        # regions | mask bits | two gather indices its model reads (its ids, its features)
        self.fields = 7 if tree else 3
        tree_rows = bs if tree else 0
        # draft trees: each row's region (int32) and mask bits (int64); empty without
        self.tree_region = torch.zeros(tree_rows, dtype=torch.int32, device=device)
        self.tree_mask = torch.zeros(tree_rows, dtype=torch.int64, device=device)
        self.packed = torch.zeros(3 * bs, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(bs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(bs, width, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(bs + 1, dtype=torch.int32, device=device)
        # chained passes: passes 1.. positions | slots | seq_lens, and the input ids each
        # of them read (the previous pass's drafts)
        self.chain_rows = torch.zeros(links, self.fields, bs, dtype=torch.int64, device=device)
        self.chain_ids = torch.zeros(links, bs, dtype=torch.int64, device=device)
        self._padding_row = np.zeros(self.fields, dtype=np.int64)
        self._padding_row[1] = -1  # no cache slot
        self._chain_padding = torch.from_numpy(self._padding_row).to(device)[
            None, :, None].expand(links, self.fields, bs)
        pin = torch.device(device).type == "cuda"
        self._sets = [(torch.zeros(3 * bs, dtype=torch.int64, pin_memory=pin),
                       torch.zeros(bs, dtype=torch.int32, pin_memory=pin),
                       torch.zeros(bs * width, dtype=torch.int32, pin_memory=pin),
                       torch.zeros(links * self.fields * bs, dtype=torch.int64,
                                   pin_memory=pin),
                       torch.zeros(tree_rows, dtype=torch.int32, pin_memory=pin),
                       torch.zeros(tree_rows, dtype=torch.int64, pin_memory=pin))
                      for _ in range(max(1, num_staging))]
        self._fences = CopyFences(len(self._sets), fenced)
        (self.host_packed, self.host_seq_lens, self._host_blocks, self._host_chain,
         self.host_tree_region, self._host_tree_mask) = self._sets[0]
        self.host_query_start_loc = torch.arange(bs + 1, dtype=torch.int32)

    # ------------------------------------------------------------------ from the host

    def next_set(self) -> None:
        """Stage the next replay in the next host set; the upload that last read that
        set must be done (``num_staging`` replays ago: usually long since)."""
        (self.host_packed, self.host_seq_lens, self._host_blocks, self._host_chain,
         self.host_tree_region, self._host_tree_mask) = self._sets[self._fences.advance()]

    def stage(self, bs: int, input_ids: np.ndarray | None, positions: np.ndarray,
              slot_mapping: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray,
              chain_rows: np.ndarray | None,
              tree: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """Stage ``n = len(positions)`` rows of a replay of size ``bs`` in the current
        host set (``input_ids`` ``None``: left as they are), padding the rest; ``tree``:
        the rows' tree regions and mask bits (``None``: causal rows)."""
        n = len(positions)
        packed = self.host_packed.numpy()
        if input_ids is not None:
            packed[:n] = input_ids
        packed[bs:bs + n] = positions
        packed[2 * bs:2 * bs + n] = slot_mapping
        self.stage_padding(bs, n)
        self.host_seq_lens.numpy()[:n] = seq_lens
        width = block_tables.shape[1]
        self._host_blocks[:n * width].numpy().reshape(n, width)[:] = block_tables
        if chain_rows is not None and self.links:
            self.host_chain_rows(bs)[:, :, :n] = chain_rows
        if self.tree:
            self.host_tree_region.numpy()[:n] = 0 if tree is None else tree[0]
            if tree is not None:
                self._host_tree_mask.numpy()[:n] = tree[1]

    def stage_padding(self, bs: int, n: int = 0) -> None:
        """Host staging of padding rows ``n..bs``."""
        packed = self.host_packed.numpy()
        packed[n:bs] = 0
        packed[bs + n:2 * bs] = 0
        packed[2 * bs + n:3 * bs] = -1
        self.host_seq_lens.numpy()[n:bs] = 0
        if self.tree:
            self.host_tree_region.numpy()[n:bs] = 0
        if self.links:
            self.host_chain_rows(bs)[:, :, n:] = self._padding_row[:, None]

    def host_chain_rows(self, bs: int) -> np.ndarray:
        """The host staging of chained passes' rows for size ``bs``: ``[links, fields,
        bs]`` (:attr:`fields`: 3, or 7 with trees)."""
        f = self.fields
        return self._host_chain[:self.links * f * bs].numpy().reshape(-1, f, bs)

    def upload(self, bs: int, n: int, width: int, ids_from: int = 0) -> None:
        """Copy the staged rows to the device buffers (asynchronous, pinned), the input
        ids from row ``ids_from`` on (the rows before it are on the device already)."""
        self.packed[ids_from:3 * bs].copy_(self.host_packed[ids_from:3 * bs],
                                           non_blocking=True)
        self.seq_lens[:bs].copy_(self.host_seq_lens[:bs], non_blocking=True)
        if n:
            self.block_tables[:n, :width].copy_(
                self._host_blocks[:n * width].view(n, width), non_blocking=True)
        if self.links:
            f = self.fields
            self.chain_rows[:, :, :bs].copy_(
                self._host_chain[:self.links * f * bs].view(self.links, f, bs),
                non_blocking=True)
        if self.tree:
            self.tree_region[:bs].copy_(self.host_tree_region[:bs], non_blocking=True)
            self.tree_mask[:bs].copy_(self._host_tree_mask[:bs], non_blocking=True)
        self._fences.mark()

    # ------------------------------------------------------------------ from the device

    def load(self, bs: int, input_ids: torch.Tensor, positions: torch.Tensor,
             slot_mapping: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
             chain_rows: torch.Tensor | None) -> None:
        """Copy ``n = len(positions)`` rows of a replay of size ``bs`` from device tensors
        (int64; block tables int32) in stream order, padding the rest on the device."""
        n = len(positions)
        rows = (self.packed[:bs], self.packed[bs:2 * bs], self.packed[2 * bs:3 * bs],
                self.seq_lens[:bs])
        for dst, src, pad in zip(rows, (input_ids, positions, slot_mapping, seq_lens),
                                 (0, 0, -1, 0), strict=True):
            dst[:n].copy_(src)
            if n < bs:
                dst[n:].fill_(pad)
        self.block_tables[:n, :block_tables.shape[1]].copy_(block_tables)
        if self.tree:  # rows from the device are causal
            self.tree_region[:bs].zero_()
        if self.links:
            shape = (self.links, self.fields, n)
            if chain_rows is None or tuple(chain_rows.shape) != shape:
                raise ValueError(f"a replay of {self.links + 1} chained passes needs "
                                 f"chain_rows of shape {shape}")
            self.chain_rows[:, :, :n].copy_(chain_rows)
            if n < bs:
                self.chain_rows[:, :, n:bs].copy_(self._chain_padding[:, :, :bs - n])

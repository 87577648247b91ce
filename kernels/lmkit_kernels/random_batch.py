"""Random paged-attention batches for kernel tests and benchmarks.

:func:`make_paged_batch` builds a KV cache whose blocks are handed out in random order,
fills every request's cached context with random keys and values, and packs the
step's new tokens the way the model runner does (``query_start_loc``, ``seq_lens``,
``block_tables``, ``slot_mapping``, with host copies).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["PagedBatch", "make_paged_batch"]


@dataclass
class PagedBatch:
    """One step's inputs over a paged cache (device tensors plus ``*_cpu`` host copies)."""

    q: torch.Tensor  # [num_tokens + extra_rows, num_heads, head_size]
    k: torch.Tensor  # [num_tokens + extra_rows, num_kv_heads, head_size] (new tokens)
    v: torch.Tensor  # like k
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_size]
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_tables: torch.Tensor  # int32 [num_reqs, width]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_tokens: int
    max_query_len: int
    max_seq_len: int

    @property
    def num_reqs(self) -> int:
        """Number of requests in the batch."""
        return self.seq_lens.shape[0]

    def metadata_kwargs(self, **overrides: object) -> dict[str, object]:
        """This step as keyword arguments of ``lmkit.api.AttentionMetadata`` (the kernels
        package does not import lmkit), with ``overrides`` applied, e.g.
        ``AttentionMetadata(**batch.metadata_kwargs(cuda_graph=True))``."""
        fields: dict[str, object] = dict(
            num_reqs=self.num_reqs, num_actual_tokens=self.num_tokens,
            max_query_len=self.max_query_len, max_seq_len=self.max_seq_len,
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
            block_tables=self.block_tables, slot_mapping=self.slot_mapping,
            query_start_loc_cpu=self.query_start_loc_cpu, seq_lens_cpu=self.seq_lens_cpu)
        fields.update(overrides)
        return fields


def make_paged_batch(reqs: Sequence[tuple[int, int]], *, num_heads: int, num_kv_heads: int,
                     head_size: int, block_size: int, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu", num_blocks: int | None = None,
                     extra_rows: int = 0, table_width: int | None = None,
                     seed: int = 0) -> PagedBatch:
    """A random batch: request ``i`` has ``reqs[i] = (context_len, query_len)``.

    The first ``context_len`` tokens of each request are already in the cache; the
    ``query_len`` new tokens get slots (``slot_mapping``) but are not written, and their
    K/V are in ``k``/``v``. ``extra_rows`` appends padding rows to ``q``/``k``/``v``
    (as a CUDA-graph batch would have). Unused cache blocks hold random values too, so a
    kernel that reads past a request's context gives a wrong answer, not a lucky zero.
    """
    gen = torch.Generator().manual_seed(seed)  # block order (host)
    dev_gen = torch.Generator(device=device).manual_seed(seed)  # values, made on the device
    pages = [-(-(ctx + q_len) // block_size) for ctx, q_len in reqs]
    total_pages = sum(pages)
    num_blocks = max(num_blocks or 0, total_pages + 1)
    width = max(table_width or 0, max(pages, default=1), 1)
    order = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(reqs), width, dtype=torch.int32)
    kv_cache = torch.randn((2, num_blocks, block_size, num_kv_heads, head_size),
                           generator=dev_gen, device=device, dtype=dtype)
    slots, start = [], 0
    for r, ((ctx, q_len), n) in enumerate(zip(reqs, pages, strict=True)):
        table = order[start:start + n].to(torch.int32)
        block_tables[r, :n] = table
        start += n
        for pos in range(ctx, ctx + q_len):
            slots.append(int(table[pos // block_size]) * block_size + pos % block_size)
    q_lens = [q_len for _, q_len in reqs]
    seq_lens = torch.tensor([ctx + q_len for ctx, q_len in reqs], dtype=torch.int32)
    query_start_loc = torch.zeros(len(reqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(q_lens, dtype=torch.int64).cumsum(0)
    num_tokens = sum(q_lens)
    rows = num_tokens + extra_rows
    q, k, v = (torch.randn((rows, heads, head_size), generator=dev_gen, device=device,
                           dtype=dtype) for heads in (num_heads, num_kv_heads, num_kv_heads))
    return PagedBatch(
        q=q, k=k, v=v, kv_cache=kv_cache,
        query_start_loc=query_start_loc.to(device), seq_lens=seq_lens.to(device),
        block_tables=block_tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens, num_tokens=num_tokens,
        max_query_len=max(q_lens, default=0), max_seq_len=int(seq_lens.max()) if reqs else 0,
    )

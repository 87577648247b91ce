"""Random MLA batches over a paged latent cache, for kernel tests and benchmarks.

:func:`make_mla_batch` lays out requests as :func:`lmkit_kernels.random_batch.make_paged_batch`
does (blocks in random order, every request's cached context random, the step's new
tokens given slots but not written), with a latent cache ``[num_blocks, block_size,
kv_lora_rank + qk_rope_head_dim]`` and the inputs of ``MLAAttentionBackend.run_mla``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmkit_kernels.random_batch import PagedBatch, make_paged_batch

__all__ = ["MLABatch", "make_mla_batch"]


@dataclass
class MLABatch:
    """One MLA step: ``layout`` holds the batch tensors (its ``q``/``k``/``v`` unused)."""

    layout: PagedBatch
    q_nope: torch.Tensor  # [num_tokens + extra_rows, num_heads, nope]
    q_pe: torch.Tensor  # [num_tokens + extra_rows, num_heads, rope]
    kv_c: torch.Tensor  # [num_tokens + extra_rows, kv_lora_rank] (new tokens)
    k_pe: torch.Tensor  # [num_tokens + extra_rows, rope]
    kv_cache: torch.Tensor  # [num_blocks, block_size, kv_lora_rank + rope]
    w_kv_b: torch.Tensor  # [num_heads * (nope + v_dim), kv_lora_rank]
    scale: float  # (nope + rope) ** -0.5

    @property
    def num_tokens(self) -> int:
        """Tokens of the step (without padding rows)."""
        return self.layout.num_tokens


def make_mla_batch(reqs: Sequence[tuple[int, int]], *, num_heads: int, kv_lora_rank: int,
                   qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                   block_size: int, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu", num_blocks: int | None = None,
                   extra_rows: int = 0, table_width: int | None = None,
                   seed: int = 0) -> MLABatch:
    """A random batch: request ``i`` has ``reqs[i] = (context_len, query_len)``.

    Values are scaled so that scores are O(1) (``w_kv_b`` by ``kv_lora_rank ** -0.5``):
    softmaxes stay soft and a wrong key changes the result.
    """
    width = kv_lora_rank + qk_rope_head_dim
    layout = make_paged_batch(reqs, num_heads=1, num_kv_heads=1, head_size=width,
                              block_size=block_size, dtype=dtype, device=device,
                              num_blocks=num_blocks, extra_rows=extra_rows,
                              table_width=table_width, seed=seed)
    kv_cache = layout.kv_cache[0, :, :, 0].contiguous()
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    rows = layout.num_tokens + extra_rows

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)

    return MLABatch(
        layout=layout, q_nope=randn(rows, num_heads, qk_nope_head_dim),
        q_pe=randn(rows, num_heads, qk_rope_head_dim), kv_c=randn(rows, kv_lora_rank),
        k_pe=randn(rows, qk_rope_head_dim), kv_cache=kv_cache,
        w_kv_b=randn(num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank,
                     scale=kv_lora_rank ** -0.5),
        scale=(qk_nope_head_dim + qk_rope_head_dim) ** -0.5,
    )

"""Tensor parallelism for the model plugins: a rank's share of a ``torch.distributed``
group, the slicing of checkpoint tensors, and the collectives (Megatron-style).

* Column-parallel projections (fused QKV, gate-up, the LM head) hold a slice of the
  output rows: each rank computes its heads / columns, with no communication.
* Row-parallel projections (o_proj, down_proj) hold the matching slice of the input
  columns and return partial sums; :meth:`TensorParallel.all_reduce` adds them up
  (the bias is loaded on rank 0 only, so it is added once).
* Attention heads go to the ranks in whole key/value groups
  (:func:`lmkit.api.kv_heads_of_rank`): when the KV heads do not divide by the size,
  the first ranks hold one group more (SmolLM2's 9 query / 3 KV heads over 2 ranks:
  6/2 and 3/1), and the fused QKV rows and o_proj columns are cut at those heads.
* The embedding table is split by vocabulary rows (:class:`VocabParallelEmbedding`):
  a rank looks up the tokens in its range, zeros for the others, and an all-reduce
  completes every row; as the (tied) LM head it gives ``[n, vocab / N]`` logits that
  :meth:`TensorParallel.gather_vocab` concatenates on every rank, so every rank
  samples from the same logits. The vocabulary is padded to a multiple of N.

With one rank a model builds no :class:`TensorParallel` (``None``) and none of this
code runs: no collective, no copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from lmkit.api import kv_heads_of_rank

from lmkit_plugins.models.layers import VocabEmbedding


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in the tensor-parallel group."""

    rank: int
    size: int
    group: Any  # torch.distributed.ProcessGroup

    @classmethod
    def from_context(cls, ctx: Any) -> TensorParallel | None:
        """From a :class:`~lmkit.api.ModelBuildContext`; ``None`` for a single rank."""
        if ctx.tp_size <= 1:
            return None
        return cls(ctx.tp_rank, ctx.tp_size, ctx.tp_group)

    def local(self, n: int) -> int:
        """This rank's share of ``n`` rows (rounded up: the last shard may be padded)."""
        return -(-n // self.size)

    def heads(self, num_heads: int, num_kv_heads: int) -> tuple[range, range]:
        """This rank's (query heads, key/value heads): whole KV groups, the first ranks
        one more when ``num_kv_heads`` does not divide by the size, and their query heads."""
        kv = kv_heads_of_rank(num_kv_heads, self.rank, self.size)
        per_group = num_heads // num_kv_heads
        return range(kv.start * per_group, kv.stop * per_group), kv

    def shard_heads(self, t: torch.Tensor, dim: int, heads: range, head_dim: int
                    ) -> torch.Tensor:
        """The slice of ``t`` along ``dim`` that holds ``heads`` (``head_dim`` each)."""
        return t.narrow(dim, heads.start * head_dim, len(heads) * head_dim)

    def shard(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of checkpoint tensor ``t`` along ``dim``, zero-padded when
        ``t.shape[dim]`` is not a multiple of the group size (the vocabulary)."""
        n = t.shape[dim]
        local = self.local(n)
        start = min(self.rank * local, n)
        part = t.narrow(dim, start, min(local, n - start))
        if part.shape[dim] == local:
            return part
        pad = list(t.shape)
        pad[dim] = local - part.shape[dim]
        return torch.cat([part, t.new_zeros(pad)], dim=dim)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks (row-parallel partial results); returns the sum."""
        import torch.distributed as dist

        x = x.contiguous()  # a CPU projection may return a strided view
        dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """``[n, vocab / N]`` logits of every rank -> ``[n, vocab_size]`` on every rank."""
        import torch.distributed as dist

        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        dist.all_gather(parts, logits, group=self.group)
        return torch.cat(parts, dim=-1)[:, :vocab_size].contiguous()


class VocabParallelEmbedding(VocabEmbedding):
    """The embedding table's rows ``[rank * V/N, (rank + 1) * V/N)`` (V padded to a
    multiple of N); lookups and the LM head combine over the group."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel, *,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(tp.local(vocab_size), hidden_size, dtype=dtype, device=device)
        self.full_vocab_size = vocab_size
        self.tp = tp
        self.vocab_start = tp.rank * self.vocab_size

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [num_tokens] (full vocabulary) -> [num_tokens, hidden]
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_size)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0))

    def logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """Tied LM head: ``[n, hidden]`` -> float32 ``[n, vocab]`` on every rank
        (``float32=False``: the head's own dtype)."""
        return self.tp.gather_vocab(super().logits(hidden, float32), self.full_vocab_size)

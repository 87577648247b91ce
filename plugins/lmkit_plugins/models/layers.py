"""Building blocks of decoder-only models over packed tokens (no batch axis).

Linear layers keep their weight in the layout the device multiplies fastest: on CUDA
the usual ``[out, in]`` for cuBLAS, on the CPU ``[in, out]`` contiguous, because MKL's
single-row GEMV (decode) reads a row-major ``x @ W`` at close to memory bandwidth but a
transposed one at about half of it. Either way ``.weight`` is an ``[out, in]`` tensor
(a view on CPU) that loading writes into, so nothing is re-laid out after loading.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _is_cpu(device: torch.device | str) -> bool:
    return torch.device(device).type == "cpu"


class Linear(nn.Module):
    """``y = x W^T + b`` whose output is made of named shards (fused projections).

    ``shard_sizes`` names the output slices in order, e.g. ``{"q": 576, "k": 192,
    "v": 192}`` for a fused QKV projection or ``{"weight": n}`` for a plain one; each
    shard is loaded from its own checkpoint tensor with :meth:`load_shard`.
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], *, bias: bool,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = sum(shard_sizes.values())
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (start, size)
            start += size
        self.transposed = _is_cpu(device)
        if self.transposed:
            # weight_t: [in, out] contiguous; weight: its [out, in] view (for loading)
            self.weight_t = nn.Parameter(
                torch.empty(in_features, self.out_features, dtype=dtype, device=device),
                requires_grad=False)
        else:
            self.weight_t = None
            self._weight = nn.Parameter(
                torch.empty(self.out_features, in_features, dtype=dtype, device=device),
                requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(self.out_features, dtype=dtype, device=device),
                                  requires_grad=False) if bias else None)

    @property
    def weight(self) -> torch.Tensor:
        """The ``[out, in]`` weight (a strided view of ``weight_t`` on the CPU)."""
        return self.weight_t.t() if self.transposed else self._weight

    def load_shard(self, shard: str, weight: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> None:
        """Copy a checkpoint tensor into the output slice named ``shard``."""
        start, size = self.shard_offsets[shard]
        if weight is not None:
            _copy_checked(self.weight[start:start + size], weight, shard)
        if bias is not None:
            if self.bias is None:
                raise ValueError(f"shard {shard!r} has a bias but the layer was built without one")
            _copy_checked(self.bias[start:start + size], bias, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in] -> [num_tokens, out]
        if self.transposed:
            if self.bias is None:
                return torch.mm(x, self.weight_t)
            return torch.addmm(self.bias, x, self.weight_t)
        return F.linear(x, self._weight, self.bias)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} does not match the "
                         f"model's {tuple(dst.shape)}")
    dst.copy_(src)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last axis, computed in float32 as HF does.

    ``forward(x, residual)`` first adds ``residual`` (the pre-norm residual stream) and
    returns ``(normed, new_residual)``, saving one pass over the activations.
    """

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # one fused kernel; bit-identical to the float32 formula below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # half precision: normalise in float32, round, then scale (HF's order)
        xf = x.float()
        variance = xf.pow(2).mean(-1, keepdim=True)
        return self.weight * (xf * torch.rsqrt(variance + self.eps)).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for a fused ``[n, 2 * intermediate]`` gate-up projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


class VocabEmbedding(nn.Module):
    """Token embedding table, optionally shared with the LM head (tied embeddings).

    On the CPU the table is stored ``[hidden, vocab]`` contiguous so that the LM head
    runs as a fast row-major GEMV; the lookup then gathers columns, which costs
    little for the few tokens of a step. ``.weight`` is always the ``[vocab, hidden]``
    view that loading writes into.
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.transposed = _is_cpu(device)
        shape = (hidden_size, vocab_size) if self.transposed else (vocab_size, hidden_size)
        self.table = nn.Parameter(torch.empty(shape, dtype=dtype, device=device),
                                  requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """The ``[vocab, hidden]`` table."""
        return self.table.t() if self.transposed else self.table

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [num_tokens] -> [num_tokens, hidden]
        if self.transposed:
            return self.table.index_select(1, input_ids).t().contiguous()
        return F.embedding(input_ids, self.table)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head over this table: ``[n, hidden]`` -> float32 ``[n, vocab]``."""
        if self.transposed:
            return torch.mm(hidden, self.table).float()
        return F.linear(hidden, self.table).float()

"""Building blocks of decoder-only models over packed tokens (no batch axis).

Weights keep the usual ``[out, in]`` layout everywhere. On the CPU, float32 and
bfloat16 projections go through oneDNN's linear kernel (the one torch.compile's CPU
backend emits) rather than ``F.linear``'s MKL GEMM: on the AMD CPUs this runs on it
reads weights at close to memory bandwidth for single-row decode GEMVs and is about
twice as fast for small batches (see :func:`cpu_linear_kernel`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lmkit_plugins.models.fused_ops import fused_ops_enabled, linear_kernel, rms_norm_kernel

LinearFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                   ) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.cache
def _onednn_works() -> bool:
    try:
        out = _onednn_linear(torch.ones(2, 3), torch.ones(4, 3), torch.ones(4))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return bool(torch.equal(out, torch.full((2, 4), 4.0)))


def cpu_linear_kernel(device: torch.device | str, dtype: torch.dtype) -> LinearFn:
    """The ``(x, weight [out, in], bias) -> x @ weight.T + bias`` to use on ``device``.

    oneDNN on the CPU for float32/bfloat16 when this torch build has it, else
    ``F.linear`` (CUDA, float16, or a torch without oneDNN).
    """
    if (torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and _onednn_works()):
        return _onednn_linear
    return F.linear


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
        self.weight = nn.Parameter(
            torch.empty(self.out_features, in_features, dtype=dtype, device=device),
            requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(self.out_features, dtype=dtype, device=device),
                                  requires_grad=False) if bias else None)
        self.kernel = linear_kernel(device, dtype, cpu_linear_kernel(device, dtype))

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
        return self.kernel(x, self.weight, self.bias)


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
        # CUDA half precision: one fused Triton kernel (see lmkit_plugins.models.fused_ops)
        self._fused = rms_norm_kernel() if fused_ops_enabled(device, dtype) else None

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
        if self._fused is not None and x.dim() == 2:
            return self._fused(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for a fused ``[n, 2 * intermediate]`` gate-up projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


class VocabEmbedding(nn.Module):
    """Token embedding table ``[vocab, hidden]``, optionally also the LM head (tied)."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype,
                                               device=device), requires_grad=False)
        self.kernel = linear_kernel(device, dtype, cpu_linear_kernel(device, dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [num_tokens] -> [num_tokens, hidden]
        return F.embedding(input_ids, self.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head over this table: ``[n, hidden]`` -> float32 ``[n, vocab]``."""
        return self.kernel(hidden, self.weight, None).float()

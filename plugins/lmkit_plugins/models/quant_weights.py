"""Quantized weights inside :class:`~lmkit_plugins.models.layers.Linear` and
:class:`~lmkit_plugins.models.layers.VocabEmbedding`: collecting a fused projection's
shards as the checkpoint yields them, then asking the quantization method for the
layer's kernel."""

from __future__ import annotations

from typing import Any

import torch
from lmkit.api import (
    QuantizationMethod,
    QuantizedLinear,
    QuantizedNormLinear,
    QuantizedSiluLinear,
    QuantizedTensor,
)


class QuantizedShards:
    """A layer's quantized weight in the making: one entry per output shard (``q``,
    ``k``, ``v``); once every shard has arrived, :meth:`build` fuses them (or, for
    shards the method cannot fuse, dequantizes them into a dense float32 weight)."""

    def __init__(self, method: QuantizationMethod, shard_names: list[str],
                 fold: str | None = None) -> None:
        self.method = method
        self.fold = fold  # "norm", "silu_mul" or None: the kernel variant build() adds
        self.names = shard_names
        self.parts: dict[str, QuantizedTensor | torch.Tensor] = {}

    def add(self, shard: str, weight: QuantizedTensor | torch.Tensor, size: int,
            in_features: int) -> bool:
        """Keep ``weight`` for ``shard``; ``True`` once every shard is in."""
        shape = tuple(weight.shape)
        if shape != (size, in_features):
            raise ValueError(f"{shard}: checkpoint shape {shape} does not match the "
                             f"model's {(size, in_features)}")
        self.parts[shard] = weight
        return len(self.parts) == len(self.names)

    def build(self) -> tuple[QuantizedLinear | None, torch.Tensor | None]:
        """``(kernel, None)`` for fused quantized shards, else ``(None, dense weight)``;
        for the layer's ``fold``, when the method declares it, also the kernel with the
        norm (:attr:`norm_kernel`) or SiLU-and-multiply (:attr:`silu_kernel`) folded in."""
        self.norm_kernel: QuantizedNormLinear | None = None
        self.silu_kernel: QuantizedSiluLinear | None = None
        parts = [self.parts[n] for n in self.names]
        if all(isinstance(p, QuantizedTensor) for p in parts):
            fused = self.method.fuse(parts)  # type: ignore[arg-type]
            if fused is not None and self.fold == "norm" and self.method.supports_norm_linear:
                kernel, self.norm_kernel = self.method.linear_with_norm(fused)
                return kernel, None
            if (fused is not None and self.fold == "silu_mul"
                    and self.method.supports_silu_mul_linear):
                kernel, self.silu_kernel = self.method.linear_with_silu_mul(fused)
                return kernel, None
            if fused is not None:
                return self.method.linear(fused), None
        dense = [self.dense(p) for p in parts]  # a CUDA method's on the GPU, dense on the CPU
        return None, torch.cat([d.to(dense[0].device) for d in dense])

    def dense_rows(self, table: QuantizedTensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of a packed table as float32 (embedding lookups)."""
        return self.method.dequantize(table, ids)

    def dense(self, part: Any) -> torch.Tensor:
        """A part as float32 (dequantized when packed)."""
        if isinstance(part, QuantizedTensor):
            return self.method.dequantize(part)
        return part.float()

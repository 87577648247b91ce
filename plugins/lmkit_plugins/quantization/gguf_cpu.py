"""The ``gguf`` quantization method: a GGUF file's Q8_0/Q4_0/Q4_1 blocks and Q4_K/Q6_K
super-blocks kept packed on the CPU and multiplied by lmkit's C kernels (:mod:`lmkit_kernels.cpu.qgemv`).

Decode batches (at most 32 rows) quantize the activations per block to int8 and take
integer block dot products, as llama.cpp does; larger batches dequantize the weights to
float32 in tiles of rows and multiply with torch. Float tensors of the file (norms)
load dense.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lmkit.api import (
    ModelLoadError,
    QuantizationMethod,
    QuantizedLinear,
    QuantizedNormLinear,
    QuantizedSiluLinear,
    QuantizedTensor,
)

from lmkit_plugins.quantization.gguf_file import iterate_tensors, open_checked

if TYPE_CHECKING:
    from lmkit.api.model_facts import ModelFacts

GGUF_NAME = "model.gguf"  # lmkit.loading.gguf.GGUF_NAME: the file kept beside a conversion
# qtype of a fused projection whose parts differ in type (a Q4_K_M file's Q6_K value
# projection beside Q4_K query and key): ``data`` is the tuple of parts, each computed by
# its own kernel into its columns of the output
MIXED = "mixed"


class GGUFCpuMethod(QuantizationMethod):
    """GGUF blocks on the CPU (see the module docstring). Decode batches may fold the
    layer's residual add + RMSNorm into the activation quantization
    (:meth:`linear_with_norm`), and a gated MLP's SiLU-and-multiply into its down
    projection's (:meth:`linear_with_silu_mul`)."""

    supports_norm_linear = True
    supports_silu_mul_linear = True  # where torch's AVX-512 silu can be matched
    fold_max_rows = 32  # lmkit_kernels.cpu.qgemv.MAX_ROWS

    def __init__(self, facts: ModelFacts, *, options: Any = None) -> None:
        super().__init__(facts, options=options)
        from lmkit_kernels.cpu.qgemv import (
            ALL_QTYPES,
            bind_linear,
            pack_weight,
            qgemv_unavailable_reason,
            unchecked_qgemv,
        )

        self._linear = unchecked_qgemv()
        if self._linear is None:
            raise ModelLoadError(
                "the gguf quantization method needs lmkit's C quantized-GEMV kernel, which "
                f"is not available here: {qgemv_unavailable_reason()}. Run the model dense "
                "with --quantization none.")
        self._qtypes = ALL_QTYPES
        from lmkit_kernels.cpu.qgemv import MAX_ROWS
        from lmkit_kernels.cpu.qgemv_fold import bind_norm_linear, bind_silu_linear

        assert MAX_ROWS >= self.fold_max_rows
        self._pack = pack_weight
        self._bind = bind_linear
        self._bind_norm = bind_norm_linear
        self._bind_silu = bind_silu_linear
        self._reader: Any = None
        # kernel function -> the packed weight it computes with (packed_weight())
        self._packed: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

    def check(self) -> None:
        """Validate ``model.gguf`` of the model directory (see :func:`open_checked`)."""
        self._reader = open_checked(Path(self.facts.model_dir) / GGUF_NAME)

    def iterate_weights(self) -> Iterator[tuple[str, Any]]:
        """The file's tensors under HF names (quantized ones packed)."""
        if self._reader is None:
            self.check()
        yield from iterate_tensors(self._reader, self.facts.num_attention_heads, self.facts.num_key_value_heads)
        self._reader = None  # drop the file mapping once every tensor is copied

    def fuse(self, parts: list[QuantizedTensor]) -> QuantizedTensor | None:
        """Rows of same-typed parts concatenated; parts of different types kept apart in
        one :data:`MIXED` tensor; ``None`` for parts of different widths."""
        if len({p.shape[1] for p in parts}) != 1:
            return None
        if len(parts) == 1:
            return parts[0]
        if len({p.qtype for p in parts}) != 1:  # runs of one type fused, kept in order
            flat = [q for p in parts for q in (p.data if p.qtype == MIXED else (p,))]
            runs: list[list[QuantizedTensor]] = []
            for q in flat:
                if runs and runs[-1][0].qtype == q.qtype:
                    runs[-1].append(q)
                else:
                    runs.append([q])
            fused = tuple(self.fuse(run) for run in runs)
            if len(fused) == 1:
                return fused[0]
            return QuantizedTensor(fused, MIXED, (sum(p.shape[0] for p in flat), parts[0].shape[1]))
        data = torch.cat([p.data for p in parts])
        return QuantizedTensor(data, parts[0].qtype,
                               (sum(p.shape[0] for p in parts), parts[0].shape[1]))

    def linear(self, weight: QuantizedTensor) -> QuantizedLinear:
        """``(x, bias) -> x @ W.T + bias`` over the blocks, repacked once here for the
        kernel (:func:`lmkit_kernels.cpu.qgemv.pack_weight`: the same bytes, regrouped
        by 16 rows; ``weight`` itself is not kept)."""
        if weight.qtype == MIXED:
            return _mixed([self.linear(p) for p in weight.data], weight.data)
        packed = self._pack(self._qtypes[weight.qtype], weight.data, weight.shape[1])
        return self._keep(packed, self._bind(packed))[0]  # the weight's arguments bound

    def linear_with_norm(self, weight: QuantizedTensor
                         ) -> tuple[QuantizedLinear, QuantizedNormLinear]:
        """:meth:`linear`'s function and the one with the norm folded in
        (:func:`lmkit_kernels.cpu.qgemv_fold.bind_norm_linear`), over one packing."""
        if weight.qtype == MIXED:
            pairs = [self.linear_with_norm(p) for p in weight.data]
            norm = _mixed_norm([b for _, b in pairs], weight.data)
            self._packed[norm] = tuple(self._packed[b] for _, b in pairs)  # parts, in order
            return _mixed([a for a, _ in pairs], weight.data), norm
        packed = self._pack(self._qtypes[weight.qtype], weight.data, weight.shape[1])
        return self._keep(packed, self._bind(packed), self._bind_norm(packed))  # type: ignore[return-value]

    def linear_with_silu_mul(self, weight: QuantizedTensor
                             ) -> tuple[QuantizedLinear, QuantizedSiluLinear | None]:
        """:meth:`linear`'s function and the one with SiLU-and-multiply folded in
        (:func:`lmkit_kernels.cpu.qgemv_fold.bind_silu_linear`; ``None`` where torch's
        AVX-512 ``silu`` cannot be matched bit for bit), over one packing."""
        if weight.qtype == MIXED:
            return self.linear(weight), None
        packed = self._pack(self._qtypes[weight.qtype], weight.data, weight.shape[1])
        return self._keep(packed, self._bind(packed), self._bind_silu(packed))  # type: ignore[return-value]

    def _keep(self, packed: Any, *kernels: Any) -> tuple[Any, ...]:
        for kernel in kernels:
            if kernel is not None:
                self._packed[kernel] = packed
        return kernels

    def packed_weight(self, kernel: Any) -> Any:
        """The :class:`lmkit_kernels.cpu.qgemv.PackedWeight` a kernel function this
        method returned computes with (a tuple of them, in row order, for the norm-folded
        kernel of a :data:`MIXED` projection) (for code that calls the C kernels itself, e.g.
        :mod:`lmkit_plugins.models.cpu_decode_stack`), else ``None``."""
        return self._packed.get(kernel) if kernel is not None else None

    def dequantize(self, weight: QuantizedTensor, rows: Any = None) -> torch.Tensor:
        """Float32 rows of ``weight`` (the C kernel)."""
        from lmkit_kernels.cpu.qgemv import dequantize_rows

        if weight.qtype == MIXED:
            whole = torch.cat([self.dequantize(p) for p in weight.data])
            return whole if rows is None else whole[rows]
        return dequantize_rows(self._qtypes[weight.qtype], weight.data, weight.shape[1], rows)


def _split(bias: torch.Tensor | None, parts: tuple[QuantizedTensor, ...]
           ) -> list[torch.Tensor | None]:
    if bias is None:
        return [None] * len(parts)
    return list(bias.split([p.shape[0] for p in parts]))


def _mixed(kernels: list[QuantizedLinear], parts: tuple[QuantizedTensor, ...]
           ) -> QuantizedLinear:
    """One projection over parts of different types: each part's kernel, outputs side
    by side (the same values as the parts computed apart)."""
    def linear(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.cat([k(x, b) for k, b in zip(kernels, _split(bias, parts), strict=True)],
                         dim=1)

    return linear


def _mixed_norm(kernels: list[QuantizedNormLinear], parts: tuple[QuantizedTensor, ...]
                ) -> QuantizedNormLinear:
    """:func:`_mixed` with the norm folded: each part's kernel computes the same norm
    (bit-identical; it is a few microseconds a row) and the first one's residual is kept."""
    def linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
               eps: float, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        outs = [k(x, residual, norm_weight, eps, b)
                for k, b in zip(kernels, _split(bias, parts), strict=True)]
        return torch.cat([y for y, _ in outs], dim=1), outs[0][1]

    return linear

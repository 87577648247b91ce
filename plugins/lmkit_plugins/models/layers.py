"""Building blocks of decoder-only models over packed tokens (no batch axis).

Weights are ``[out, in]`` tensors everywhere. On the CPU, float32 projections of
decode batches (at most 32 rows) run lmkit's C row-GEMV kernel
(:mod:`lmkit_kernels.cpu.row_gemv`), which reads contiguous ``[out, in]`` weights as
one sequential stream per thread, close to the machine's read bandwidth; larger
float32 inputs and bfloat16 go through oneDNN's linear kernel (the one torch.compile's
CPU backend emits) rather than ``F.linear``'s MKL GEMM, about twice as fast for small
batches on the AMD CPUs measured (see :mod:`lmkit_plugins.models.cpu_linear`). Without the C
kernel, float32 projections keep the ``[out, in]`` weight as a transposed view of
``[in, out]`` memory, which oneDNN runs faster (see :func:`cpu_weight_row_length`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from lmkit.api import ModelLoadError
from torch import nn

from lmkit_plugins.models.cpu_linear import (
    _ROW_GEMV_MAX_ROWS,
    _linear_binary,
    _linear_pointwise,
    _onednn_linear,
    _row_gemv_or_onednn,
    cpu_linear_kernel,
    cpu_weight_row_length,
)
from lmkit_plugins.models.fused_ops import (
    SMALL_BATCH,
    fused_ops_enabled,
    gemv_fold,
    glu_epilogue,
    glu_small_m_linear,
    linear_kernel,
    rms_norm_kernel,
)
from lmkit_plugins.models.quant_weights import QuantizedShards


class Linear(nn.Module):
    """``y = x W^T + b`` whose output is made of named shards (fused projections).

    ``shard_sizes`` names the output slices in order, e.g. ``{"q": 576, "k": 192,
    "v": 192}`` for a fused QKV projection or ``{"weight": n}`` for a plain one; each
    shard is loaded from its own checkpoint tensor with :meth:`load_shard`. ``weight``
    is ``[out, in]`` but may be a strided view (see :func:`cpu_weight_row_length`), and
    :meth:`forward`'s output may be a view whose rows are further apart than
    ``out_features``; load weights with :meth:`load_shard` (it writes in place).

    With a ``quantization`` method (:class:`lmkit.api.QuantizationMethod`) the weight
    arrives packed (:class:`lmkit.api.QuantizedTensor` shards) and the layer computes
    with the method's kernel once every shard is loaded; no float32 weight is allocated
    unless the shards cannot be fused (then they are dequantized).

    ``glu=True`` marks a SwiGLU gate-up projection (two shards of one size, gate then
    up): dense CUDA half-precision layers then also give ``silu(gate) * up`` straight
    from the projection kernel (:meth:`forward_glu`, :func:`fused_ops.glu_epilogue`).
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], *, bias: bool,
                 dtype: torch.dtype, device: torch.device, quantization: Any = None,
                 fold: str | None = None, glu: bool = False) -> None:
        # fold: the input transform a quantization method may fold into this layer's
        # kernel: "norm" (forward_add_rms_norm) or "silu_mul" (forward_silu_mul)
        super().__init__()
        if glu and (len(shard_sizes) != 2 or len(set(shard_sizes.values())) != 1):
            raise ValueError(f"a SwiGLU gate-up projection has two shards of one size, got "
                             f"{shard_sizes}")
        self.in_features = in_features
        self.out_features = out = sum(shard_sizes.values())
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (start, size)
            start += size
        self.kernel = linear_kernel(device, dtype, cpu_linear_kernel(device, dtype))
        #: silu(gate) * up from this projection's kernel (forward_glu) for decode sizes
        self.glu = glu and quantization is None and glu_epilogue(device, dtype, out)
        #: dense CUDA half precision: the weight-streaming kernel with ``fold`` inside, for
        #: decode-sized inputs (fused_ops.GemvFold); None when the fold does not apply
        self.gemv_fold = (gemv_fold(device, dtype, fold) if fold and quantization is None
                          else None)
        kw = {"dtype": dtype, "device": device}
        self._quant = (QuantizedShards(quantization, list(shard_sizes), fold)
                       if quantization is not None else None)
        self._qkernel: Any = None
        # the method's kernels with the input norm / SiLU-and-multiply folded in
        self._qnorm: Any = None
        self._qsilu: Any = None
        self._qfold_rows = min(quantization.fold_max_rows, _CPU_NORM_MAX_ROWS) if (
            quantization is not None) else 0
        row = None if self._quant else cpu_weight_row_length(self.kernel, dtype, out)
        if self._quant is not None:  # filled by load_shard from the packed shards
            weight = torch.empty(0, in_features, **kw)
        elif row is None:
            weight = torch.empty(out, in_features, **kw)
        else:  # [out, in] view of [in, row] memory (strides (1, row)); padding stays zero
            weight = torch.zeros(in_features, row, **kw).t()[:out]
        bias_memory = torch.zeros(row or out, **kw) if bias else None
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = (nn.Parameter(bias_memory[:out], requires_grad=False)
                     if bias_memory is not None else None)
        # with padding, the kernel runs on the whole memory: [row, in] and [row]
        padded = row is not None and row > out
        self._padded_weight = weight.as_strided((row, in_features), (1, row)) if padded else None
        self._padded_bias = bias_memory if padded else None

    def load_shard(self, shard: str, weight: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> None:
        """Copy a checkpoint tensor into the output slice named ``shard``."""
        start, size = self.shard_offsets[shard]
        if weight is not None and self._quant is not None:
            if self._quant.add(shard, weight, size, self.in_features):
                self._qkernel, dense = self._quant.build()
                self._qnorm, self._qsilu = self._quant.norm_kernel, self._quant.silu_kernel
                if dense is not None:  # on the layer's device (a CUDA method's dense parts)
                    self.weight = nn.Parameter(dense.to(self.weight.device, self.weight.dtype),
                                               requires_grad=False)
                self._quant = None
        elif weight is not None:
            _copy_checked(self.weight[start:start + size], weight, shard)
        if bias is not None:
            if self.bias is None:
                raise ValueError(f"shard {shard!r} has a bias but the layer was built without one")
            _copy_checked(self.bias[start:start + size], bias, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in] -> [num_tokens, out]
        if self._qkernel is not None:
            return self._qkernel(x, self.bias)
        if self._padded_weight is None:
            return self.kernel(x, self.weight, self.bias)
        # [num_tokens, row] -> its first out columns (a view; the rest are padding)
        return self.kernel(x, self._padded_weight, self._padded_bias)[:, :self.out_features]

    def forward_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                             norm: RMSNorm, glu: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(forward(norm(x + residual)), x + residual)`` (``x`` alone, and returned as
        the residual, when ``residual`` is ``None``): a pre-norm layer's norm and first
        projection. With a quantization method that folds norms
        (``supports_norm_linear``), decode-sized float32 CPU inputs take one kernel
        call, bit-identical to the two steps (a CUDA method's inputs of up to its
        ``fold_max_rows`` rows too, where the norm is lmkit's kernel); so do one-row CUDA
        inputs with :attr:`gemv_fold` (the same bits up to the order of the norm's sum of
        squares). ``glu``: the first item is :meth:`forward_glu`'s ``silu(gate) * up``
        instead (only where :meth:`glu_takes` ``x``; one row: the norm fold's kernel
        stores it)."""
        if self.gemv_fold is not None and self.gemv_fold.takes(x):
            return self.gemv_fold.norm_linear(x, residual, norm.weight, norm.eps, self.weight,
                                              self.bias, glu_out=glu)
        if (not glu and self._qnorm is not None and x.shape[0] <= self._qfold_rows
                and x.dim() == 2 and x.stride(1) == 1
                and (residual is None or residual.stride(1) == 1)
                and (norm.has_cpu_kernel or norm.has_fused_kernel)):
            return self._qnorm(x, residual, norm.weight, norm.eps, self.bias)
        project = self.forward_glu if glu else self.forward
        if residual is None:
            return project(norm.forward(x)), x  # type: ignore[arg-type]
        h, residual = norm.forward(x, residual)
        return project(h), residual

    def glu_takes(self, x: torch.Tensor) -> bool:
        """Whether :meth:`forward_glu` (and ``forward_add_rms_norm(..., glu=True)``) run
        for ``x`` (``[rows, in]``): a :attr:`glu` layer and at most ``SMALL_BATCH`` rows
        (the inputs :func:`~lmkit_plugins.models.fused_ops.linear_kernel` streams)."""
        return self.glu and x.dim() == 2 and x.shape[0] <= SMALL_BATCH

    def forward_glu(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of :meth:`forward` (``[rows, out / 2]``), computed in the
        projection kernel's epilogue (the same bits as the separate SiLU-and-multiply
        kernel). Only where :meth:`glu_takes` ``x``."""
        return glu_small_m_linear(x, self.weight, self.bias)

    def forward_silu_mul(self, gate_up: torch.Tensor,
                         act: Callable[[torch.Tensor], torch.Tensor] | None = None
                         ) -> torch.Tensor:
        """``forward(act(gate_up))``, ``act`` SiLU-and-multiply (:func:`silu_and_mul` when
        not given): a gated MLP's down projection. With a quantization method that folds
        SiLU-and-multiply (``supports_silu_mul_linear``), decode-sized float32 CPU inputs
        take one kernel call, bit-identical to the two steps; with :attr:`gemv_fold`,
        one-row CUDA inputs too."""
        if self.gemv_fold is not None and self.gemv_fold.takes(gate_up):
            return self.gemv_fold.silu_mul_linear(gate_up, self.weight, self.bias)
        if (self._qsilu is not None and gate_up.shape[0] <= self._qfold_rows
                and gate_up.dim() == 2 and gate_up.stride(1) == 1):
            return self._qsilu(gate_up, self.bias)
        return self.forward((act or silu_and_mul)(gate_up))

    def _onednn_fusable(self, x: torch.Tensor) -> bool:
        """Whether oneDNN runs this projection of ``x`` (CPU, float32/bfloat16, not the
        row-GEMV kernel's decode sizes, no quantization, no padded weight), so that an
        elementwise follower can join its matmul as a post-op."""
        return (_linear_pointwise is not None and self._qkernel is None
                and self._padded_weight is None and x.dim() == 2
                and (self.kernel is _onednn_linear
                     or (self.kernel is _row_gemv_or_onednn
                         and x.shape[0] > _ROW_GEMV_MAX_ROWS)))

    def forward_gelu(self, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        """``F.gelu(forward(x), approximate=...)``; on the CPU the GELU is oneDNN's
        post-op, applied to the matmul's float32 accumulator before it is stored (one
        pass over the output fewer; in bfloat16 one rounding fewer)."""
        if self._onednn_fusable(x):
            return _linear_pointwise(x, self.weight, self.bias, "gelu", [], approximate)
        return F.gelu(self.forward(x), approximate=approximate)

    def forward_add(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``forward(x) + other`` (a residual); on the CPU the add is oneDNN's binary
        post-op, applied before the result is stored."""
        if (self._onednn_fusable(x) and other.shape == (x.shape[0], self.out_features)
                and other.dtype == x.dtype and other.is_contiguous()):
            return _linear_binary(x, other, self.weight, self.bias, "add")
        return self.forward(x) + other


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} does not match the "
                         f"model's {tuple(dst.shape)}")
    dst.copy_(src)


def whole_weight_loader(param: torch.Tensor, name: str) -> Callable[[torch.Tensor], None]:
    """A checkpoint loader copying tensor ``name`` into ``param`` as it is (no split, no
    fusion); a shape that differs is a :class:`~lmkit.api.ModelLoadError` naming both."""
    def load(t: torch.Tensor) -> None:
        if tuple(t.shape) != tuple(param.shape):
            raise ModelLoadError(f"weight {name}: checkpoint shape {tuple(t.shape)} does not "
                                 f"match the model's {tuple(param.shape)}")
        param.copy_(t)
    return load


_CPU_NORM_MAX_ROWS = 32  # lmkit_kernels.cpu.rms_norm.MAX_ROWS


def cpu_rms_norm_kernel(device: torch.device | str, dtype: torch.dtype
                        ) -> Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]] | None:
    """lmkit's C residual-add + RMSNorm (:mod:`lmkit_kernels.cpu.rms_norm`) for a float32
    CPU layer when it builds on this machine, else ``None`` (torch ops). At batch 1 it
    saves the torch ops' dispatch, 15-30 us per call inside a model."""
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return None
    return _cpu_rms_norm()


@functools.cache
def _cpu_rms_norm() -> Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]] | None:
    from lmkit_kernels.cpu.rms_norm import MAX_ROWS, rms_norm_kernel

    assert MAX_ROWS >= _CPU_NORM_MAX_ROWS
    return rms_norm_kernel()


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
        # CPU float32: lmkit's C kernel for decode-sized inputs (see cpu_rms_norm_kernel)
        self._cpu_rows = cpu_rms_norm_kernel(device, dtype)
        #: whether inputs of up to 32 rows take lmkit's C kernel (what a quantized
        #: projection that folds the norm reproduces; see Linear.forward_add_rms_norm)
        self.has_cpu_kernel = self._cpu_rows is not None and self._fused is None
        #: whether 2-D inputs take lmkit's Triton kernel (what a CUDA quantization method
        #: that folds the norm reproduces)
        self.has_fused_kernel = self._fused is not None

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
        if self._cpu_rows is not None and x.dim() == 2 and x.shape[0] <= _CPU_NORM_MAX_ROWS:
            return self._cpu_rows(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for a fused ``[n, 2 * intermediate]`` gate-up projection."""
    size = gate_up.shape[-1] // 2  # two slices: cheaper per call than chunk()
    return F.silu(gate_up[..., :size]).mul_(gate_up[..., size:])


class VocabEmbedding(nn.Module):
    """Token embedding table ``[vocab, hidden]``, optionally also the LM head (tied).

    Like :class:`Linear`'s, the table may be a transposed view of ``[hidden, row]``
    memory (:func:`cpu_weight_row_length`): the LM head reads it faster, and a lookup
    gathers each token's ``hidden`` values with a stride instead of one row.
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype,
                 device: torch.device, quantization: Any = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.kernel = linear_kernel(device, dtype, cpu_linear_kernel(device, dtype))
        # quantized: the packed table (lookups dequantize rows; the head runs the kernel)
        self._quant = QuantizedShards(quantization, ["weight"]) if quantization else None
        self._qtable: Any = None
        self._qkernel: Any = None
        row = None if quantization else cpu_weight_row_length(self.kernel, dtype, vocab_size)
        if quantization is not None:  # filled by load() from the packed table
            weight = torch.empty(0, hidden_size, dtype=dtype, device=device)
        elif row is None:
            weight = torch.empty(vocab_size, hidden_size, dtype=dtype, device=device)
        else:  # [vocab, hidden] view of [hidden, row] memory; padding stays zero
            weight = torch.zeros(hidden_size, row, dtype=dtype, device=device).t()[:vocab_size]
        self.weight = nn.Parameter(weight, requires_grad=False)
        self._padded_weight = (weight.as_strided((row, hidden_size), (1, row))
                               if row is not None and row > vocab_size else None)

    def load(self, weight: Any) -> None:
        """Load the checkpoint's table (dense, or packed with a quantization method)."""
        if self._quant is None:
            _copy_checked(self.weight, weight, "embed_tokens")
            return
        self._quant.add("weight", weight, self.vocab_size, self.weight.shape[1])
        self._qkernel, dense = self._quant.build()
        if dense is not None:
            self.weight = nn.Parameter(dense.to(self.weight.device, self.weight.dtype),
                                       requires_grad=False)
        else:
            self._qtable = weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [num_tokens] -> [num_tokens, hidden]
        if self._qtable is not None:
            return self._quant.dense_rows(self._qtable, input_ids)  # type: ignore[union-attr]
        return F.embedding(input_ids, self.weight)

    def logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """LM head over this table: ``[n, hidden]`` -> float32 ``[n, vocab]`` (contiguous);
        ``float32=False``: in the head's own output dtype (for an argmax alone)."""
        if self._qkernel is not None:
            return self._qkernel(hidden, None)
        if self._padded_weight is None:
            logits = self.kernel(hidden, self.weight, None)
            return logits.float() if float32 else logits
        return self.kernel(hidden, self._padded_weight, None)[:, :self.vocab_size].contiguous()

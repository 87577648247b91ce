"""The ``fp8`` quantization method: float8 e4m3 weights with one float32 scale per
output channel, on CUDA GPUs of compute capability 8.9 or newer (Ada, Hopper).

Weights come from an FP8 checkpoint (compressed-tensors or ``quant_method: fp8``) or
from a dense one quantized at load (:mod:`lmkit_plugins.quantization.fp8_checkpoint`).
The embedding, the LM head and the norms stay in the model dtype. A projection of at
most ``gemv_max_rows`` rows (decode) streams its FP8 weight through lmkit's
weight-streaming Triton GEMV (:func:`lmkit_kernels.gemv.small_m_linear` with
``weight_scale``: weight-only FP8, activations unquantized); larger inputs quantize the
activations per token and multiply in FP8 with ``torch._scaled_mm``
(:func:`lmkit_kernels.fp8.scaled_mm_linear`, W8A8). Both are CUDA-graph safe.

Where the weights are on the CPU (a machine without CUDA: tests only, since the
method's caps declare ``device: cuda``), :meth:`Fp8Method.linear` computes the same two
products with their torch references.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from lmkit.api import (
    ModelLoadError,
    QuantizationMethod,
    QuantizedLinear,
    QuantizedTensor,
    check_weight_files,
    iterate_weights,
)

from lmkit_plugins.quantization.fp8_checkpoint import (
    QTYPE,
    Fp8Layout,
    Fp8Weight,
    iterate_fp8,
    plan_weights,
    quantized,
    read_headers,
    read_layout,
)
from lmkit_plugins.quantization.fp8_options import Fp8Options

if TYPE_CHECKING:
    from lmkit.api.model_facts import ModelFacts

MIN_CAPABILITY = (8, 9)  # e4m3 conversions and FP8 tensor cores: Ada, Hopper and newer


def gpu_unsupported_reason(device: torch.device) -> str | None:
    """Why FP8 weights cannot run on CUDA ``device`` (``None``: they can)."""
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        return (f"{torch.cuda.get_device_name(device)} has compute capability "
                f"{major}.{minor}; FP8 e4m3 needs 8.9 or newer (Ada, Hopper)")
    return None


class Fp8Method(QuantizationMethod):
    """FP8 e4m3 weights with per-output-channel scales (see the module docstring)."""

    def __init__(self, facts: ModelFacts, *, options: Any = None) -> None:
        super().__init__(facts, options=options)
        self.opts: Fp8Options = options if isinstance(options, Fp8Options) else Fp8Options()
        # the model's layers live on the current CUDA device (the runner's "cuda")
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cuda":
            reason = gpu_unsupported_reason(self.device)
            if reason is not None:
                raise ModelLoadError(f"the fp8 quantization method cannot run here: {reason}. "
                                     "Use --quantization none (dense weights).")
        self._layout: Fp8Layout | None = None
        self._plan: dict[str, str] | None = None

    def check(self) -> None:
        """Read ``config.json``'s layout and every safetensors header; refuse what the
        method cannot read (:func:`~lmkit_plugins.quantization.fp8_checkpoint.plan_weights`)."""
        model_dir = Path(self.facts.model_dir)
        files = check_weight_files(model_dir)
        self._layout = read_layout(model_dir)
        self._plan = plan_weights(read_headers(files), self._layout)

    def iterate_weights(self) -> Iterator[tuple[str, Any]]:
        """The checkpoint's tensors; FP8 weights and (dense checkpoints) the projections
        as per-channel :class:`QuantizedTensor` on the device."""
        if self._plan is None or self._layout is None:
            self.check()
        assert self._plan is not None and self._layout is not None
        yield from iterate_fp8(iterate_weights(Path(self.facts.model_dir)), self._plan,
                               self._layout, self.device, self.opts.quantize_lm_head)

    def fuse(self, parts: list[QuantizedTensor]) -> QuantizedTensor | None:
        """Rows (and their scales) concatenated: per-channel scales fuse exactly."""
        if any(p.qtype != QTYPE for p in parts) or len({p.shape[1] for p in parts}) != 1:
            return None
        if len(parts) == 1:
            return parts[0]
        return quantized(Fp8Weight(torch.cat([p.data.weight for p in parts]),
                                   torch.cat([p.data.scale for p in parts])))

    def linear(self, weight: QuantizedTensor) -> QuantizedLinear:
        """``(x, bias) -> x @ W.T + bias`` (:class:`Fp8Linear`)."""
        return Fp8Linear(weight.data, self.opts.gemv_max_rows, self.opts.gemv_block_k,
                         self.opts.gemv_block_n, num_warps=self.opts.gemv_num_warps,
                         num_stages=self.opts.gemv_num_stages,
                         row_tiles=self.opts.gemv_row_tiles if self.opts.gemv_row_kernel
                         else None)

    def dequantize(self, weight: QuantizedTensor, rows: Any = None) -> torch.Tensor:
        """Float32 ``weight * scale`` (rows ``rows``), on the weight's device."""
        from lmkit_kernels.fp8 import dequantize_fp8

        data: Fp8Weight = weight.data
        if rows is None:
            return dequantize_fp8(data.weight, data.scale)
        rows = rows.to(data.weight.device)
        return dequantize_fp8(data.weight[rows], data.scale[rows])


class Fp8Linear:
    """One projection's FP8 product: one row through the one-row kernel
    (:func:`lmkit_kernels.fp8_gemv.fp8_row_linear`, unless ``row_tiles`` is ``None``),
    up to ``max_rows`` rows through the tiled Triton GEMV, ``torch._scaled_mm``
    (per-token activation scales) above; on the CPU their torch references. Everything
    shape-dependent is decided here, once, not per call."""

    def __init__(self, data: Fp8Weight, max_rows: int, block_k: int,
                 block_n: int | None = None, *, num_warps: int = 4,
                 num_stages: int = 4, row_tiles: tuple[int, int, int] | None = None
                 ) -> None:
        from lmkit_kernels.fp8 import scaled_mm_unsupported_reason

        self.weight = data.weight.contiguous()  # [out, in] float8_e4m3fn
        self.scale = data.scale.float().contiguous()  # [out]
        self.scale_row = self.scale.view(1, -1)  # [1, out]: _scaled_mm's row-wise scale_b
        self.max_rows = max_rows
        self.block_k = block_k
        self.num_warps, self.num_stages = num_warps, num_stages
        #: one-row inputs' kernel launch (block_n, block_k, warps); None: the tiled GEMV
        self.row_tiles = row_tiles
        # narrow programs for small outputs so that every SM gets work (as bf16 does)
        self.block_n = block_n or (16 if self.weight.shape[0] <= 2048 else 32)
        self.on_cuda = self.weight.is_cuda
        #: why large batches dequantize instead of _scaled_mm (odd sizes); None: they don't
        self.scaled_mm_unsupported = (scaled_mm_unsupported_reason(self.weight)
                                      if self.on_cuda else None)

        # the three products, bound once: (x, bias) -> [n, out] (no imports or tile
        # choices per call)
        self._one_row, self._few_rows, self._many_rows = self._products()

    def _products(self) -> tuple[Any, Any, Any]:
        """The one-row (``None``: the few-rows product takes one row too), few-rows and
        many-rows products of this weight on its device."""
        w, s, row_tiles = self.weight, self.scale, self.row_tiles
        if not self.on_cuda:
            from lmkit_kernels.fp8 import fp8_linear_ref, scaled_mm_ref

            return (None, lambda x, b: fp8_linear_ref(x, w, s, b),
                    lambda x, b: scaled_mm_ref(x, w, s, b))
        from lmkit_kernels.fp8 import scaled_mm_linear
        from lmkit_kernels.fp8_gemv import fp8_row_linear
        from lmkit_kernels.gemv import small_m_linear

        def one_row(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            block_n, block_k, warps = row_tiles
            return fp8_row_linear(x, w, s, bias, block_n=block_n, block_k=block_k,
                                  num_warps=warps)

        def few_rows(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            return small_m_linear(x, w, bias, weight_scale=s, block_n=self.block_n,
                                  block_k=self.block_k, num_warps=self.num_warps,
                                  num_stages=self.num_stages)

        def many_rows(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            if self.scaled_mm_unsupported is None:
                return scaled_mm_linear(x, w, self.scale_row, bias)
            # scaled in float32 (a small scale would lose bits, or underflow, in fp16/bf16)
            return F.linear(x, (w.float() * s[:, None]).to(x.dtype), bias)

        return (None if row_tiles is None else one_row), few_rows, many_rows

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # x: [n, in] -> [n, out] in x's dtype
        rows = x.shape[0]
        if rows == 1 and self._one_row is not None:
            return self._one_row(x, bias)
        return (self._few_rows if rows <= self.max_rows else self._many_rows)(x, bias)

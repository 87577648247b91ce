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

One-row inputs (batch-1 decode) take the one-row kernel (:mod:`lmkit_kernels.fp8_gemv`),
which also folds the pre-norm layers' residual add + RMSNorm into the QKV and gate-up
projections and SiLU-and-multiply into the down projection
(:mod:`lmkit_kernels.fp8_gemv_fold`; the method's ``linear_with_norm`` /
``linear_with_silu_mul``, at :attr:`Fp8Method.fold_max_rows` rows): bit-identical to
the separate kernels up to the order of the norm's sum of squares. ``LMKIT_GEMV_FOLD``
(0, or the folds to keep) and ``LMKIT_FUSED_OPS=0`` turn the folds off, as for dense
weights (:mod:`lmkit_plugins.models.fused_ops`).

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
    QuantizedNormLinear,
    QuantizedSiluLinear,
    QuantizedTensor,
    check_weight_files,
    iterate_weights,
)

from lmkit_plugins.models.fused_ops import fused_ops_enabled, gemv_folds
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


def runs_kernels(weight: torch.Tensor) -> bool:
    """Whether products with ``weight`` run lmkit's Triton kernels (a CUDA weight) rather
    than their torch references (the seam the CPU routing tests force)."""
    return weight.is_cuda


def row_folds(device: torch.device) -> frozenset[str]:
    """The transforms the one-row kernel folds into its product on ``device`` (of
    ``norm``, ``silu_mul``): those ``LMKIT_GEMV_FOLD`` allows where the model runs lmkit's
    separate norm and SiLU kernels, which the folds reproduce (CUDA, Triton,
    ``LMKIT_FUSED_OPS`` not 0; FP8 models compute in bfloat16 or float16); else none."""
    return gemv_folds() if fused_ops_enabled(device, torch.bfloat16) else frozenset()


def gpu_unsupported_reason(device: torch.device) -> str | None:
    """Why FP8 weights cannot run on CUDA ``device`` (``None``: they can)."""
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        return (f"{torch.cuda.get_device_name(device)} has compute capability "
                f"{major}.{minor}; FP8 e4m3 needs 8.9 or newer (Ada, Hopper)")
    return None


class Fp8Method(QuantizationMethod):
    """FP8 e4m3 weights with per-output-channel scales (see the module docstring)."""

    supports_norm_linear = True
    supports_silu_mul_linear = True
    #: the folds run in the one-row kernel only (as for dense weights, folds pay at one
    #: row: lmkit_plugins.models.fused_ops.FOLD_MAX_ROWS)
    fold_max_rows = 1

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
        return self._linear(weight)

    def _linear(self, weight: QuantizedTensor, fold: str | None = None) -> Fp8Linear:
        opts = self.opts
        folds = row_folds(self.device) & {fold} if fold else frozenset()
        return Fp8Linear(weight.data, opts.gemv_max_rows, opts.gemv_block_k,
                         opts.gemv_block_n, num_warps=opts.gemv_num_warps,
                         num_stages=opts.gemv_num_stages,
                         row_tiles=opts.gemv_row_tiles if opts.gemv_row_kernel else None,
                         pipeline=opts.gemv_row_pipeline, folds=folds,
                         fold_block_n=opts.gemv_row_fold_block_n)

    def linear_with_norm(self, weight: QuantizedTensor
                         ) -> tuple[QuantizedLinear, QuantizedNormLinear | None]:
        """:meth:`linear`'s product and the one-row kernel with the input norm folded in
        (:attr:`Fp8Linear.norm_linear`; ``None`` where it does not run: see
        :func:`row_folds`)."""
        linear = self._linear(weight, "norm")
        return linear, linear.norm_linear

    def linear_with_silu_mul(self, weight: QuantizedTensor
                             ) -> tuple[QuantizedLinear, QuantizedSiluLinear | None]:
        """:meth:`linear`'s product and the one-row kernel with SiLU-and-multiply folded
        in (:attr:`Fp8Linear.silu_mul_linear`; ``None`` where it does not run)."""
        linear = self._linear(weight, "silu_mul")
        return linear, linear.silu_mul_linear

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
    shape-dependent is decided here, once, not per call.

    With the one-row kernel on CUDA, ``folds`` (of ``norm``, ``silu_mul``) adds that
    kernel with the transform folded in: :attr:`norm_linear` ``(x, residual,
    norm_weight, eps, bias) -> (y, x + residual)`` and :attr:`silu_mul_linear`
    ``(gate_up, bias) -> y``, for one-row inputs (``None`` when not built)."""

    def __init__(self, data: Fp8Weight, max_rows: int, block_k: int,
                 block_n: int | None = None, *, num_warps: int = 4,
                 num_stages: int = 4, row_tiles: tuple[int, int, int] | None = None,
                 pipeline: bool = False, folds: frozenset[str] = frozenset(),
                 fold_block_n: int | None = None) -> None:
        from lmkit_kernels.fp8 import scaled_mm_unsupported_reason

        self.weight = data.weight.contiguous()  # [out, in] float8_e4m3fn
        self.scale = data.scale.float().contiguous()  # [out]
        self.scale_row = self.scale.view(1, -1)  # [1, out]: _scaled_mm's row-wise scale_b
        self.max_rows = max_rows
        self.block_k = block_k
        self.num_warps, self.num_stages = num_warps, num_stages
        #: one-row inputs' kernel launch (block_n, block_k, warps); None: the tiled GEMV
        self.row_tiles = row_tiles
        self.pipeline = pipeline  # the one-row kernel's (and its folds') pipelined loop
        self.fold_block_n = fold_block_n  # the folds' rows per program (None: row_tiles')
        # narrow programs for small outputs so that every SM gets work (as bf16 does)
        self.block_n = block_n or (16 if self.weight.shape[0] <= 2048 else 32)
        self.on_cuda = runs_kernels(self.weight)
        #: why large batches dequantize instead of _scaled_mm (odd sizes); None: they don't
        self.scaled_mm_unsupported = (scaled_mm_unsupported_reason(self.weight)
                                      if self.on_cuda else None)

        # the three products, bound once: (x, bias) -> [n, out] (no imports or tile
        # choices per call)
        self._one_row, self._few_rows, self._many_rows = self._products()
        folding = self.on_cuda and row_tiles is not None
        self.norm_linear: QuantizedNormLinear | None = (
            self._norm_fold() if folding and "norm" in folds else None)
        self.silu_mul_linear: QuantizedSiluLinear | None = (
            self._silu_mul_fold() if folding and "silu_mul" in folds else None)

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

        launch = self._row_launch() if row_tiles is not None else {}

        def one_row(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            return fp8_row_linear(x, w, s, bias, **launch)

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

    def _row_launch(self, fold: bool = False) -> dict[str, Any]:
        assert self.row_tiles is not None
        block_n, block_k, warps = self.row_tiles
        if fold and self.fold_block_n is not None:  # (the same sums: block_k is kept)
            block_n = self.fold_block_n
        return {"block_n": block_n, "block_k": block_k, "num_warps": warps,
                "pipeline": self.pipeline}

    def _norm_fold(self) -> QuantizedNormLinear:
        from lmkit_kernels.fp8_gemv_fold import norm_fp8_row_linear

        w, s, launch = self.weight, self.scale, self._row_launch(fold=True)

        def norm_linear(x: torch.Tensor, residual: torch.Tensor | None,
                        norm_weight: torch.Tensor, eps: float, bias: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
            if x.shape[0] == 0:  # (the models route at most one row here)
                return x.new_empty((0, w.shape[0])), x if residual is None else x + residual
            return norm_fp8_row_linear(x, residual, norm_weight, eps, w, s, bias, **launch)

        return norm_linear

    def _silu_mul_fold(self) -> QuantizedSiluLinear:
        from lmkit_kernels.fp8_gemv_fold import silu_mul_fp8_row_linear

        w, s, launch = self.weight, self.scale, self._row_launch(fold=True)

        def silu_mul_linear(gate_up: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            if gate_up.shape[0] == 0:
                return gate_up.new_empty((0, w.shape[0]))
            return silu_mul_fp8_row_linear(gate_up, w, s, bias, **launch)

        return silu_mul_linear

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # x: [n, in] -> [n, out] in x's dtype
        rows = x.shape[0]
        if rows == 1 and self._one_row is not None:
            return self._one_row(x, bias)
        return (self._few_rows if rows <= self.max_rows else self._many_rows)(x, bias)

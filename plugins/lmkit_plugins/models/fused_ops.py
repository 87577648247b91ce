"""Which layer operations run as lmkit's fused Triton kernels instead of torch ops.

On CUDA in half precision the per-layer elementwise work (residual add + RMSNorm,
q/k norm + RoPE, SiLU-and-multiply) is memory- and launch-bound; as torch ops it is
about 25 kernels per decoder layer, which at batch 1 costs as much time as reading
the weights. :mod:`lmkit_kernels` does each in one kernel (three to four per layer);
the RoPE kernel also writes K/V to the cache when the attention backend allows it
(:meth:`lmkit.api.AttentionBackend.kv_write_slots`). All of them round where Hugging
Face's half-precision modules round, so their results are HF's bit for bit (up to
the order of float32 sums).
Projections of at most :data:`SMALL_BATCH` rows (decode at small batch) stream their
weight through :func:`lmkit_kernels.gemv.small_m_linear`, which on an H100 reads it
5-15% faster than cuBLAS at one row (bench/gemv_bandwidth.py); larger ones use cuBLAS.

Mixture-of-experts blocks run lmkit's fused MoE kernel on CUDA in every dtype
(:func:`fused_moe_enabled`) up to :data:`FUSED_MOE_MAX_ROWS_PER_EXPERT` rows per expert
and its grouped torch reference (cuBLAS per expert) above (:class:`MoEExperts`).
Those small batches also fold the transform before a projection into its kernel
(:class:`GemvFold`, :mod:`lmkit_kernels.gemv_fold`): the pre-norm layers' residual
add + RMSNorm into the QKV and gate-up projections (two kernels and their launches
fewer per layer), and with ``LMKIT_GEMV_FOLD=1`` also SiLU-and-multiply into the down
projection (off by default: slower, see :data:`DEFAULT_GEMV_FOLDS`);
``LMKIT_GEMV_FOLD=0`` turns folding off alone, ``norm`` or ``silu_mul`` keeps only
that fold.

Float32 and CPU models keep the torch ops (which match Hugging Face bit for bit on
the CPU). ``LMKIT_FUSED_OPS=0`` turns the kernels off everywhere (for A/B checks).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch
from lmkit.api import switched_off

HALF_DTYPES = (torch.float16, torch.bfloat16)
SMALL_BATCH = 8  # rows up to which projections use the weight-streaming Triton kernel
#: Average ``(token, expert)`` rows per expert (``tokens * top_k / experts``) from which
#: MoE layers run the grouped torch reference instead of the fused kernel: its 64 x 64
#: tiles lose to cuBLAS on large per-expert GEMMs. H100, a Mixtral-8x7B layer in bf16
#: (session 8, bench/moe_kernel.py), fused vs reference: 1.23 vs 1.65 ms at 300 tokens
#: (75 rows per expert), 2.60 vs 2.11 at 1,024 (256 rows), 10.08 vs 5.79 at 4,096
#: (1,024 rows); 256 is the smallest measured count where the reference won.
#: ``LMKIT_FUSED_MOE_MAX_ROWS_PER_EXPERT`` overrides it (``0``: always the reference).
FUSED_MOE_MAX_ROWS_PER_EXPERT = 256
MOE_ROWS_ENV = "LMKIT_FUSED_MOE_MAX_ROWS_PER_EXPERT"
GEMV_FOLD_ENV = "LMKIT_GEMV_FOLD"
GEMV_FOLDS = ("norm", "silu_mul")  # the transforms GemvFold folds into a projection
#: the folds on when ``LMKIT_GEMV_FOLD`` is unset: the SiLU fold measured slower than the
#: separate SiLU kernel on an H100 once the decode step's kernels launch with PDL (W2's
#: 32-layer chain, session 12: norm fold only 5.595 ms, both 5.673, none 5.648; FP8
#: weights 3.405 / 3.514 / 3.470): every down-projection program recomputes SiLU over the
#: whole gate-up row, where the norm fold's per-program prologue is one cheap row pass
DEFAULT_GEMV_FOLDS = ("norm",)
#: ``0`` turns off SwiGLU in the gate-up projection's epilogue (:func:`glu_epilogue`)
GLU_EPILOGUE_ENV = "LMKIT_GLU_EPILOGUE"
#: ``0``: every projection keeps the narrow tiles (:func:`small_m_tiles`)
WIDE_TILES_ENV = "LMKIT_GEMV_WIDE_TILES"
#: outputs from which a weight-streaming projection takes the wide tiles
WIDE_TILES_MIN_OUT = 6144



def fused_ops_enabled(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether a layer built for ``device`` and ``dtype`` should use the fused kernels:
    CUDA, float16/bfloat16, Triton installed, and ``LMKIT_FUSED_OPS`` not ``0``."""
    return fused_moe_enabled(device) and dtype in HALF_DTYPES


def fused_moe_enabled(device: torch.device | str) -> bool:
    """Whether a mixture-of-experts layer on ``device`` runs lmkit's fused MoE kernel
    (:func:`lmkit_kernels.moe.fused_moe`, any float dtype): CUDA, Triton installed, and
    ``LMKIT_FUSED_OPS`` not ``0``; otherwise its torch reference."""
    if switched_off("LMKIT_FUSED_OPS"):
        return False
    return (torch.device(device).type == "cuda"
            and importlib.util.find_spec("triton") is not None)


def rms_norm_kernel() -> Callable[..., Any]:
    """``(x, weight, eps, residual=None)``: :func:`lmkit_kernels.norm.rms_norm`."""
    from lmkit_kernels.norm import rms_norm

    return rms_norm


def silu_and_mul_kernel() -> Callable[[torch.Tensor], torch.Tensor]:
    """``gate_up -> silu(gate) * up``: :func:`lmkit_kernels.activation.silu_and_mul`."""
    from lmkit_kernels.activation import silu_and_mul

    return silu_and_mul


def rotary_qk_kernel() -> Callable[..., None]:
    """In-place q/k norm + RoPE on a fused QKV output, optionally storing K/V in the
    paged cache in the same pass: :func:`lmkit_kernels.rotary.rotary_qk_`."""
    from lmkit_kernels.rotary import rotary_qk_

    return rotary_qk_


def fused_moe_kernel() -> Callable[..., torch.Tensor]:
    """``(x, w13, w2, topk_weights, topk_ids) -> [T, H]``:
    :func:`lmkit_kernels.moe.fused_moe`."""
    from lmkit_kernels.moe import fused_moe

    return fused_moe


class MoEExperts:
    """``(x, w13, w2, topk_weights, topk_ids) -> [T, H]``: ``fused`` (the Triton kernel)
    below ``max_rows_per_expert`` average rows per expert, ``reference`` (the grouped
    torch path, which reads the per-expert counts on the host) from there on; always
    ``fused`` while a CUDA graph is being captured (no host sync allowed there)."""

    def __init__(self, fused: Callable[..., torch.Tensor], reference: Callable[..., torch.Tensor],
                 max_rows_per_expert: int = FUSED_MOE_MAX_ROWS_PER_EXPERT) -> None:
        self.fused = fused
        self.reference = reference
        self.max_rows_per_expert = max_rows_per_expert

    def uses_fused(self, num_tokens: int, top_k: int, num_experts: int) -> bool:
        """Whether a call over ``num_tokens`` tokens runs the fused kernel."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return True
        return num_tokens * top_k < self.max_rows_per_expert * num_experts

    def __call__(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        fn = (self.fused if self.uses_fused(topk_ids.shape[0], topk_ids.shape[1], w13.shape[0])
              else self.reference)
        return fn(x, w13, w2, topk_weights, topk_ids)


def moe_max_rows_per_expert() -> int:
    """:data:`FUSED_MOE_MAX_ROWS_PER_EXPERT`, or ``$LMKIT_FUSED_MOE_MAX_ROWS_PER_EXPERT``.

    :raises ValueError: when the variable is not a non-negative integer."""
    raw = os.environ.get(MOE_ROWS_ENV, "").strip()
    if not raw:
        return FUSED_MOE_MAX_ROWS_PER_EXPERT
    if not raw.isdigit():
        raise ValueError(f"{MOE_ROWS_ENV}={raw!r}: expected a non-negative integer (average "
                         "rows per expert from which MoE layers use the torch reference; "
                         f"default {FUSED_MOE_MAX_ROWS_PER_EXPERT}); unset it or fix it")
    return int(raw)


def moe_experts(device: torch.device | str) -> Callable[..., torch.Tensor]:
    """The experts function of a MoE layer on ``device``: :class:`MoEExperts` over the
    fused kernel when :func:`fused_moe_enabled`, else the torch reference."""
    from lmkit_kernels.moe_ref import fused_moe_ref

    if not fused_moe_enabled(device):
        return fused_moe_ref
    return MoEExperts(fused_moe_kernel(), fused_moe_ref, moe_max_rows_per_expert())


def linear_kernel(device: torch.device | str, dtype: torch.dtype,
                  fallback: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``(x, weight, bias) -> x @ weight.T + bias`` for a layer on ``device``/``dtype``:
    with the fused kernels on, small batches go through the weight-streaming Triton
    kernel and the rest through cuBLAS; otherwise ``fallback``."""
    if not fused_ops_enabled(device, dtype):
        return fallback
    import torch.nn.functional as F
    from lmkit_kernels.gemv import small_m_linear

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
               ) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= SMALL_BATCH:
            return small_m_linear(x, weight, bias, **small_m_tiles(weight.shape[0]))
        return F.linear(x, weight, bias)

    return linear


def small_m_tiles(out_features: int) -> dict[str, int]:
    """The launch parameters of the weight-streaming kernel for a plain projection with
    ``out_features`` outputs (:func:`linear_kernel`; the folds and the SwiGLU epilogue
    keep :func:`narrow_tiles`): from :data:`WIDE_TILES_MIN_OUT` outputs on (LM heads,
    gate-up projections) 64-row programs of 8 warps over 256-wide ``K`` slices, unless
    ``LMKIT_GEMV_WIDE_TILES=0``; below, :func:`narrow_tiles`.

    Measured on an H200 (``bench/gemv_bandwidth.py``, each call in a CUDA graph; narrow
    32/512/4/4 against wide 64/256/8/3, 1 row): Qwen3-0.6B's LM head 104.3 / 72.6 us (its
    1,024-wide rows are two 512-wide slices, too few for 4 stages to overlap), its gate-up
    6.9 / 5.8, Llama-3.1-8B's gate-up 60.6 / 57.4, LM head 247.8 / 240.1, QKV (6,144
    outputs) 16.8 / 16.6; below 6,144 outputs the narrow tiles won (Llama's output
    projection 10.2 / 14.2, down 29.3 / 42.7; Qwen's QKV 3.9 / 5.0). Decode steps
    (``bench/decode_chain.py``, session 38): Llama-8B at 4 rows 4.336 against 4.639 ms,
    Qwen3-0.6B at 4 / 16 rows 1.025 / 1.152 against 1.115 / 1.214, SmolLM2-135M at 1 row
    0.632 against 0.647.
    The folded kernels measured far slower with them (Llama-8B at 1 row: 5.86 against
    4.44 ms), so they keep the narrow tiles."""
    if out_features >= WIDE_TILES_MIN_OUT and not switched_off(WIDE_TILES_ENV):
        return {"block_n": 64, "block_k": 256, "num_warps": 8, "num_stages": 3}
    return narrow_tiles(out_features)


def narrow_tiles(out_features: int) -> dict[str, int]:
    """The weight-streaming launch of the folded projections (:class:`GemvFold`), of the
    gate-up projection with SwiGLU in its epilogue (:func:`glu_epilogue`), and of plain
    projections below :data:`WIDE_TILES_MIN_OUT` outputs: narrow programs for small
    outputs so that every SM gets work."""
    return {"block_n": 16 if out_features <= 2048 else 32, "block_k": 512, "num_warps": 4,
            "num_stages": 4}


#: pipeline stages of the norm fold: 3 lets two programs share an SM at one row on sm_90
#: (86 KiB of shared memory each; 4 stages take 121 KiB), so one's 1/rms prologue runs
#: while the other streams its weight tiles. Not yet measured against 4 on a GPU:
#: ``bench/gemv_fold.py --sweep`` times both.
NORM_FOLD_STAGES = 3
#: rows up to which the folds run. Measured on the H100 (``bench/gemv_fold.py``, session
#: 11): at 1 row the folds save 0.07 ms per Llama-8B decode step; at 8 rows the folded
#: kernels are slower than the separate ones (Llama-8B down projection 171 vs 45 us,
#: Qwen3-0.6B's 38 vs 8.6 us), so 2-8 rows keep the separate kernels. Session 35 tried the
#: norm fold at up to 4 rows with a prologue computing every row's 1/rms in one pass (a
#: batch-1 verification of 3 drafts is 4 rows): SmolLM2 with an EAGLE-3 head at batch 1 ran
#: 11% slower end to end on an H200 (1,768 against 1,972 tok/s, bench/engine_ab.py), so
#: it was not kept; session 37's forms without a prologue (1 / rms applied after the
#: product, with and without tensor cores) were also slower at 4 rows than the two
#: separate kernels (docs/gpu.md, "Session 37")
FOLD_MAX_ROWS = 1


class GemvFold:
    """Projections of at most :data:`FOLD_MAX_ROWS` rows (of the inputs :func:`linear_kernel`
    sends to the weight-streaming kernel) with their input transform folded into that
    kernel (:mod:`lmkit_kernels.gemv_fold`), over the same tiles (the norm fold with
    :data:`NORM_FOLD_STAGES` stages): the result is the unfused path's up to the order
    of the norm's float32 sum of squares."""

    def __init__(self) -> None:
        from lmkit_kernels.gemv_fold import norm_small_m_linear, silu_mul_small_m_linear

        self._norm_linear = norm_small_m_linear
        self._silu_mul_linear = silu_mul_small_m_linear

    @staticmethod
    def takes(x: torch.Tensor) -> bool:
        """Whether the folded kernel runs for the input ``x`` (``[rows, in]``)."""
        return x.dim() == 2 and x.shape[0] <= FOLD_MAX_ROWS

    def norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None,
                    norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                    bias: torch.Tensor | None, glu_out: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(x + residual) @ weight.T + bias, x + residual)``; with
        ``glu_out``, ``silu(gate) * up`` of that product (``weight`` ``[gate | up]``)."""
        return self._norm_linear(x, residual, norm_weight, eps, weight, bias,
                                 glu_out=glu_out, **self.tiles("norm", weight.shape[0]))

    def silu_mul_linear(self, gate_up: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
        """``silu_and_mul(gate_up) @ weight.T + bias``."""
        return self._silu_mul_linear(gate_up, weight, bias,
                                     **self.tiles("silu_mul", weight.shape[0]))

    @staticmethod
    @functools.cache  # per projection shape, once (the result is only unpacked)
    def tiles(fold: str, out_features: int) -> dict[str, int]:
        """The launch parameters of ``fold``'s kernel (one of :data:`GEMV_FOLDS`) for a
        projection with ``out_features`` outputs."""
        tiles = narrow_tiles(out_features)
        return {**tiles, "num_stages": NORM_FOLD_STAGES} if fold == "norm" else tiles


def gemv_fold(device: torch.device | str, dtype: torch.dtype, fold: str) -> GemvFold | None:
    """The :class:`GemvFold` for a dense projection on ``device``/``dtype`` whose input
    transform is ``fold`` (one of :data:`GEMV_FOLDS`), when the fused kernels are on
    (:func:`fused_ops_enabled`) and :func:`gemv_folds` allows it; else ``None`` (the
    transform runs as its own kernel)."""
    if not fused_ops_enabled(device, dtype) or fold not in gemv_folds():
        return None
    return GemvFold()


#: programs per SM up to which a gate-up projection's launch takes SwiGLU in its
#: epilogue (:func:`glu_epilogue`): one wave, one program per SM
GLU_MAX_PROGRAMS_PER_SM = 1


def glu_epilogue(device: torch.device | str, dtype: torch.dtype, out_features: int) -> bool:
    """Whether a dense gate-up projection with ``out_features`` outputs (``2 I``) on
    ``device``/``dtype`` stores SwiGLU's ``silu(gate) * up`` from its weight-streaming
    kernel's epilogue for decode-sized inputs (``glu_out`` of
    :func:`lmkit_kernels.gemv.small_m_linear` and of the norm fold): one kernel and one
    activation tensor fewer per layer, the same bits as the separate SiLU-and-multiply
    kernel. On with the fused kernels (:func:`fused_ops_enabled`) unless
    ``LMKIT_GLU_EPILOGUE=0``, for launches of at most :data:`GLU_MAX_PROGRAMS_PER_SM`
    programs per SM: each program's epilogue moves its tile through shared memory, a
    cost paid once per wave, against a launch saved once per layer. Measured on an H200
    (``bench/decode_chain.py``, batch-1 decode steps of 28 layers, interleaved rounds,
    with / without): SmolLM2-135M (96 programs on 132 SMs) 0.614 / 0.649 ms,
    Qwen3-0.6B (192) 0.965 / 0.955 ms, Llama-3.1-8B (896) 3.902 / 3.826 ms."""
    if not fused_ops_enabled(device, dtype) or switched_off(GLU_EPILOGUE_ENV):
        return False
    sms = _sm_count(torch.device(device))
    programs = -(-out_features // narrow_tiles(out_features)["block_n"])
    return sms is None or programs <= GLU_MAX_PROGRAMS_PER_SM * sms


def _sm_count(device: torch.device) -> int | None:
    """The SMs of a CUDA ``device``; ``None`` elsewhere (Triton's interpreter)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def glu_small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                       ) -> torch.Tensor:
    """``silu(gate) * up`` of ``x @ weight.T + bias`` (``weight`` ``[gate | up]``) at
    :func:`narrow_tiles` (the tiles :func:`linear_kernel` runs the projections that
    :func:`glu_epilogue` takes, fewer than :data:`WIDE_TILES_MIN_OUT` outputs: the same
    sums)."""
    from lmkit_kernels.gemv import small_m_linear

    return small_m_linear(x, weight, bias, glu_out=True, **narrow_tiles(weight.shape[0]))


def gemv_folds() -> frozenset[str]:
    """The folds ``LMKIT_GEMV_FOLD`` allows: :data:`DEFAULT_GEMV_FOLDS` (unset), all of
    :data:`GEMV_FOLDS` (``1``), none (``0``), or a comma-separated subset (``norm``,
    ``silu_mul``).

    :raises ValueError: on any other value."""
    raw = os.environ.get(GEMV_FOLD_ENV, "").strip().lower()
    if raw == "":
        return frozenset(DEFAULT_GEMV_FOLDS)
    if raw in ("1", "true", "yes", "on"):
        return frozenset(GEMV_FOLDS)
    if switched_off(GEMV_FOLD_ENV):
        return frozenset()
    folds = {part.strip() for part in raw.split(",") if part.strip()}
    unknown = sorted(folds - set(GEMV_FOLDS))
    if unknown:
        raise ValueError(f"{GEMV_FOLD_ENV}={raw!r}: unknown fold {', '.join(unknown)}; expected "
                         f"1 (all), 0 (none) or a comma-separated subset of "
                         f"{', '.join(GEMV_FOLDS)}; unset it or fix it")
    return frozenset(folds)

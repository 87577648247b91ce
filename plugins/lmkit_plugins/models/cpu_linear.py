"""How float32/bfloat16 projections run on the CPU: lmkit's C row-GEMV for float32
decode batches (at most 32 rows; :mod:`lmkit_kernels.cpu.row_gemv`), else oneDNN's
linear kernel (the one torch.compile's CPU backend emits) rather than ``F.linear``'s
MKL GEMM, and the weight layout each wants (:func:`cpu_weight_row_length`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

LinearFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


try:  # the overload itself: calling it skips the op packet's Python dispatch
    _linear_pointwise = torch.ops.mkldnn._linear_pointwise.default
    _linear_binary = torch.ops.mkldnn._linear_pointwise.binary
except (AttributeError, RuntimeError):  # a torch built without oneDNN
    _linear_pointwise = _linear_binary = None


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                   ) -> torch.Tensor:
    if _linear_pointwise is None:
        raise NotImplementedError("this torch build has no oneDNN linear kernel")
    return _linear_pointwise(x, weight, bias, "none", [], "")


@functools.cache
def _onednn_works(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN's linear kernel, and its residual-add post-op
    (:meth:`~lmkit_plugins.models.layers.Linear.forward_add`), run in ``dtype`` on this
    CPU and compute the right thing. oneDNN's bfloat16 kernels need AVX-512 (BW, VL,
    DQ) or AVX-NE-CONVERT: on an AVX2-only CPU (seen: an AMD EPYC without AVX-512)
    they raise, and bfloat16 projections run ``F.linear`` instead."""
    x, w, b = (torch.ones(*shape, dtype=dtype) for shape in ((2, 3), (4, 3), (4,)))
    try:
        out = _onednn_linear(x, w, b)
        added = _linear_binary(x, out, w, b, "add") if _linear_binary is not None else out
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return bool(torch.equal(out.float(), torch.full((2, 4), 4.0))
                and torch.equal(added.float(), torch.full((2, 4), 8.0)))


def cpu_linear_kernel(device: torch.device | str, dtype: torch.dtype) -> LinearFn:
    """The ``(x, weight [out, in], bias) -> x @ weight.T + bias`` to use on ``device``.

    On the CPU: for float32, when the C row-GEMV kernel builds on this machine, that
    kernel for inputs of up to :data:`lmkit_kernels.cpu.row_gemv.MAX_ROWS` rows and
    oneDNN for larger ones (:func:`_row_gemv_or_onednn`); otherwise oneDNN for
    float32/bfloat16 when this torch build has it and it runs that dtype on this CPU
    (:func:`_onednn_works`). Else ``F.linear`` (CUDA, float16, a torch without oneDNN,
    or bfloat16 on a CPU without AVX-512).
    """
    if (torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and _onednn_works(dtype)):
        if dtype == torch.float32 and _row_gemv() is not None:
            return _row_gemv_or_onednn
        return _onednn_linear
    return F.linear


_ROW_GEMV_MAX_ROWS = 32  # lmkit_kernels.cpu.row_gemv.MAX_ROWS (decode batches)


@functools.cache
def _row_gemv() -> LinearFn | None:
    from lmkit_kernels.cpu.row_gemv import MAX_ROWS, unchecked_row_gemv

    assert MAX_ROWS >= _ROW_GEMV_MAX_ROWS
    return unchecked_row_gemv()


def _row_gemv_or_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                        ) -> torch.Tensor:
    """Float32 on the CPU over a contiguous ``[out, in]`` weight: the C row-GEMV kernel
    for decode-sized inputs, oneDNN for the rest (prefill, large batches)."""
    if x.dim() == 2 and x.shape[0] <= _ROW_GEMV_MAX_ROWS:
        return _row_gemv()(x, weight, bias)  # type: ignore[misc]
    return _onednn_linear(x, weight, bias)


def cpu_weight_row_length(kernel: LinearFn, dtype: torch.dtype, out_features: int
                          ) -> int | None:
    """How a projection run by ``kernel`` stores its ``[out, in]`` weight: ``None`` for
    contiguous ``[out, in]`` memory, else the row length ``r >= out_features`` of
    ``[in, r]`` memory that the weight is a transposed view of. Only plain oneDNN
    float32 projections get the transposed layout; with the C row-GEMV kernel
    (:func:`cpu_linear_kernel`) weights stay contiguous ``[out, in]``, the layout it
    streams.

    oneDNN chooses its implementation from the weight's memory layout. With ``[in,
    out]`` memory a float32 projection runs oneDNN's AVX-512 matmul (``[out, in]`` gets
    an AVX2 one for single rows): on the CPUs measured that reads weights 10-20% faster
    for one-row inputs (decode at batch 1) and 20-35% faster for batches of 2-32, about
    even at 512 rows; and for more than one row the result is bit-identical to the
    ``[out, in]`` layout's. Rows whose length is a multiple of 512 floats (2 KiB apart)
    alias in the cache and run up to twice as slow, so such outputs (e.g. a gate-up
    projection of 2 x 1536) get 32 zero columns of padding: the kernel computes them
    and :meth:`Linear.forward` returns the other columns. Float32 only: bfloat16 keeps
    the layout its HF-exactness tests were run with.
    """
    if kernel is not _onednn_linear or dtype != torch.float32:
        return None
    return out_features + _ROW_PADDING if out_features % 512 == 0 else out_features


_ROW_PADDING = 32  # zero output columns that keep [in, out] rows off 2 KiB multiples

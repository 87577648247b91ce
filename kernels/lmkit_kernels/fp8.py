"""FP8 (e4m3) weights with one float32 scale per output channel: quantizing them, the
large-batch product through ``torch._scaled_mm``, and the torch references.

A weight ``W [N, K]`` is kept as ``q = e4m3(W / s)`` with ``s[n] = max|W[n, :]| / 448``
(448 is e4m3's largest finite value), so ``W ~ q * s[:, None]`` with a relative error
of at most 2^-4 per value (3 mantissa bits, round to nearest).

Two products, chosen by the number of rows:

* decode batches (at most :data:`lmkit_kernels.gemv.MAX_ROWS` rows): weight-only FP8,
  :func:`lmkit_kernels.gemv.small_m_linear` with ``weight_scale`` (the weight is read
  as FP8, converted to the activations' dtype in the kernel, the float32 accumulator
  scaled per column at the end); reference :func:`fp8_linear_ref`;
* larger batches: W8A8, :func:`scaled_mm_linear`: the activations quantized per token
  to e4m3 (dynamic, ``max|x[m, :]| / 448``; one Triton kernel on CUDA,
  :mod:`lmkit_kernels.fp8_quant`), then ``torch._scaled_mm`` with row-wise scales
  (``scale_a [M, 1]``, ``scale_b [1, N]``, float32, contiguous; the second operand
  column-major, i.e. ``W.t()`` of the row-major ``[N, K]`` weight; bfloat16 output;
  ``K`` and ``N`` multiples of 16; SM 8.9+); reference :func:`scaled_mm_ref`.

Both read only tensor metadata on the host and allocate through torch's caching
allocator: they are safe inside CUDA-graph capture.
"""

from __future__ import annotations

import torch

from lmkit_kernels.checks import check_shape, check_tensor

__all__ = ["E4M3_MAX", "FP8_DTYPE", "MIN_SCALE", "dequantize_fp8", "fp8_linear_ref",
           "quantize_per_block", "quantize_per_channel", "quantize_per_token",
           "quantize_per_token_ref", "scaled_mm_linear",
           "scaled_mm_ref", "scaled_mm_unsupported_reason"]

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
#: the smallest scale: an all-zero row quantizes to zeros instead of dividing by zero
MIN_SCALE = 1e-12
SCALED_MM_ALIGN = 16  # _scaled_mm needs K and N to be multiples of 16


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [N, K] float8_e4m3fn, scale [N] float32)`` of a float ``weight [N, K]``
    (computed in float32 on ``weight``'s device): ``scale[n] = max|W[n, :]| / 448``,
    ``q = round_to_nearest_e4m3(W / scale)``, so that every row's largest value maps
    to 448 (no clipping) and ``q * scale[:, None]`` approximates ``W``."""
    check_tensor("weight", weight, ndim=2)
    w = weight.float()
    scale = w.abs().amax(dim=1).div_(E4M3_MAX).clamp_min_(MIN_SCALE)
    q = (w / scale[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_per_block(weight: torch.Tensor, block: tuple[int, int]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise quantization as fine-grained FP8 checkpoints store it: ``(q [N, K]
    e4m3, scale [ceil(N / bn), ceil(K / bk)] float32)`` with one ``max|W| / 448`` per
    ``bn x bk`` block (the last blocks may be partial); ``W ~ q * scale`` expanded."""
    check_tensor("weight", weight, ndim=2)
    n, k = weight.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = weight.float().new_zeros(nb * bn, kb * bk)
    padded[:n, :k] = weight.float()
    tiles = padded.view(nb, bn, kb, bk)
    scale = tiles.abs().amax(dim=(1, 3)).div_(E4M3_MAX).clamp_min_(MIN_SCALE)  # [nb, kb]
    q = (tiles / scale[:, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return q.view(nb * bn, kb * bk)[:n, :k].contiguous(), scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token activation quantization: ``(xq [M, K] e4m3, scale [M, 1]
    float32)`` with ``scale[m] = max|x[m, :]| / 448`` (each row's own range; no host
    synchronisation): on CUDA one Triton kernel
    (:func:`lmkit_kernels.fp8_quant.quantize_per_token_triton`), elsewhere
    :func:`quantize_per_token_ref`."""
    if x.is_cuda:
        from lmkit_kernels.fp8_quant import quantize_per_token_triton

        return quantize_per_token_triton(x, max_value=E4M3_MAX, min_scale=MIN_SCALE)
    return quantize_per_token_ref(x)


def quantize_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of :func:`quantize_per_token`."""
    # one float32 temporary (a prefill of 16k rows into down_proj: 0.9 GB), used in place
    # divided by a tensor: CUDA divides by a Python scalar as a product with its reciprocal,
    # which differs from the kernel's IEEE division in the last bit
    amax = x.abs().amax(dim=1, keepdim=True).float()
    scale = amax.div_(amax.new_tensor(E4M3_MAX)).clamp_min_(MIN_SCALE)
    xf = x.to(torch.float32, copy=True)  # a copy even when x is float32: divided in place
    return xf.div_(scale).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE), scale


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Float32 ``weight [N, K] * scale[:, None]`` (``scale``: ``[N]``)."""
    return weight.float() * scale.float()[:, None]


def scaled_mm_unsupported_reason(weight: torch.Tensor) -> str | None:
    """Why :func:`scaled_mm_linear` cannot run ``weight`` here (``None``: it can): a CPU
    tensor, a GPU older than SM 8.9, a torch without ``_scaled_mm``, or dimensions that
    are not multiples of 16."""
    if weight.device.type != "cuda":
        return f"the weight is on {weight.device}, torch._scaled_mm runs on CUDA"
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    major, minor = torch.cuda.get_device_capability(weight.device)
    if (major, minor) < (8, 9):
        return f"FP8 matmuls need compute capability 8.9 or newer (this GPU: {major}.{minor})"
    n, k = weight.shape
    if n % SCALED_MM_ALIGN or k % SCALED_MM_ALIGN:
        return f"weight [{n}, {k}]: torch._scaled_mm needs both sizes to be multiples of 16"
    return None


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, scale_row: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (weight * scale).T + bias`` with the activations quantized per token to
    e4m3 (W8A8), through ``torch._scaled_mm`` with row-wise scales.

    :param x: ``[M, K]`` float16 or bfloat16, unit last stride.
    :param weight: ``[N, K]`` float8_e4m3fn, contiguous (its ``.t()`` is the column-major
        second operand ``_scaled_mm`` wants).
    :param scale_row: ``[1, N]`` float32, contiguous: the per-channel weight scales.
    :param bias: optional ``[N]`` in ``x``'s dtype (added after the product).
    :return: ``[M, N]`` in ``x``'s dtype (float32 accumulation, bfloat16 result).
    """
    check_tensor("x", x, ndim=2, dtypes=(torch.float16, torch.bfloat16),
                 last_dim_contiguous=True)
    check_tensor("weight", weight, ndim=2, dtypes=(FP8_DTYPE,), device=x.device,
                 contiguous=True)
    check_shape("weight", weight, (None, x.shape[1]))
    check_tensor("scale_row", scale_row, ndim=2, dtypes=(torch.float32,), device=x.device,
                 contiguous=True)
    check_shape("scale_row", scale_row, (1, weight.shape[0]))
    xq, x_scale = quantize_per_token(x)
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale_row,
                           out_dtype=torch.bfloat16)
    if isinstance(out, tuple):  # torch < 2.4 returned (out, amax)
        out = out[0]
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    return out if bias is None else out.add_(bias)


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference of the weight-only product (:func:`lmkit_kernels.gemv.small_m_linear`
    with ``weight_scale``): ``x @ dequantize(weight, scale).T + bias`` in float32,
    returned in ``x``'s dtype."""
    out = x.float() @ weight.float().T * scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def scaled_mm_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference of :func:`scaled_mm_linear` (``scale``: ``[N]``): the same per-token
    activation quantization, then float32 products of the e4m3 values, both scales,
    rounded through bfloat16 as ``_scaled_mm``'s output is."""
    xq, x_scale = quantize_per_token_ref(x)
    out = (xq.float() @ weight.float().T) * x_scale * scale.float()[None, :]
    out = out.to(torch.bfloat16).to(x.dtype)
    return out if bias is None else out + bias.to(x.dtype)

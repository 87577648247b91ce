"""Dynamic per-token FP8 quantization of activations in one kernel: the first step of
the W8A8 product (:func:`lmkit_kernels.fp8.scaled_mm_linear`).

One program per row reads the row twice (its absolute maximum, then the quantized
values) and writes the e4m3 row and its float32 scale: one launch instead of the five
of the torch reference (:func:`lmkit_kernels.fp8.quantize_per_token_ref`), whose
results it reproduces (IEEE division, round-to-nearest conversion).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmkit_kernels.checks import check_tensor, next_power_of_2

__all__ = ["quantize_per_token_triton"]

MAX_BLOCK_K = 2048


@triton.jit
def _quantize_per_token_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm,
    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # program m: q[m, :] = e4m3(x[m, :] / s[m]), s[m] = max(max|x[m, :]| / FP8_MAX, MIN_SCALE)
    row = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * stride_xm
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_row + k + ks, mask=(k + ks) < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.div_rn(tl.max(amax, axis=0), FP8_MAX), MIN_SCALE)
    tl.store(s_ptr + row, scale)
    q_row = q_ptr + row * stride_qm
    for k in range(0, K, BLOCK_K):
        mask = (k + ks) < K
        x = tl.load(x_row + k + ks, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -FP8_MAX), FP8_MAX)
        tl.store(q_row + k + ks, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_per_token_triton(x: torch.Tensor, *, max_value: float, min_scale: float
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xq [M, K] float8_e4m3fn, scale [M, 1] float32)`` of ``x [M, K]`` (float16,
    bfloat16 or float32, unit last stride): per row ``scale = max(max|x| / max_value,
    min_scale)`` and ``xq = e4m3(clamp(x / scale, +-max_value))``.

    :raises ValueError: on a shape, dtype or stride mismatch.
    """
    check_tensor("x", x, ndim=2, dtypes=(torch.float16, torch.bfloat16, torch.float32),
                 last_dim_contiguous=True)
    m, k = x.shape
    xq = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m and k:
        _quantize_per_token_kernel[(m,)](
            x, xq, scale, k, x.stride(0), xq.stride(0), FP8_MAX=max_value,
            MIN_SCALE=min_scale, BLOCK_K=min(MAX_BLOCK_K, max(16, next_power_of_2(k))),
            num_warps=4)
    return xq, scale

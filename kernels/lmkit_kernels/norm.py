"""RMSNorm, optionally fused with the residual add that precedes it (one pass).

Decoder layers normalise ``x + residual`` and carry the sum on as the new residual
stream; done with separate torch ops that is five or six kernels per norm (upcast,
square, mean, rsqrt, scale, add), each a launch and a pass over the activations. This
kernel reads ``x`` (and ``residual``) once and writes the normed rows (and the sum).

Rounding follows Hugging Face's half-precision RMSNorm: the residual sum is rounded to
the input dtype, normalised in float32, rounded again, then scaled by the weight (and
rounded). The mean square is the sum times ``1 / hidden_size`` rounded to float32, as
torch's ``mean`` computes it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmkit_kernels.checks import FLOAT_DTYPES, check_shape, check_tensor, next_power_of_2
from lmkit_kernels.pdl import pdl_launch_args, pdl_wait

__all__ = ["rms_norm", "rms_norm_ref"]


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_res, stride_out, stride_res_out,
    hidden_size, inv_hidden_size, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    # One program normalises one row: [hidden_size].
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) * inv_hidden_size
    normed = (xf * tl.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * normalize(x)``, or with ``residual``: ``(weight * normalize(x + residual),
    x + residual)``.

    :param x: ``[num_tokens, hidden]`` (float32, float16 or bfloat16; rows may be
        strided, the last dimension must have unit stride).
    :param weight: ``[hidden]``, same dtype as ``x``.
    :param eps: added to the mean square before the reciprocal square root.
    :param residual: optional ``[num_tokens, hidden]`` in ``x``'s dtype, added first.
    :return: new tensors; ``x`` and ``residual`` are not modified.
    :raises ValueError: on a shape, dtype, device or stride mismatch.
    """
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    num_tokens, hidden = x.shape
    check_tensor("weight", weight, ndim=1, dtypes=(x.dtype,), device=x.device, contiguous=True)
    check_shape("weight", weight, (hidden,))
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    res_out = out
    if residual is not None:
        check_tensor("residual", residual, ndim=2, dtypes=(x.dtype,), device=x.device,
                     last_dim_contiguous=True)
        check_shape("residual", residual, (num_tokens, hidden))
        res_out = torch.empty_like(out)
    if num_tokens:
        block = max(16, next_power_of_2(hidden))
        _rms_norm_kernel[(num_tokens,)](
            x, residual if residual is not None else x, weight, out, res_out,
            x.stride(0), (residual if residual is not None else x).stride(0), out.stride(0),
            res_out.stride(0), hidden, 1.0 / hidden, float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=4 if block <= 2048 else 8,
            enable_fp_fusion=False,  # round where torch rounds (no FMA contraction)
            **pdl_launch_args(x.device),
        )
    return out if residual is None else (out, res_out)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of :func:`rms_norm` (Hugging Face's formula and rounding)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = weight * normed
    return out if residual is None else (out, x)

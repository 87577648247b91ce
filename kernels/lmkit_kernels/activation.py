"""SwiGLU's ``silu(gate) * up`` over a fused gate-up projection, in one kernel.

With torch ops this is a chunk, a SiLU and a multiply (two kernels, three passes);
here each program reads a tile of ``gate`` and ``up`` and writes the product once.
Rounding follows torch's half-precision ops (and so Hugging Face's MLP): SiLU
computed in float32 as ``x / (1 + exp(-x))`` with an accurate ``exp`` and an IEEE
division (torch's CUDA formula; Triton's default ``exp`` and ``/`` are approximate),
rounded to the dtype, then the product rounded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from lmkit_kernels.checks import FLOAT_DTYPES, check_tensor, is_interpreting
from lmkit_kernels.pdl import pdl_launch_args, pdl_wait

__all__ = ["silu_and_mul", "silu_and_mul_ref"]

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, size, BLOCK: tl.constexpr,
                         ACCURATE_EXP: tl.constexpr, USE_PDL: tl.constexpr = False):
    # program (row, tile): out[row, tile] = silu(x[row, tile]) * x[row, size + tile]
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + size + cols, mask=mask, other=0.0)
    if ACCURATE_EXP:  # libdevice expf, as torch's CUDA kernel (tl.exp is ex2.approx)
        e = libdevice.exp(-gate)
    else:  # the CPU interpreter: numpy's exp
        e = tl.exp(-gate)
    act = tl.math.div_rn(gate, 1.0 + e).to(x_ptr.dtype.element_ty)
    y = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[:, :d]) * gate_up[:, d:]`` for ``gate_up: [num_tokens, 2 * d]``.

    :param gate_up: float32, float16 or bfloat16; the last dimension must have unit
        stride and an even size.
    :return: a new ``[num_tokens, d]`` tensor in ``gate_up``'s dtype.
    :raises ValueError: on a shape, dtype or stride mismatch.
    """
    check_tensor("gate_up", gate_up, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    num_tokens, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up must have an even last dimension (gate, then up); got {width}")
    size = width // 2
    out = torch.empty((num_tokens, size), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens and size:
        grid = (num_tokens, triton.cdiv(size, _BLOCK))
        _silu_and_mul_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), size,
                                   BLOCK=_BLOCK, ACCURATE_EXP=not is_interpreting(),
                                   num_warps=4, enable_fp_fusion=False,
                                   **pdl_launch_args(gate_up.device))
    return out


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """The torch reference of :func:`silu_and_mul`."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up

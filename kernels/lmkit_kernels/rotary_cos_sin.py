"""A step's RoPE ``cos`` / ``sin`` rows in one kernel.

The rotary embedding turns a step's positions into ``cos = [c, c]`` and ``sin = [-s, s]``
(``c, s = cos, sin(position * inv_freq)``, "rotate half" layout), shared by every layer.
In torch that is about nine small kernels per step (a cast, a product, ``cos``, ``sin``,
a negation, two concatenations, two casts), each a launch and a drain between the
decode step's other kernels; here it is one, launched with programmatic dependent
launch. The same float32 product and the same ``cosf`` / ``sinf`` (libdevice, as torch's
CUDA kernels) give the same bits as the torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from lmkit_kernels.checks import check_tensor, is_interpreting, next_power_of_2
from lmkit_kernels.pdl import pdl_launch_args, pdl_wait

__all__ = ["rotary_cos_sin", "rotary_cos_sin_ref"]


# positions may be a view at any offset, like slot mappings (lmkit_kernels.cache_write)
@triton.jit(do_not_specialize_on_alignment=["pos_ptr"])
def _cos_sin_kernel(pos_ptr, inv_freq_ptr, cos_ptr, sin_ptr, HALF: tl.constexpr,
                    HALF_PAD: tl.constexpr, ACCURATE: tl.constexpr,
                    USE_PDL: tl.constexpr = False):
    # program t: row t of cos and sin, [2 * HALF] each
    tok = tl.program_id(0).to(tl.int64)
    pdl_wait(USE_PDL)
    d = tl.arange(0, HALF_PAD)
    ok = d < HALF
    freqs = tl.load(pos_ptr + tok).to(tl.float32) * tl.load(inv_freq_ptr + d, mask=ok,
                                                              other=0.0)
    if ACCURATE:  # libdevice cosf / sinf, as torch's CUDA kernels
        c = libdevice.cos(freqs)
        s = libdevice.sin(freqs)
    else:  # the CPU interpreter: numpy's
        c = tl.cos(freqs)
        s = tl.sin(freqs)
    row = tok * (2 * HALF)
    c = c.to(cos_ptr.dtype.element_ty)
    tl.store(cos_ptr + row + d, c, mask=ok)
    tl.store(cos_ptr + row + HALF + d, c, mask=ok)
    tl.store(sin_ptr + row + d, (-s).to(sin_ptr.dtype.element_ty), mask=ok)
    tl.store(sin_ptr + row + HALF + d, s.to(sin_ptr.dtype.element_ty), mask=ok)


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[n, 1, 2 * len(inv_freq)]`` in ``dtype``, for ``positions``.

    :param positions: integer ``[n]`` (int32 or int64), on the GPU.
    :param inv_freq: float32 ``[rotary_dim // 2]``, contiguous, same device.
    :param dtype: float32, float16 or bfloat16.
    :return: new tensors: ``cos = [c, c]``, ``sin = [-s, s]`` per row, with ``c, s`` the
        cosine and sine of ``position * inv_freq`` computed in float32, then rounded.
    :raises ValueError: on a shape, dtype or device mismatch.
    """
    check_tensor("positions", positions, ndim=1, dtypes=(torch.int32, torch.int64),
                 contiguous=True)
    check_tensor("inv_freq", inv_freq, ndim=1, dtypes=(torch.float32,),
                 device=positions.device, contiguous=True)
    n, half = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty((n, 1, 2 * half), dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    if n and half:
        _cos_sin_kernel[(n,)](positions, inv_freq, cos, sin, HALF=half,
                              HALF_PAD=next_power_of_2(half), ACCURATE=not is_interpreting(),
                              num_warps=1, **pdl_launch_args(positions.device))
    return cos, sin


def rotary_cos_sin_ref(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch ops :func:`rotary_cos_sin` replaces."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    cos = torch.cat((cos, cos), dim=-1).to(dtype)[:, None, :]
    sin = torch.cat((-sin, sin), dim=-1).to(dtype)[:, None, :]
    return cos, sin

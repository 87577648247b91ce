"""Write new tokens' keys and values into the paged KV cache through ``slot_mapping``.

Cache layout (shared by every lmkit attention backend, so they are interchangeable)::

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_size]
              (index 0 holds keys, index 1 values)

Token ``t`` goes to slot ``slot_mapping[t] = block_id * block_size + offset``, i.e.
``kv_cache[:, block_id, offset]``. A negative slot marks a padding token (a CUDA-graph
batch padded to a captured size) and is skipped. An FP8 cache (``torch.float8_e4m3fn``)
stores ``key / k_scale`` and ``value / v_scale``, saturated to
+-:data:`lmkit_kernels.fp8.E4M3_MAX` (448).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmkit_kernels.checks import (
    FLOAT_DTYPES,
    check_shape,
    check_slot_mapping,
    check_tensor,
    is_interpreting,
    next_power_of_2,
)
from lmkit_kernels.pdl import pdl_launch_args, pdl_wait

__all__ = ["reshape_and_cache"]


@triton.jit
def round_to_e4m3(x):
    """``x`` (float32, within +-448) rounded to the nearest float8 e4m3 value, ties to
    even, as float32: spelled out for Triton's CPU interpreter, whose float8 conversion
    drops the carry when rounding up crosses a power of two (-31.7 became -16). On the
    GPU the hardware conversion rounds the same way and this is not used."""
    a = tl.abs(x)
    exp = tl.maximum(tl.floor(tl.log2(tl.maximum(a, 1e-30))), -6.0)  # subnormals: 2^-9 steps
    step = tl.exp2(exp - 3.0)  # three mantissa bits
    t = a / step
    low = tl.floor(t)
    frac = t - low
    odd = (low - 2.0 * tl.floor(low * 0.5)) == 1.0
    r = tl.where((frac > 0.5) | ((frac == 0.5) & odd), low + 1.0, low) * step
    return tl.where(r == 0.0, x * 0.0, tl.where(x < 0, -r, r))  # (keeps the sign of zero)


# The slot mapping may be a view at any 8-byte offset (the spec path's steps slice it);
# specialising on its 16-byte alignment would compile a second variant, about a second
# in the middle of serving (seen: the first EAGLE-3 request on an H200). One slot is
# read per program, so the alignment buys nothing.
@triton.jit(do_not_specialize_on_alignment=["slot_mapping_ptr"])
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, inv_k_scale, inv_v_scale,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr, USE_PDL: tl.constexpr = False,
    QUANT: tl.constexpr = False, EXACT_ROUND: tl.constexpr = False,
):
    # One program copies HEADS_PER_PROGRAM heads of one token: [heads, head_size].
    pdl_wait(USE_PDL)
    tok = tl.program_id(0)
    head_start = tl.program_id(1) * HEADS_PER_PROGRAM
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        heads = head_start + tl.arange(0, HEADS_PER_PROGRAM)
        dims = tl.arange(0, HEAD_PAD)
        mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_SIZE)
        k = tl.load(k_ptr + tok * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :],
                    mask=mask)
        v = tl.load(v_ptr + tok * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :],
                    mask=mask)
        kc = (k_cache_ptr + block * stride_kc_block + offset * stride_kc_slot
              + heads[:, None] * stride_kc_head + dims[None, :])
        vc = (v_cache_ptr + block * stride_vc_block + offset * stride_vc_slot
              + heads[:, None] * stride_vc_head + dims[None, :])
        if QUANT:  # an FP8 cache: scaled, saturated to e4m3's range, rounded to nearest
            k = tl.minimum(tl.maximum(k.to(tl.float32) * inv_k_scale, -448.0), 448.0)
            v = tl.minimum(tl.maximum(v.to(tl.float32) * inv_v_scale, -448.0), 448.0)
            if EXACT_ROUND:
                k = round_to_e4m3(k)
                v = round_to_e4m3(v)
        tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> None:
    """Store ``key`` and ``value`` rows in ``kv_cache`` at ``slot_mapping`` (in place).

    :param key: ``[num_tokens_padded, num_kv_heads, head_size]``; rows may be strided
        (a view into a fused QKV output), the last dimension must have unit stride.
    :param value: same shape as ``key``.
    :param kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_size]``, same dtype
        as ``key`` (float32, float16 or bfloat16) or ``torch.float8_e4m3fn`` (an FP8
        cache: ``key / k_scale`` and ``value / v_scale`` are stored, saturated to
        +-448); keys in ``[0]``, values in ``[1]``.
    :param slot_mapping: int64 (or int32) ``[num_tokens]`` with ``num_tokens <=
        num_tokens_padded``; only the first ``num_tokens`` rows are written, and a
        negative slot skips its row.
    :raises ValueError: on a shape, dtype, device or stride mismatch.
    """
    quant = kv_cache.dtype == torch.float8_e4m3fn
    check_tensor("kv_cache", kv_cache, ndim=5, dtypes=(*FLOAT_DTYPES, torch.float8_e4m3fn),
                 last_dim_contiguous=True)
    device = kv_cache.device
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    if kv_cache.shape[0] != 2:
        raise ValueError("kv_cache must have shape [2, num_blocks, block_size, num_kv_heads, "
                         f"head_size] (keys, values); got {list(kv_cache.shape)}")
    for name, t in (("key", key), ("value", value)):
        check_tensor(name, t, ndim=3, dtypes=FLOAT_DTYPES if quant else (kv_cache.dtype,),
                     device=device, last_dim_contiguous=True)
        check_shape(name, t, (None, num_kv_heads, head_size))
    num_tokens = check_slot_mapping(slot_mapping, device, key=key, value=value)
    if num_tokens == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    head_pad = next_power_of_2(head_size)
    # About 4K elements per program: all heads of a token for usual models.
    heads_per_program = min(next_power_of_2(num_kv_heads), max(1, 4096 // head_pad))
    grid = (num_tokens, triton.cdiv(num_kv_heads, heads_per_program))
    _reshape_and_cache_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping, 1.0 / k_scale, 1.0 / v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size, HEADS_PER_PROGRAM=heads_per_program, QUANT=quant,
        EXACT_ROUND=quant and is_interpreting(),
        num_warps=4, **pdl_launch_args(device),
    )

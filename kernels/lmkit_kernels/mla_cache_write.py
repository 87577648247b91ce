"""Write new tokens' latent entries into the MLA cache through ``slot_mapping``.

Cache layout (``lmkit.api.mla_attention``)::

    kv_cache: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]   # c_kv | k_pe

Token ``t`` goes to ``kv_cache[slot // block_size, slot % block_size]``; a negative slot
(CUDA-graph padding) is skipped. Torch reference:
:func:`lmkit_kernels.mla_ref.mla_cache_write_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmkit_kernels.checks import FLOAT_DTYPES, check_slot_mapping, check_tensor, next_power_of_2

__all__ = ["mla_cache_write"]


# (slot mapping views at any offset: see lmkit_kernels.cache_write)
@triton.jit(do_not_specialize_on_alignment=["slot_mapping_ptr"])
def _mla_cache_write_kernel(
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_mapping_ptr,
    stride_c_tok, stride_p_tok, stride_cache_block, stride_cache_slot,
    RANK: tl.constexpr, RANK_PAD: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # one program copies one token's entry: [RANK] then [ROPE]
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot >= 0:
        dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cache_block \
            + (slot % BLOCK_SIZE) * stride_cache_slot
        offs_r = tl.arange(0, RANK_PAD)
        c = tl.load(kv_c_ptr + tok * stride_c_tok + offs_r, mask=offs_r < RANK)
        tl.store(dst + offs_r, c.to(cache_ptr.dtype.element_ty), mask=offs_r < RANK)
        offs_p = tl.arange(0, ROPE_PAD)
        p = tl.load(k_pe_ptr + tok * stride_p_tok + offs_p, mask=offs_p < ROPE)
        tl.store(dst + RANK + offs_p, p.to(cache_ptr.dtype.element_ty), mask=offs_p < ROPE)


def mla_cache_write(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Store ``[kv_c | k_pe]`` rows in ``kv_cache`` at ``slot_mapping`` (in place).

    :param kv_c: ``[num_tokens_padded, kv_lora_rank]``; rows may be strided (a view of
        the ``kv_a_proj`` output), the last dimension must have unit stride.
    :param k_pe: ``[num_tokens_padded, qk_rope_head_dim]``, likewise.
    :param kv_cache: ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``, the
        dtype of ``kv_c`` (float32, float16 or bfloat16).
    :param slot_mapping: int64 (or int32) ``[num_tokens]``, ``num_tokens <=
        num_tokens_padded``; a negative slot skips its row.
    :raises ValueError: on a shape, dtype, device or stride mismatch.
    """
    check_tensor("kv_cache", kv_cache, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    device = kv_cache.device
    check_tensor("kv_c", kv_c, ndim=2, dtypes=(kv_cache.dtype,), device=device,
                 last_dim_contiguous=True)
    check_tensor("k_pe", k_pe, ndim=2, dtypes=(kv_cache.dtype,), device=device,
                 last_dim_contiguous=True)
    rank, rope = kv_c.shape[1], k_pe.shape[1]
    if rank + rope != kv_cache.shape[2]:
        raise ValueError(f"kv_c ({rank} wide) and k_pe ({rope} wide) must fill the cache "
                         f"entry of {kv_cache.shape[2]}: kv_cache is [num_blocks, block_size, "
                         "kv_lora_rank + qk_rope_head_dim]")
    num_tokens = check_slot_mapping(slot_mapping, device, kv_c=kv_c, k_pe=k_pe)
    if num_tokens == 0:
        return
    _mla_cache_write_kernel[(num_tokens,)](
        kv_c, k_pe, kv_cache, slot_mapping, kv_c.stride(0), k_pe.stride(0),
        kv_cache.stride(0), kv_cache.stride(1),
        RANK=rank, RANK_PAD=next_power_of_2(rank), ROPE=rope, ROPE_PAD=next_power_of_2(rope),
        BLOCK_SIZE=kv_cache.shape[1], num_warps=4,
    )

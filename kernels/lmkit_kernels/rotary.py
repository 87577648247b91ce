"""Rotary position embedding (and optional per-head q/k RMSNorm) applied in place to
the query and key heads of a fused QKV projection output, optionally writing the
rotated keys and the values into the paged KV cache in the same pass.

A Llama-family attention layer projects to ``qkv: [num_tokens, (num_heads + 2 *
num_kv_heads) * head_size]`` and rotates its query and key heads ("rotate half",
GPT-NeoX layout); Qwen3 first RMS-normalises every query and key head. In torch that
is about ten kernels per layer; here it is one, rewriting the first ``num_heads +
num_kv_heads`` heads of each row in place, so the attention backend reads ``q`` and
``k`` as strided views of ``qkv`` with no copy. Given ``kv_cache`` and
``slot_mapping`` the same kernel also stores every token's (rotated) key and value
heads at its slot, replacing the attention backend's separate cache-write kernel.

``cos`` and ``sin`` come from the model's rotary embedding (computed once per step,
shared by all layers), ``sin`` carrying rotate-half's sign: ``[-sin, sin]``.

Rounding follows Hugging Face's half-precision modules exactly: the q/k norm
normalises in float32, rounds, then multiplies by the weight and rounds (LlamaRMSNorm);
RoPE is ``(x * cos) + (rotate_half(x) * sin)`` with both products and the sum each
rounded to the input dtype (three half-precision torch ops in transformers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmkit_kernels.checks import FLOAT_DTYPES, check_shape, check_tensor, next_power_of_2
from lmkit_kernels.pdl import pdl_launch_args, pdl_wait

__all__ = ["rotary_qk_", "rotary_qk_ref"]

_HEADS_PER_PROGRAM = 8


# (slot mapping views at any offset: see lmkit_kernels.cache_write)
@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _rotary_qk_kernel(
    qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, cache_ptr, slot_ptr,
    stride_tok, stride_cos, stride_sin, eps, inv_head_size, num_slots,
    stride_c_kv, stride_c_block, stride_c_slot, stride_c_head,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr, ROT: tl.constexpr, HEADS: tl.constexpr, HAS_NORM: tl.constexpr,
    WRITE_CACHE: tl.constexpr, PAGE_SIZE: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    # program (token, head group): HEADS heads of one token, [HEADS, HEAD_PAD]; heads
    # count query, key, then (when writing the cache) value heads
    pdl_wait(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    dims = tl.arange(0, HEAD_PAD)
    half: tl.constexpr = ROT // 2
    partner = tl.where(dims < half, dims + half, dims - half)
    rotated = dims < ROT
    partner = tl.where(rotated, partner, dims)
    QK_HEADS: tl.constexpr = NUM_Q_HEADS + NUM_KV_HEADS
    ALL_HEADS: tl.constexpr = QK_HEADS + NUM_KV_HEADS if WRITE_CACHE else QK_HEADS
    is_qk = heads[:, None] < QK_HEADS
    d_ok = dims[None, :] < HEAD_SIZE
    mask = (heads[:, None] < ALL_HEADS) & d_ok
    base = qkv_ptr + tok * stride_tok + heads[:, None] * HEAD_SIZE
    x = tl.load(base + dims[None, :], mask=mask, other=0.0)
    xp = tl.load(base + partner[None, :], mask=mask & is_qk, other=0.0)
    if HAS_NORM:
        # LlamaRMSNorm per head: float32 normalise, round, weight * x, round
        xf = x.to(tl.float32)
        r = tl.rsqrt(tl.sum(xf * xf, axis=1) * inv_head_size + eps)[:, None]
        is_q = heads[:, None] < NUM_Q_HEADS
        wd = tl.where(is_q, tl.load(qw_ptr + dims, mask=dims < HEAD_SIZE, other=0.0)[None, :],
                      tl.load(kw_ptr + dims, mask=dims < HEAD_SIZE, other=0.0)[None, :])
        wp = tl.where(is_q, tl.load(qw_ptr + partner, mask=dims < HEAD_SIZE, other=0.0)[None, :],
                      tl.load(kw_ptr + partner, mask=dims < HEAD_SIZE, other=0.0)[None, :])
        xn = (xf * r).to(x.dtype)
        xpn = (xp.to(tl.float32) * r).to(x.dtype)
        x = tl.where(is_qk, (wd.to(tl.float32) * xn.to(tl.float32)).to(x.dtype), x)
        xp = (wp.to(tl.float32) * xpn.to(tl.float32)).to(x.dtype)
    cos = tl.load(cos_ptr + tok * stride_cos + dims, mask=rotated, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + tok * stride_sin + dims, mask=rotated, other=0.0).to(tl.float32)
    # transformers: (x * cos) + (rotate_half(x) * sin), each op rounded to x's dtype;
    # unrotated dims (partial rotary) get x * 1 + 0 = x
    a = (x.to(tl.float32) * cos[None, :]).to(x.dtype)
    b = (xp.to(tl.float32) * sin[None, :]).to(x.dtype)
    y = tl.where(is_qk, (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype), x)
    tl.store(base + dims[None, :], y.to(qkv_ptr.dtype.element_ty), mask=mask & is_qk)
    if WRITE_CACHE:
        slot = tl.load(slot_ptr + tok, mask=tok < num_slots, other=-1).to(tl.int64)
        if slot >= 0:  # a negative slot is a padding token
            kv = heads - NUM_Q_HEADS  # key heads 0..NUM_KV_HEADS-1, then value heads
            is_v = kv >= NUM_KV_HEADS
            kv_head = tl.where(is_v, kv - NUM_KV_HEADS, kv)
            dst = (cache_ptr + is_v.to(tl.int64)[:, None] * stride_c_kv
                   + (slot // PAGE_SIZE) * stride_c_block + (slot % PAGE_SIZE) * stride_c_slot
                   + kv_head[:, None] * stride_c_head + dims[None, :])
            tl.store(dst, y.to(cache_ptr.dtype.element_ty), mask=mask & (kv[:, None] >= 0))


def rotary_qk_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, num_heads: int,
               num_kv_heads: int, head_size: int, q_norm: torch.Tensor | None = None,
               k_norm: torch.Tensor | None = None, eps: float = 1e-6,
               kv_cache: torch.Tensor | None = None,
               slot_mapping: torch.Tensor | None = None) -> None:
    """Rotate (after RMS-normalising, when norm weights are given) the query and key
    heads of ``qkv`` in place; the value heads are left alone. With ``kv_cache`` and
    ``slot_mapping``, also store each token's rotated keys and its values in the cache.

    :param qkv: ``[num_tokens, (num_heads + 2 * num_kv_heads) * head_size]`` (float32,
        float16 or bfloat16; rows may be strided, the last dimension must have unit stride).
    :param cos: ``[num_tokens, 1, rotary_dim]`` (or ``[num_tokens, rotary_dim]``), any
        float dtype; ``rotary_dim <= head_size`` and even.
    :param sin: like ``cos``, with rotate-half's sign folded in (``[-sin, sin]``).
    :param q_norm: optional ``[head_size]`` RMSNorm weight of the query heads (Qwen3);
        ``k_norm`` must then be given too.
    :param eps: the q/k norm's epsilon.
    :param kv_cache: optional ``[2, num_blocks, block_size, num_kv_heads, head_size]``
        in ``qkv``'s dtype (keys at index 0, values at 1; the last dimension must have
        unit stride), written at ``slot_mapping``.
    :param slot_mapping: int64 (or int32) ``[n]`` with ``n <= num_tokens``: token ``t <
        n`` goes to slot ``slot_mapping[t] = block * block_size + offset``; a negative
        slot, and every token past ``n`` (CUDA-graph padding), is not written.
    :raises ValueError: on a shape, dtype, device or stride mismatch.
    """
    check_tensor("qkv", qkv, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    num_tokens, width = qkv.shape
    if width != (num_heads + 2 * num_kv_heads) * head_size:
        raise ValueError(f"qkv has {width} columns; (num_heads + 2 * num_kv_heads) * head_size "
                         f"= {(num_heads + 2 * num_kv_heads) * head_size}")
    cos2, sin2 = cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1)
    for name, t in (("cos", cos2), ("sin", sin2)):
        check_tensor(name, t, ndim=2, dtypes=FLOAT_DTYPES, device=qkv.device,
                     last_dim_contiguous=True)
        check_shape(name, t, (num_tokens, cos2.shape[1]))
    rot = cos2.shape[1]
    if rot > head_size or rot % 2:
        raise ValueError(f"rotary_dim {rot} must be even and at most head_size {head_size}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("give both q_norm and k_norm, or neither")
    for name, t in (("q_norm", q_norm), ("k_norm", k_norm)):
        if t is not None:
            check_tensor(name, t, ndim=1, dtypes=(qkv.dtype,), device=qkv.device, contiguous=True)
            check_shape(name, t, (head_size,))
    write_cache = _check_cache(qkv, kv_cache, slot_mapping, num_kv_heads, head_size)
    if not num_tokens:
        return
    heads = num_heads + num_kv_heads * (2 if write_cache else 1)
    per_program = min(_HEADS_PER_PROGRAM, next_power_of_2(heads))
    grid = (num_tokens, triton.cdiv(heads, per_program))
    cache = kv_cache if write_cache else qkv
    slots = slot_mapping if write_cache else qkv
    cache_strides = kv_cache.stride()[:4] if write_cache else (0, 0, 0, 0)
    _rotary_qk_kernel[grid](
        qkv, cos2, sin2, q_norm if q_norm is not None else qkv,
        k_norm if k_norm is not None else qkv, cache, slots,
        qkv.stride(0), cos2.stride(0), sin2.stride(0), float(eps), 1.0 / head_size,
        slot_mapping.shape[0] if write_cache else 0, *cache_strides,
        NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size,
        HEAD_PAD=max(16, next_power_of_2(head_size)), ROT=rot, HEADS=per_program,
        HAS_NORM=q_norm is not None, WRITE_CACHE=write_cache,
        PAGE_SIZE=kv_cache.shape[2] if write_cache else 1, num_warps=4,
        # no mul+add -> FMA contraction: each product is rounded, as in transformers
        enable_fp_fusion=False, **pdl_launch_args(qkv.device),
    )


def _check_cache(qkv: torch.Tensor, kv_cache: torch.Tensor | None,
                 slot_mapping: torch.Tensor | None, num_kv_heads: int, head_size: int) -> bool:
    """Validate the optional cache arguments; True when the cache is to be written."""
    if (kv_cache is None) != (slot_mapping is None):
        raise ValueError("give both kv_cache and slot_mapping (to write the cache), or neither")
    if kv_cache is None:
        return False
    check_tensor("kv_cache", kv_cache, ndim=5, dtypes=(qkv.dtype,), device=qkv.device,
                 last_dim_contiguous=True)
    check_shape("kv_cache", kv_cache, (2, None, None, num_kv_heads, head_size))
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64, torch.int32),
                 device=qkv.device, contiguous=True)
    if slot_mapping.shape[0] > qkv.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries but qkv has only "
                         f"{qkv.shape[0]} rows")
    return True


def rotary_qk_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, num_heads: int,
                  num_kv_heads: int, head_size: int, q_norm: torch.Tensor | None = None,
                  k_norm: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """The torch reference of :func:`rotary_qk_`: returns a rotated copy of ``qkv``,
    rounded where transformers' LlamaRMSNorm and ``apply_rotary_pos_emb`` round.

    (Its cache write is :func:`lmkit_kernels.reference.reshape_and_cache_ref` of the
    returned key and value heads.)
    """
    n, dtype = qkv.shape[0], qkv.dtype
    out = qkv.clone()
    qk = out[:, :(num_heads + num_kv_heads) * head_size].view(n, -1, head_size)
    x = qk.float()
    if q_norm is not None:
        normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype).float()
        w = torch.cat([q_norm.expand(num_heads, head_size),
                       k_norm.expand(num_kv_heads, head_size)]).float()
        x = (w * normed).to(dtype).float()
    rot = cos.shape[-1]
    c = cos.reshape(n, 1, rot).float()
    s = sin.reshape(n, 1, rot).float()
    half = rot // 2
    r = x[..., :rot]
    swapped = torch.cat((r[..., half:], r[..., :half]), dim=-1)
    rotated = (r * c).to(dtype).float() + (swapped * s).to(dtype).float()
    qk.copy_(torch.cat((rotated.to(dtype).float(), x[..., rot:]), dim=-1).to(dtype))
    return out

"""Rotary position embedding (and optional per-head q/k RMSNorm) applied in place to
the query and key heads of a fused QKV projection output.

A Llama-family attention layer projects to ``qkv: [num_tokens, (num_heads + 2 *
num_kv_heads) * head_size]`` and rotates its query and key heads ("rotate half",
GPT-NeoX layout); Qwen3 first RMS-normalises every query and key head. In torch that
is about ten kernels per layer; here it is one, rewriting the first ``num_heads +
num_kv_heads`` heads of each row in place, so the attention backend reads ``q`` and
``k`` as strided views of ``qkv`` with no copy.

``cos`` and ``sin`` come from the model's rotary embedding (computed once per step,
shared by all layers), ``sin`` carrying rotate-half's sign: ``[-sin, sin]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmkit_kernels.checks import FLOAT_DTYPES, check_shape, check_tensor, next_power_of_2

__all__ = ["rotary_qk_", "rotary_qk_ref"]

_HEADS_PER_PROGRAM = 8


@triton.jit
def _rotary_qk_kernel(
    qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
    stride_tok, stride_cos, stride_sin, eps,
    NUM_Q_HEADS: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr, ROT: tl.constexpr, HEADS: tl.constexpr, HAS_NORM: tl.constexpr,
):
    # program (token, head group): HEADS heads of one token, [HEADS, HEAD_PAD]
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    dims = tl.arange(0, HEAD_PAD)
    half: tl.constexpr = ROT // 2
    partner = tl.where(dims < half, dims + half, dims - half)
    rotated = dims < ROT
    partner = tl.where(rotated, partner, dims)
    head_ok = heads[:, None] < NUM_HEADS
    mask = head_ok & (dims[None, :] < HEAD_SIZE)
    base = qkv_ptr + tok * stride_tok + heads[:, None] * HEAD_SIZE
    x = tl.load(base + dims[None, :], mask=mask, other=0.0)
    xp = tl.load(base + partner[None, :], mask=mask, other=0.0)
    if HAS_NORM:
        xf = x.to(tl.float32)
        r = tl.rsqrt(tl.sum(xf * xf, axis=1) / HEAD_SIZE + eps)[:, None]
        is_q = heads[:, None] < NUM_Q_HEADS
        wd = tl.where(is_q, tl.load(qw_ptr + dims, mask=dims < HEAD_SIZE, other=0.0)[None, :],
                      tl.load(kw_ptr + dims, mask=dims < HEAD_SIZE, other=0.0)[None, :])
        wp = tl.where(is_q, tl.load(qw_ptr + partner, mask=dims < HEAD_SIZE, other=0.0)[None, :],
                      tl.load(kw_ptr + partner, mask=dims < HEAD_SIZE, other=0.0)[None, :])
        xn = (xf * r).to(x.dtype)
        xpn = (xp.to(tl.float32) * r).to(x.dtype)
        x = (wd.to(tl.float32) * xn.to(tl.float32)).to(x.dtype)
        xp = (wp.to(tl.float32) * xpn.to(tl.float32)).to(x.dtype)
    cos = tl.load(cos_ptr + tok * stride_cos + dims, mask=rotated, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + tok * stride_sin + dims, mask=rotated, other=0.0).to(tl.float32)
    y = x.to(tl.float32) * cos[None, :] + xp.to(tl.float32) * sin[None, :]
    tl.store(base + dims[None, :], y.to(qkv_ptr.dtype.element_ty), mask=mask)


def rotary_qk_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, num_heads: int,
               num_kv_heads: int, head_size: int, q_norm: torch.Tensor | None = None,
               k_norm: torch.Tensor | None = None, eps: float = 1e-6) -> None:
    """Rotate (after RMS-normalising, when norm weights are given) the query and key
    heads of ``qkv`` in place; the value heads are left alone.

    :param qkv: ``[num_tokens, (num_heads + 2 * num_kv_heads) * head_size]`` (float32,
        float16 or bfloat16; rows may be strided, the last dimension must have unit stride).
    :param cos: ``[num_tokens, 1, rotary_dim]`` (or ``[num_tokens, rotary_dim]``), any
        float dtype; ``rotary_dim <= head_size`` and even.
    :param sin: like ``cos``, with rotate-half's sign folded in (``[-sin, sin]``).
    :param q_norm: optional ``[head_size]`` RMSNorm weight of the query heads (Qwen3);
        ``k_norm`` must then be given too.
    :param eps: the q/k norm's epsilon.
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
    if not num_tokens:
        return
    heads = num_heads + num_kv_heads
    per_program = min(_HEADS_PER_PROGRAM, next_power_of_2(heads))
    grid = (num_tokens, triton.cdiv(heads, per_program))
    _rotary_qk_kernel[grid](
        qkv, cos2, sin2, q_norm if q_norm is not None else qkv,
        k_norm if k_norm is not None else qkv, qkv.stride(0), cos2.stride(0), sin2.stride(0),
        float(eps), NUM_Q_HEADS=num_heads, NUM_HEADS=heads, HEAD_SIZE=head_size,
        HEAD_PAD=max(16, next_power_of_2(head_size)), ROT=rot, HEADS=per_program,
        HAS_NORM=q_norm is not None, num_warps=4,
    )


def rotary_qk_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, num_heads: int,
                  num_kv_heads: int, head_size: int, q_norm: torch.Tensor | None = None,
                  k_norm: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """The torch reference of :func:`rotary_qk_`: returns a rotated copy of ``qkv``."""
    n = qkv.shape[0]
    out = qkv.clone()
    qk = out[:, :(num_heads + num_kv_heads) * head_size].view(n, -1, head_size)
    x = qk.float()
    if q_norm is not None:
        normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(qkv.dtype).float()
        w = torch.cat([q_norm.expand(num_heads, head_size),
                       k_norm.expand(num_kv_heads, head_size)]).float()
        x = (w * normed).to(qkv.dtype).float()
    rot = cos.shape[-1]
    c = cos.reshape(n, 1, rot).float()
    s = sin.reshape(n, 1, rot).float()
    half = rot // 2
    r = x[..., :rot]
    swapped = torch.cat((r[..., half:], r[..., :half]), dim=-1)
    x = torch.cat((r * c + swapped * s, x[..., rot:]), dim=-1)
    qk.copy_(x.to(qkv.dtype))
    return out

"""Fused temperature / top-k / top-p sampling: one program per row, no sort.

Per row: divide by the temperature, find the top-k threshold (the k-th largest value)
and the top-p threshold by bisection over the float32 values' order-preserving integer
keys (32 counting passes each, exact), then draw by the exponential race
``argmax(probs / E)``, ``E ~ Exp(1)``: token ``i`` wins with probability ``probs[i]``.
A row with temperature <= 0 is greedy (``argmax`` of its logits, first index on ties).
Rows with top-k or top-p off skip those passes, so plain temperature sampling reads the
row twice. Semantics match :func:`lmkit_kernels.reference.sample_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmkit_kernels.checks import FLOAT_DTYPES, check_shape, check_tensor, is_interpreting

__all__ = ["sample"]

_NOISE_TENSOR = 0
_NOISE_PHILOX = 1


@triton.jit
def _order_key(x):
    """float32 -> int64 whose order is the floats' order (negative floats flipped)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _sample_kernel(
    logits_ptr, stride_row, temperature_ptr, top_k_ptr, top_p_ptr, noise_ptr, stride_noise,
    seeds_ptr, out_ptr, vocab,
    HAS_TEMPERATURE: tl.constexpr, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr,
    NOISE_MODE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    if HAS_TEMPERATURE:
        temperature = tl.load(temperature_ptr + row).to(tl.float32)
    else:
        temperature = tl.full([], 1.0, tl.float32)
    greedy = temperature <= 0.0
    temperature = tl.where(greedy, 1.0, temperature)
    cols = tl.arange(0, BLOCK_V)

    # pass 1: max and min of x = logits / T, and the first index of the max
    x_max = tl.full([], float("-inf"), tl.float32)
    x_min = tl.full([], float("inf"), tl.float32)
    arg = tl.zeros([], tl.int64)
    for start in range(0, vocab, BLOCK_V):
        offs = start + cols
        ok = offs < vocab
        x = tl.load(row_ptr + offs, mask=ok, other=float("-inf")).to(tl.float32) / temperature
        block_max, block_arg = tl.max(x, axis=0, return_indices=True,
                                      return_indices_tie_break_left=True)
        if block_max > x_max:
            arg = start + block_arg.to(tl.int64)
            x_max = block_max
        x_min = tl.minimum(x_min, tl.min(tl.where(ok, x, float("inf")), axis=0))

    if greedy:
        tl.store(out_ptr + row, arg)
    else:
        lo = _order_key(x_min)
        hi = _order_key(x_max)
        if HAS_TOP_K:
            k = tl.load(top_k_ptr + row).to(tl.int64)
            if (k > 0) & (k < vocab):
                # largest key t with count(key >= t) >= k: the k-th largest value
                top = hi
                for _ in range(32):
                    mid = lo + (top - lo + 1) // 2
                    count = tl.zeros([], tl.int64)
                    for start in range(0, vocab, BLOCK_V):
                        offs = start + cols
                        x = tl.load(row_ptr + offs, mask=offs < vocab,
                                    other=float("-inf")).to(tl.float32) / temperature
                        keep = (_order_key(x) >= mid) & (offs < vocab)
                        count += tl.sum(keep.to(tl.int64), axis=0)
                    if count >= k:
                        lo = mid
                    else:
                        top = mid - 1
        # lo is now the smallest kept key (top-k threshold, or the row minimum)
        if HAS_TOP_P:
            p = tl.load(top_p_ptr + row).to(tl.float32)
            if p < 1.0:
                total = tl.zeros([], tl.float32)
                for start in range(0, vocab, BLOCK_V):
                    offs = start + cols
                    x = tl.load(row_ptr + offs, mask=offs < vocab,
                                other=float("-inf")).to(tl.float32) / temperature
                    e = tl.where((_order_key(x) >= lo) & (offs < vocab), tl.exp(x - x_max), 0.0)
                    total += tl.sum(e, axis=0)
                # smallest key t whose strictly-greater kept mass is below p * total
                top = hi
                for _ in range(32):
                    mid = lo + (top - lo) // 2
                    mass = tl.zeros([], tl.float32)
                    for start in range(0, vocab, BLOCK_V):
                        offs = start + cols
                        x = tl.load(row_ptr + offs, mask=offs < vocab,
                                    other=float("-inf")).to(tl.float32) / temperature
                        key = _order_key(x)
                        above = (key > mid) & (key >= lo) & (offs < vocab)
                        mass += tl.sum(tl.where(above, tl.exp(x - x_max), 0.0), axis=0)
                    if mass < p * total:
                        top = mid
                    else:
                        lo = mid + 1
        # exponential race over the kept tokens (key >= lo)
        best = tl.full([], -1.0, tl.float32)
        choice = arg
        for start in range(0, vocab, BLOCK_V):
            offs = start + cols
            ok = offs < vocab
            x = tl.load(row_ptr + offs, mask=ok, other=float("-inf")).to(tl.float32) / temperature
            if NOISE_MODE == 0:  # _NOISE_TENSOR
                noise = tl.load(noise_ptr + row * stride_noise + offs, mask=ok, other=1.0)
            else:
                seed = tl.load(seeds_ptr + row)
                uniform = tl.rand(seed, offs)
                noise = -tl.log(tl.maximum(uniform, 1.1754943508222875e-38))
            noise = tl.maximum(noise, 1.1754943508222875e-38)
            score = tl.where(ok & (_order_key(x) >= lo), tl.exp(x - x_max) / noise, -1.0)
            block_best, block_arg = tl.max(score, axis=0, return_indices=True,
                                           return_indices_tie_break_left=True)
            if block_best > best:
                best = block_best
                choice = start + block_arg.to(tl.int64)
        tl.store(out_ptr + row, choice)


def sample(logits: torch.Tensor, *, temperature: torch.Tensor | None = None,
           top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
           noise: torch.Tensor | None = None, seeds: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Draw one token id per row of ``logits``.

    :param logits: ``[num_rows, vocab]`` float32/float16/bfloat16, unit stride in the
        last dimension; not modified.
    :param temperature: float32 ``[num_rows]``; a row with ``<= 0`` is greedy. ``None``:
        1.0 for every row.
    :param top_k: int32/int64 ``[num_rows]``; ``<= 0`` or ``>= vocab`` is off for that
        row. Ties with the k-th largest value are kept.
    :param top_p: float32 ``[num_rows]``; ``>= 1`` is off. Applied after top-k.
    :param noise: float32 ``[num_rows, vocab]`` of Exp(1) draws (reproduces a torch
        reference exactly), or
    :param seeds: int64 ``[num_rows]`` Philox seeds for in-kernel noise (change them
        every step; rows must not share a seed). With neither, seeds are drawn from
        torch's generator on the logits' device.
    :param out: optional int64 ``[num_rows]`` result.
    :return: int64 ``[num_rows]`` token ids.
    :raises ValueError: on a shape, dtype, device or stride mismatch.
    """
    check_tensor("logits", logits, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    device = logits.device
    num_rows, vocab = logits.shape
    if vocab >= 2 ** 31:
        raise ValueError(f"vocab {vocab} is too large (max 2**31 - 1)")
    if temperature is not None:
        check_tensor("temperature", temperature, ndim=1, dtypes=(torch.float32,), device=device,
                     contiguous=True)
        check_shape("temperature", temperature, (num_rows,))
    if top_k is not None:
        check_tensor("top_k", top_k, ndim=1, dtypes=(torch.int32, torch.int64), device=device,
                     contiguous=True)
        check_shape("top_k", top_k, (num_rows,))
    if top_p is not None:
        check_tensor("top_p", top_p, ndim=1, dtypes=(torch.float32,), device=device,
                     contiguous=True)
        check_shape("top_p", top_p, (num_rows,))
    if noise is not None and seeds is not None:
        raise ValueError("pass either noise or seeds, not both")
    if noise is not None:
        check_tensor("noise", noise, ndim=2, dtypes=(torch.float32,), device=device,
                     last_dim_contiguous=True)
        check_shape("noise", noise, (num_rows, vocab))
    else:
        if seeds is None:
            seeds = torch.randint(0, 2 ** 62, (num_rows,), dtype=torch.int64, device=device)
        check_tensor("seeds", seeds, ndim=1, dtypes=(torch.int64,), device=device,
                     contiguous=True)
        check_shape("seeds", seeds, (num_rows,))
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=device)
    else:
        check_tensor("out", out, ndim=1, dtypes=(torch.int64,), device=device, contiguous=True)
        check_shape("out", out, (num_rows,))
    if num_rows == 0:
        return out
    dummy = out  # stands in for absent optional pointers (never read)
    block_v = min(triton.next_power_of_2(vocab), 256 if is_interpreting() else 2048)
    _sample_kernel[(num_rows,)](
        logits, logits.stride(0),
        dummy if temperature is None else temperature,
        dummy if top_k is None else top_k,
        dummy if top_p is None else top_p,
        dummy if noise is None else noise, 0 if noise is None else noise.stride(0),
        dummy if seeds is None else seeds, out, vocab,
        HAS_TEMPERATURE=temperature is not None, HAS_TOP_K=top_k is not None,
        HAS_TOP_P=top_p is not None,
        NOISE_MODE=_NOISE_TENSOR if noise is not None else _NOISE_PHILOX,
        BLOCK_V=block_v, num_warps=8,
    )
    return out

"""Fused temperature / top-k / top-p sampling without a sort.

Token ``i`` of a row wins with probability ``probs[i]``, the softmax of
``logits / temperature`` restricted to the tokens top-k and then top-p keep, by the
exponential race ``argmax(probs / E)``, ``E ~ Exp(1)``. Thresholds are exact (found by
searching the float32 values' order-preserving integer keys); a row with temperature
<= 0 is greedy (``argmax`` of its logits, first index on ties). The race and the row
statistics spread each row over many programs; the top-k/top-p searches read a row in
one program, 8 passes each (see :mod:`lmkit_kernels.sampling_kernels`). Semantics match
:func:`sample_ref`, the torch reference at the end of this module.

Measured on an H200 (vocab 151936, GPU time from a CUDA graph; the torch reference in
parentheses): temperature only, 10 / 72 / 280 us for 1 / 64 / 256 rows (266 / 286 /
824); top-k 50, 1.1 / 1.2 / 3.1 ms (0.36 / 1.1 / 3.9); top-p 0.9, 1.2 / 1.2 / 3.3 ms
(0.41 / 1.7 / 5.2). The one-program searches are latency bound: use the kernel for
temperature sampling at any batch size and for top-k/top-p at large batches. Against
the core's whole sampler (not the torch reference) the H100 figures differ; where the
engine runs it is :mod:`lmkit_plugins.sampling.policy` (docs/gpu.md, "Sampling kernels").
"""

from __future__ import annotations

import functools

import torch
import triton

from lmkit_kernels.checks import FLOAT_DTYPES, check_shape, check_tensor, is_interpreting
from lmkit_kernels.sampling_kernels import (
    NUM_THRESHOLDS,
    SEARCH_PASSES,
    chunk_stats_kernel,
    pick_kernel,
    race_kernel,
    threshold_kernel,
)

__all__ = ["sample", "sample_ref", "top_k_top_p_mask_ref"]


@functools.cache
def _num_programs_target(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


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
    interpreting = is_interpreting()
    block_v = min(triton.next_power_of_2(vocab), 256 if interpreting else 1024)
    # chunks of whole blocks, enough of them to give every SM a few programs
    want_chunks = max(1, _num_programs_target(device) // num_rows)
    chunk = block_v * triton.cdiv(triton.cdiv(vocab, block_v), want_chunks)
    num_chunks = triton.cdiv(vocab, chunk)
    chunks_pad = triton.next_power_of_2(triton.cdiv(vocab, block_v))  # the most chunks: one
    # compiled variant for every batch size
    f32 = dict(dtype=torch.float32, device=device)
    part_max = torch.empty((num_rows, num_chunks), **f32)
    part_min = torch.empty((num_rows, num_chunks), **f32)
    part_best = torch.empty((num_rows, num_chunks), **f32)
    part_arg = torch.empty((num_rows, num_chunks), dtype=torch.int64, device=device)
    part_idx = torch.empty((num_rows, num_chunks), dtype=torch.int64, device=device)
    row_max = torch.empty(num_rows, **f32)
    lo_key = torch.empty(num_rows, dtype=torch.int64, device=device)
    temp = dummy if temperature is None else temperature
    has_temp = temperature is not None
    chunk_stats_kernel[(num_rows, num_chunks)](
        logits, logits.stride(0), temp, part_max, part_arg, part_min, vocab, num_chunks,
        chunk, BLOCK_V=block_v, HAS_TEMPERATURE=has_temp, num_warps=4)
    threshold_kernel[(num_rows,)](
        logits, logits.stride(0), temp, dummy if top_k is None else top_k,
        dummy if top_p is None else top_p, part_max, part_arg, part_min, row_max, lo_key, out,
        vocab, num_chunks, CHUNKS_PAD=chunks_pad, BLOCK_V=block_v, NT=NUM_THRESHOLDS,
        PASSES=SEARCH_PASSES, HAS_TEMPERATURE=has_temp, HAS_TOP_K=top_k is not None,
        HAS_TOP_P=top_p is not None, num_warps=8)
    race_kernel[(num_rows, num_chunks)](
        logits, logits.stride(0), temp, dummy if noise is None else noise,
        0 if noise is None else noise.stride(0), dummy if seeds is None else seeds,
        row_max, lo_key, part_best, part_idx, vocab, num_chunks, chunk, BLOCK_V=block_v,
        HAS_TEMPERATURE=has_temp, NOISE_TENSOR=noise is not None, num_warps=4)
    pick_kernel[(num_rows,)](temp, part_best, part_idx, out, num_chunks,
                             CHUNKS_PAD=chunks_pad, HAS_TEMPERATURE=has_temp, num_warps=1)
    return out


def top_k_top_p_mask_ref(logits: torch.Tensor, top_k: torch.Tensor | None,
                         top_p: torch.Tensor | None) -> torch.Tensor:
    """Boolean ``[num_rows, vocab]``: the tokens top-k then top-p keep (float32 maths).

    Top-k keeps values >= the k-th largest (ties included; ``k <= 0`` or ``k >= vocab``
    is off). Top-p then keeps a token when the probability mass of the kept tokens
    strictly more likely than it is below ``p`` (``p >= 1`` is off); the most likely
    token is always kept.
    """
    x = logits.float()
    vocab = x.shape[-1]
    keep = torch.ones_like(x, dtype=torch.bool)
    if top_k is not None:
        k = top_k.long()
        active = (k > 0) & (k < vocab)
        kth = x.sort(dim=-1, descending=True).values.gather(
            1, (k.clamp(1, vocab) - 1).unsqueeze(1))
        keep &= ~active.unsqueeze(1) | (x >= kth)
    if top_p is not None:
        masked = x.masked_fill(~keep, float("-inf"))
        probs = masked.softmax(dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # mass strictly before each token in descending order
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep_sorted = before < top_p.float().unsqueeze(1)
        keep_sorted[:, 0] = True
        keep_p = torch.empty_like(keep).scatter_(1, order, keep_sorted)
        keep &= keep_p | (top_p >= 1.0).unsqueeze(1)
    return keep


def sample_ref(logits: torch.Tensor, temperature: torch.Tensor | None, top_k: torch.Tensor | None,
               top_p: torch.Tensor | None, noise: torch.Tensor) -> torch.Tensor:
    """One token per row: ``argmax(probs / noise)`` over the tokens top-k/top-p keep.

    ``probs`` is the softmax of ``logits / temperature``; ``noise`` is float32 Exp(1)
    ``[num_rows, vocab]`` (the exponential race: token ``i`` wins with probability
    ``probs[i]``). Rows with ``temperature <= 0`` are greedy: ``argmax(logits)``.
    """
    x = logits.float()
    greedy = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    if temperature is not None:
        greedy = temperature <= 0
        x = x / torch.where(greedy, 1.0, temperature.float()).unsqueeze(1)
    keep = top_k_top_p_mask_ref(x, top_k, top_p)
    probs = x.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    sampled = (probs / noise.clamp_min(torch.finfo(torch.float32).tiny)).argmax(dim=-1)
    return torch.where(greedy, logits.float().argmax(dim=-1), sampled)

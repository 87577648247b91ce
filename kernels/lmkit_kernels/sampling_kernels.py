"""Triton kernels of :func:`lmkit_kernels.sampling.sample`, in launch order.

1. :func:`chunk_stats_kernel` ``[rows, chunks]``: each vocabulary chunk's max (first
   index) and min of ``x = logits / T``.
2. :func:`threshold_kernel` ``[rows]``: the row's max, min and argmax (greedy rows are
   done here), then the smallest kept key: the top-k threshold (k-th largest value) and
   the top-p threshold, each found by a 16-ary search over the float32 values'
   order-preserving integer keys (8 counting passes over the row each, exact).
3. :func:`race_kernel` ``[rows, chunks]``: the exponential race ``argmax(e_i / E_i)``,
   ``e_i = exp(x_i - max)``, ``E_i ~ Exp(1)``, over each chunk's kept tokens.
4. :func:`pick_kernel` ``[rows]``: the winner among the chunks (first index on ties).

Stages 1, 3 and 4 spread a row over many programs, so plain temperature sampling runs
at memory speed at any batch size; only the top-k/top-p searches read a row in one
program. The chunk count and size follow the batch size, so they are runtime arguments
that Triton does not specialise on (one compiled variant per vocabulary and filter set,
whatever the batch: as constants they compiled a variant for each new batch size, 54
compiles in the middle of a W1 run with top-p, session 29).
"""

from __future__ import annotations

import triton
import triton.language as tl

NUM_THRESHOLDS = 16  # keys tested per search pass: 4 bits of the 32-bit key per pass
SEARCH_PASSES = 8  # 8 x 4 bits: exact
_TINY = tl.constexpr(1.1754943508222875e-38)  # smallest normal float32


@triton.jit
def order_key(x):
    """float32 -> int64 whose order is the floats' order (negative floats flipped)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _load_x(row_ptr, offs, ok, temperature):
    return tl.load(row_ptr + offs, mask=ok, other=float("-inf")).to(tl.float32) / temperature


@triton.jit
def _row_temperature(temperature_ptr, row, HAS_TEMPERATURE: tl.constexpr):
    """(temperature used for division, is the row greedy)."""
    if HAS_TEMPERATURE:
        t = tl.load(temperature_ptr + row).to(tl.float32)
    else:
        t = tl.full([], 1.0, tl.float32)
    return tl.where(t <= 0.0, 1.0, t), t <= 0.0


@triton.jit(do_not_specialize=["num_chunks", "chunk_size"])
def chunk_stats_kernel(logits_ptr, stride_row, temperature_ptr, part_max_ptr, part_arg_ptr,
                       part_min_ptr, vocab, num_chunks, chunk_size,
                       BLOCK_V: tl.constexpr, HAS_TEMPERATURE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    row_ptr = logits_ptr + row * stride_row
    temperature, _ = _row_temperature(temperature_ptr, row, HAS_TEMPERATURE)
    cols = tl.arange(0, BLOCK_V)
    # per-lane running max (first index on ties) and min; reduced once after the loop
    lane_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_arg = tl.zeros([BLOCK_V], tl.int64) + chunk * chunk_size
    lane_min = tl.full([BLOCK_V], float("inf"), tl.float32)
    for start in range(chunk * chunk_size, tl.minimum((chunk + 1) * chunk_size, vocab), BLOCK_V):
        offs = start + cols
        ok = offs < vocab
        x = _load_x(row_ptr, offs, ok, temperature)
        better = x > lane_max
        lane_arg = tl.where(better, offs.to(tl.int64), lane_arg)
        lane_max = tl.where(better, x, lane_max)
        lane_min = tl.minimum(lane_min, tl.where(ok, x, float("inf")))
    x_max = tl.max(lane_max, axis=0)
    arg = tl.min(tl.where(lane_max == x_max, lane_arg, vocab), axis=0)
    x_min = tl.min(lane_min, axis=0)
    part = row * num_chunks + chunk
    tl.store(part_max_ptr + part, x_max)
    tl.store(part_arg_ptr + part, arg)
    tl.store(part_min_ptr + part, x_min)


@triton.jit(do_not_specialize=["num_chunks"])
def threshold_kernel(logits_ptr, stride_row, temperature_ptr, top_k_ptr, top_p_ptr,
                     part_max_ptr, part_arg_ptr, part_min_ptr, row_max_ptr, lo_key_ptr,
                     out_ptr, vocab, num_chunks, CHUNKS_PAD: tl.constexpr,
                     BLOCK_V: tl.constexpr, NT: tl.constexpr, PASSES: tl.constexpr,
                     HAS_TEMPERATURE: tl.constexpr, HAS_TOP_K: tl.constexpr,
                     HAS_TOP_P: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    temperature, greedy = _row_temperature(temperature_ptr, row, HAS_TEMPERATURE)
    chunks = tl.arange(0, CHUNKS_PAD)
    chunk_ok = chunks < num_chunks
    maxes = tl.load(part_max_ptr + row * num_chunks + chunks, mask=chunk_ok,
                    other=float("-inf"))
    x_max, best_chunk = tl.max(maxes, axis=0, return_indices=True,
                               return_indices_tie_break_left=True)
    x_min = tl.min(tl.load(part_min_ptr + row * num_chunks + chunks, mask=chunk_ok,
                           other=float("inf")), axis=0)
    tl.store(row_max_ptr + row, x_max)
    if greedy:
        tl.store(out_ptr + row, tl.load(part_arg_ptr + row * num_chunks + best_chunk))
    else:
        cols = tl.arange(0, BLOCK_V)
        probes = tl.arange(0, NT)
        lo = order_key(x_min)
        hi = order_key(x_max)
        if HAS_TOP_K:
            k = tl.load(top_k_ptr + row).to(tl.int64)
            if (k > 0) & (k < vocab):
                # largest key t with count(key >= t) >= k: the k-th largest value
                top = hi  # hi stays the row maximum for the top-p search
                for _ in range(PASSES):
                    step = (top - lo + NT) // NT
                    thr = lo + probes.to(tl.int64) * step  # [NT]
                    hits = tl.zeros([BLOCK_V, NT], tl.int32)  # reduced after the loop
                    for start in range(0, vocab, BLOCK_V):
                        offs = start + cols
                        ok = offs < vocab
                        key = order_key(_load_x(row_ptr, offs, ok, temperature))
                        hits += ((key[:, None] >= thr[None, :]) & ok[:, None]).to(tl.int32)
                    count = tl.sum(hits, axis=0)
                    j = tl.max(tl.where(count >= k, probes, 0), axis=0)
                    lo = lo + j.to(tl.int64) * step
                    top = tl.minimum(top, lo + step - 1)
        if HAS_TOP_P:
            p = tl.load(top_p_ptr + row).to(tl.float32)
            if p < 1.0:
                kept_from = lo  # the top-k threshold (or the row minimum)
                lane_total = tl.zeros([BLOCK_V], tl.float32)
                for start in range(0, vocab, BLOCK_V):
                    offs = start + cols
                    ok = offs < vocab
                    x = _load_x(row_ptr, offs, ok, temperature)
                    lane_total += tl.where((order_key(x) >= kept_from) & ok,
                                           tl.exp(x - x_max), 0.0)
                total = tl.sum(lane_total, axis=0)
                # smallest key t whose strictly-greater kept mass is below p * total
                for _ in range(PASSES):
                    step = (hi - lo + NT) // NT
                    thr = lo + probes.to(tl.int64) * step
                    above = tl.zeros([BLOCK_V, NT], tl.float32)  # reduced after the loop
                    for start in range(0, vocab, BLOCK_V):
                        offs = start + cols
                        ok = offs < vocab
                        x = _load_x(row_ptr, offs, ok, temperature)
                        key = order_key(x)
                        e = tl.where((key >= kept_from) & ok, tl.exp(x - x_max), 0.0)
                        above += tl.where(key[:, None] > thr[None, :], e[:, None], 0.0)
                    mass = tl.sum(above, axis=0)
                    j = tl.min(tl.where(mass < p * total, probes, NT), axis=0).to(tl.int64)
                    if j == 0:
                        hi = lo
                    elif j == NT:
                        lo = lo + (NT - 1) * step + 1
                    else:
                        new_lo = lo + (j - 1) * step + 1
                        hi = tl.minimum(hi, lo + j * step)
                        lo = new_lo
        tl.store(lo_key_ptr + row, lo)


@triton.jit(do_not_specialize=["num_chunks", "chunk_size"])
def race_kernel(logits_ptr, stride_row, temperature_ptr, noise_ptr, stride_noise, seeds_ptr,
                row_max_ptr, lo_key_ptr, part_best_ptr, part_idx_ptr, vocab, num_chunks,
                chunk_size, BLOCK_V: tl.constexpr, HAS_TEMPERATURE: tl.constexpr,
                NOISE_TENSOR: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature, greedy = _row_temperature(temperature_ptr, row, HAS_TEMPERATURE)
    if not greedy:
        row_ptr = logits_ptr + row * stride_row
        x_max = tl.load(row_max_ptr + row)
        lo = tl.load(lo_key_ptr + row)
        cols = tl.arange(0, BLOCK_V)
        lane_best = tl.full([BLOCK_V], -1.0, tl.float32)  # reduced after the loop
        lane_idx = tl.zeros([BLOCK_V], tl.int64) + chunk * chunk_size
        for start in range(chunk * chunk_size, tl.minimum((chunk + 1) * chunk_size, vocab),
                           BLOCK_V):
            offs = start + cols
            ok = offs < vocab
            x = _load_x(row_ptr, offs, ok, temperature)
            if NOISE_TENSOR:
                noise = tl.load(noise_ptr + row * stride_noise + offs, mask=ok, other=1.0)
            else:
                uniform = tl.rand(tl.load(seeds_ptr + row), offs)
                noise = -tl.log(tl.maximum(uniform, _TINY))
            noise = tl.maximum(noise, _TINY)
            score = tl.where(ok & (order_key(x) >= lo), tl.exp(x - x_max) / noise, -1.0)
            better = score > lane_best
            lane_idx = tl.where(better, offs.to(tl.int64), lane_idx)
            lane_best = tl.where(better, score, lane_best)
        best = tl.max(lane_best, axis=0)
        choice = tl.min(tl.where(lane_best == best, lane_idx, vocab), axis=0)
        tl.store(part_best_ptr + row * num_chunks + chunk, best)
        tl.store(part_idx_ptr + row * num_chunks + chunk, choice)


@triton.jit(do_not_specialize=["num_chunks"])
def pick_kernel(temperature_ptr, part_best_ptr, part_idx_ptr, out_ptr, num_chunks,
                CHUNKS_PAD: tl.constexpr, HAS_TEMPERATURE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    _, greedy = _row_temperature(temperature_ptr, row, HAS_TEMPERATURE)
    if not greedy:  # greedy rows were written by threshold_kernel
        chunks = tl.arange(0, CHUNKS_PAD)
        best = tl.load(part_best_ptr + row * num_chunks + chunks, mask=chunks < num_chunks,
                       other=-2.0)
        _, winner = tl.max(best, axis=0, return_indices=True,
                           return_indices_tie_break_left=True)
        tl.store(out_ptr + row, tl.load(part_idx_ptr + row * num_chunks + winner))

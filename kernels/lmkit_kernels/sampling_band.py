"""The top-p search's last passes over a band of each row, not the whole row.

After :data:`BAND_AFTER` of the 8 passes of :func:`lmkit_kernels.sampling_kernels.
top_p_pass_kernel`, a row's search range ``[lo, hi]`` (order-preserving keys) is 16**3
times narrower than at the start, and it holds few of the row's tokens: with W1's
near-Gaussian logits, where top-p 0.95 keeps about three quarters of the vocabulary,
about 1% of them. The remaining passes only need

- the mass strictly above ``hi`` (``base``), and
- the tokens with ``lo <= key <= hi`` (the band).

:func:`band_compact_kernel` (``[rows, chunks]``) copies each chunk's band into its own
slots (``cap`` per chunk, in vocabulary order: deterministic, no atomics) and sums its
mass above the band, and
:func:`band_search_kernel` (``[rows]``) runs the remaining passes over it, one program
per row, and the final narrowing the race kernel would do; it flags the row done with
its smallest kept key. A row whose band overflows a chunk's slots is not done: the full
passes go on for it (each program of a done row returns at once). The thresholds are
the same function of the logits as the full passes' (sums in another order).
"""

from __future__ import annotations

import triton
import triton.language as tl

from lmkit_kernels.sampling_kernels import (
    _load_x,
    _narrow_top_p,
    _row_range,
    _row_temperature,
    _sum_chunks,
    _top_p_thresholds,
    _total,
    order_key,
)

BAND_AFTER = 3  # full passes before the band takes over (of SEARCH_PASSES)
BAND_CAP = 2048  # band slots per (row, chunk)


@triton.jit(do_not_specialize=["num_chunks", "chunk_size", "cap"])
def band_compact_kernel(logits_ptr, stride_row, temperature_ptr, top_p_ptr, part_max_ptr,
                        part_min_ptr, state_ptr, part_ptr, total_part_ptr, band_ptr,
                        band_count_ptr, base_part_ptr, vocab, num_chunks, chunk_size, cap,
                        CHUNKS_PAD: tl.constexpr, BLOCK_V: tl.constexpr, NT: tl.constexpr,
                        HAS_TEMPERATURE: tl.constexpr):
    # state / part: the last full pass's (lo, hi) and partial masses; band: [rows,
    # chunks, cap] float32 x; band_count: [rows, chunks] int32 (may exceed cap);
    # base_part: [rows, chunks] float32, the mass above the band
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature, greedy = _row_temperature(temperature_ptr, row, HAS_TEMPERATURE)
    count = tl.zeros([], tl.int32)
    if not greedy:
        p = tl.load(top_p_ptr + row).to(tl.float32)
        if p < 1.0:  # finish the last full pass: the band is the range it leaves
            x_max, _key_min, _key_max = _row_range(part_max_ptr, part_min_ptr, row, num_chunks,
                                                   CHUNKS_PAD)
            lo, hi = _narrow_top_p(
                tl.load(state_ptr + 2 * row), tl.load(state_ptr + 2 * row + 1),
                _sum_chunks(part_ptr, row, num_chunks, CHUNKS_PAD, NT),
                p * _total(total_part_ptr, row, num_chunks, CHUNKS_PAD), NT)
            lo, hi = lo.to(tl.int32), hi.to(tl.int32)
            row_ptr = logits_ptr + row * stride_row
            slots = band_ptr + (row * num_chunks + chunk) * cap
            cols = tl.arange(0, BLOCK_V)
            lane_base = tl.zeros([BLOCK_V], tl.float32)
            for start in range(chunk * chunk_size,
                               tl.minimum((chunk + 1) * chunk_size, vocab), BLOCK_V):
                offs = start + cols
                ok = offs < vocab
                x = _load_x(row_ptr, offs, ok, temperature)
                key = order_key(x)
                lane_base += tl.where((key > hi) & ok, tl.exp(x - x_max), 0.0)
                inside = ((key >= lo) & (key <= hi) & ok).to(tl.int32)
                at = count + tl.cumsum(inside, axis=0) - 1
                tl.store(slots + at, x, mask=(inside > 0) & (at < cap))
                count += tl.sum(inside, axis=0)
            tl.store(base_part_ptr + row * num_chunks + chunk, tl.sum(lane_base, axis=0))
    tl.store(band_count_ptr + row * num_chunks + chunk, count)


@triton.jit(do_not_specialize=["num_chunks", "cap"])
def band_search_kernel(temperature_ptr, top_p_ptr, part_max_ptr, part_min_ptr, state_ptr,
                       part_ptr, total_part_ptr, band_ptr, band_count_ptr, base_part_ptr,
                       done_ptr, done_lo_ptr, num_chunks, cap, CHUNKS_PAD: tl.constexpr,
                       BLOCK_V: tl.constexpr, NT: tl.constexpr, PASSES_LEFT: tl.constexpr,
                       HAS_TEMPERATURE: tl.constexpr):
    # done: [rows] int32, 1 when the band finished the row; done_lo: [rows] int64, then
    # its smallest kept key
    row = tl.program_id(0).to(tl.int64)
    _, greedy = _row_temperature(temperature_ptr, row, HAS_TEMPERATURE)
    chunks = tl.arange(0, CHUNKS_PAD)
    in_row = chunks < num_chunks
    done = tl.zeros([], tl.int32)
    if not greedy:
        p = tl.load(top_p_ptr + row).to(tl.float32)
        counts = tl.load(band_count_ptr + row * num_chunks + chunks, mask=in_row, other=0)
        if (p < 1.0) & (tl.max(counts, axis=0) <= cap):
            done = tl.full([], 1, tl.int32)
            x_max, _key_min, _key_max = _row_range(part_max_ptr, part_min_ptr, row, num_chunks,
                                                   CHUNKS_PAD)
            bound = p * _total(total_part_ptr, row, num_chunks, CHUNKS_PAD)
            lo, hi = _narrow_top_p(
                tl.load(state_ptr + 2 * row), tl.load(state_ptr + 2 * row + 1),
                _sum_chunks(part_ptr, row, num_chunks, CHUNKS_PAD, NT), bound, NT)
            base = tl.sum(tl.load(base_part_ptr + row * num_chunks + chunks, mask=in_row,
                                  other=0.0), axis=0)
            cols = tl.arange(0, BLOCK_V)
            for _pass in range(PASSES_LEFT):
                thr, _step = _top_p_thresholds(lo, hi, NT)
                thr = thr.to(tl.int32)
                above = tl.zeros([BLOCK_V, NT], tl.float32)
                for c in range(num_chunks):
                    slots = band_ptr + (row * num_chunks + c) * cap
                    n = tl.load(band_count_ptr + row * num_chunks + c)
                    for start in range(0, n, BLOCK_V):
                        offs = start + cols
                        ok = offs < n
                        x = tl.load(slots + offs, mask=ok, other=float("-inf"))
                        e = tl.where(ok, tl.exp(x - x_max), 0.0)
                        above += tl.where(order_key(x)[:, None] > thr[None, :], e[:, None],
                                          0.0)
                lo, hi = _narrow_top_p(lo, hi, base + tl.sum(above, axis=0), bound, NT)
            tl.store(done_lo_ptr + row, lo)
    tl.store(done_ptr + row, done)


__all__ = ["BAND_AFTER", "BAND_CAP", "band_compact_kernel", "band_search_kernel"]

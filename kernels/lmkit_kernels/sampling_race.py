"""Top-p by checking the race's winner: the Triton kernels of
:func:`lmkit_kernels.sampling.sample` for rows with top-p on.

The draw is the exponential race ``argmax(e_i / E_i)`` over the kept tokens, with the
noise ``E`` fixed per (row, token) (a tensor, or Philox from the row's seed). Top-p keeps
every token whose key is at least a threshold ``L``. So if the race's winner over a
*larger* set that contains the kept one is itself kept, it is also the winner over the
kept set: the token the threshold search then the race would draw (the same one, up to
a boundary within float rounding, as the sums run in another order). And a token ``c``
is kept exactly when the mass strictly above it is below ``p * total`` (or ``c`` is the
row's most likely token): that mass only falls as the key rises.

Hence, instead of the 8 passes of the threshold search:

1. :func:`top_p_race_kernel` with ``FIRST``: the race over the top-k-kept tokens (all of
   them without top-k) and their total mass ``total``, per chunk.
2. :func:`top_p_race_kernel`, :data:`RACE_ROUNDS` launches: each program picks the
   previous race's winner ``c`` (every program of a row computes the same) and, if the
   check of the previous candidate did not already settle the row, runs the race again
   over the tokens strictly above ``c`` while summing their mass, which is ``c``'s
   check: kept when that mass is below ``p * total``. A rejected ``c`` and every token
   below it are outside the kept set, so the next race's set still contains the kept set.
3. :func:`race_finish_kernel` ``[rows]``: checks the last candidate; writes the token of
   every settled row (greedy rows: the argmax) and flags the rest, which the threshold
   search then draws (its kernels skip the flagged-done rows).

The first race's winner is kept with probability about ``p`` (its draw follows the
whole distribution), so with ``p = 0.95`` a row settles on the first check about 95% of
the time, and each rejection leaves less of the unkept mass in the next race; a small
``p`` over a flat distribution may need the search. The launches are fixed in number (a
CUDA graph can hold them); settled rows' programs return after reading their state.
The masses are summed in a fixed order (per lane over the chunk's blocks, lanes, then
chunks), so draws repeat run to run; as with the search, a boundary within float
rounding of ``p * total`` may fall on another token than the torch reference's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lmkit_kernels.sampling_kernels import (
    _TINY,
    _load_x,
    _row_range,
    _row_temperature,
    _top_k_lo,
    _total,
    chunk_winner,
    order_key,
)

#: check-and-race launches after the first race; rows still open then take the search
RACE_ROUNDS = 3
STATE_WIDTH = 3  # int64 per row: status (0 open, 1 settled), candidate token, its key


@triton.jit
def _kept(cand_key, key_max, mass_ptr, total_part_ptr, p, row, num_chunks,
          CHUNKS_PAD: tl.constexpr):
    """Whether top-p keeps a token of key ``cand_key`` whose strictly-greater mass is in
    ``mass_ptr``'s chunk partials (the row's most likely value is always kept)."""
    mass = _total(mass_ptr, row, num_chunks, CHUNKS_PAD)
    bound = p * _total(total_part_ptr, row, num_chunks, CHUNKS_PAD)
    return (mass < bound) | (cand_key >= key_max)


@triton.jit(do_not_specialize=["num_chunks", "chunk_size"])
def top_p_race_kernel(logits_ptr, stride_row, temperature_ptr, top_k_ptr, top_p_ptr,
                      noise_ptr, stride_noise, seeds_ptr, part_max_ptr, part_min_ptr,
                      k_state_ptr, k_part_ptr, total_part_ptr, state_in_ptr, state_out_ptr,
                      best_in_ptr, idx_in_ptr, mass_in_ptr, best_out_ptr, idx_out_ptr,
                      mass_out_ptr, vocab, num_chunks, chunk_size, CHUNKS_PAD: tl.constexpr,
                      BLOCK_V: tl.constexpr, NT: tl.constexpr, FIRST: tl.constexpr,
                      HAS_TEMPERATURE: tl.constexpr, HAS_TOP_K: tl.constexpr,
                      NOISE_TENSOR: tl.constexpr):
    # state: [rows, STATE_WIDTH] int64; partials: [rows, chunks] race best / index and the
    # mass of the raced tokens (FIRST: mass_out is the total)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature, greedy = _row_temperature(temperature_ptr, row, HAS_TEMPERATURE)
    if not greedy:
        p = tl.load(top_p_ptr + row).to(tl.float32)
        x_max, key_min, key_max = _row_range(part_max_ptr, part_min_ptr, row, num_chunks,
                                             CHUNKS_PAD)
        row_ptr = logits_ptr + row * stride_row
        status = tl.full([], 0, tl.int64)
        cand = tl.full([], -1, tl.int64)
        cand_key = tl.full([], 0, tl.int64)
        if FIRST:  # race over the tokens top-k keeps
            floor = _top_k_lo(top_k_ptr, k_state_ptr, k_part_ptr, row, key_min, vocab,
                              num_chunks, CHUNKS_PAD, NT, HAS_TOP_K)
        else:
            status = tl.load(state_in_ptr + 3 * row)
            cand = tl.load(state_in_ptr + 3 * row + 1)
            cand_key = tl.load(state_in_ptr + 3 * row + 2)
            if (status == 0) & (cand >= 0):  # the previous launch checked cand
                if _kept(cand_key, key_max, mass_in_ptr, total_part_ptr, p, row, num_chunks,
                         CHUNKS_PAD):
                    status = tl.full([], 1, tl.int64)
            if status == 0:  # the previous race's winner is the next candidate
                cand = chunk_winner(best_in_ptr, idx_in_ptr, row, num_chunks, CHUNKS_PAD)
                cand_key = order_key(_load_x(row_ptr, cand, cand >= 0, temperature)).to(
                    tl.int64)
                if p >= 1.0:  # top-p off: the race over the top-k set is the draw
                    status = tl.full([], 1, tl.int64)
            floor = cand_key + 1
        tl.store(state_out_ptr + 3 * row, status, mask=chunk == 0)
        tl.store(state_out_ptr + 3 * row + 1, cand, mask=chunk == 0)
        tl.store(state_out_ptr + 3 * row + 2, cand_key, mask=chunk == 0)
        if status == 0:
            kept_from = floor.to(tl.int32)
            cols = tl.arange(0, BLOCK_V)
            lane_best = tl.full([BLOCK_V], -1.0, tl.float32)  # reduced after the loop
            lane_idx = tl.zeros([BLOCK_V], tl.int64) + chunk * chunk_size
            lane_mass = tl.zeros([BLOCK_V], tl.float32)
            for start in range(chunk * chunk_size, tl.minimum((chunk + 1) * chunk_size, vocab),
                               BLOCK_V):
                offs = start + cols
                ok = offs < vocab
                x = _load_x(row_ptr, offs, ok, temperature)
                raced = ok & (order_key(x) >= kept_from)
                e = tl.where(raced, tl.exp(x - x_max), 0.0)
                lane_mass += e
                if NOISE_TENSOR:
                    noise = tl.load(noise_ptr + row * stride_noise + offs, mask=ok, other=1.0)
                else:
                    uniform = tl.rand(tl.load(seeds_ptr + row), offs)
                    noise = -tl.log(tl.maximum(uniform, _TINY))
                score = tl.where(raced, e / tl.maximum(noise, _TINY), -1.0)
                better = score > lane_best
                lane_idx = tl.where(better, offs.to(tl.int64), lane_idx)
                lane_best = tl.where(better, score, lane_best)
            best = tl.max(lane_best, axis=0)
            part = row * num_chunks + chunk
            tl.store(best_out_ptr + part, best)
            tl.store(idx_out_ptr + part, tl.min(tl.where(lane_best == best, lane_idx, vocab),
                                                axis=0))
            tl.store(mass_out_ptr + part, tl.sum(lane_mass, axis=0))


@triton.jit(do_not_specialize=["num_chunks"])
def race_finish_kernel(temperature_ptr, top_p_ptr, part_max_ptr, part_min_ptr, part_arg_ptr,
                       total_part_ptr, state_ptr, mass_ptr, out_ptr, done_ptr, num_chunks,
                       CHUNKS_PAD: tl.constexpr, HAS_TEMPERATURE: tl.constexpr):
    # [rows]: settle the last candidate; write settled rows' tokens, flag the others (0)
    row = tl.program_id(0).to(tl.int64)
    temperature, greedy = _row_temperature(temperature_ptr, row, HAS_TEMPERATURE)
    if greedy:  # the chunks' argmax (first index on ties)
        tl.store(out_ptr + row, chunk_winner(part_max_ptr, part_arg_ptr, row, num_chunks,
                                             CHUNKS_PAD))
        tl.store(done_ptr + row, 1)
    else:
        status = tl.load(state_ptr + 3 * row)
        cand = tl.load(state_ptr + 3 * row + 1)
        if status == 0:
            x_max, key_min, key_max = _row_range(part_max_ptr, part_min_ptr, row, num_chunks,
                                                 CHUNKS_PAD)
            p = tl.load(top_p_ptr + row).to(tl.float32)
            if _kept(tl.load(state_ptr + 3 * row + 2), key_max, mass_ptr, total_part_ptr, p,
                     row, num_chunks, CHUNKS_PAD):
                status = tl.full([], 1, tl.int64)
        if status == 1:
            tl.store(out_ptr + row, cand)
        tl.store(done_ptr + row, status.to(tl.int32))

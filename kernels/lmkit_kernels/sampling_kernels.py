"""Triton kernels of :func:`lmkit_kernels.sampling.sample`, in launch order.

Every kernel but the last runs on the ``[rows, chunks]`` grid (each program one chunk of
a row's vocabulary); greedy rows and rows with a filter off return after reading their
flags.

1. :func:`chunk_stats_kernel`: each chunk's max (first index) and min of
   ``x = logits / T``.
2. :func:`top_k_pass_kernel`, ``SEARCH_PASSES`` (8) launches when top-k is given: the
   top-k threshold (the k-th largest value) as the largest order-preserving int32 key
   ``t`` with ``count(key >= t) >= k``. Each pass splits the row's key range
   ``[lo, top]`` at ``NUM_THRESHOLDS`` (16) evenly spaced keys and writes each chunk's
   counts at them (``[rows, chunks, 16]`` partials); the next launch's programs first
   sum the previous pass's partials over the chunks and narrow the range (each program
   of a row computes the same result; chunk 0 stores it for the next pass). 8 x 4 bits
   of the 32-bit key: exact.
3. :func:`top_p_pass_kernel`, 8 launches when top-p is given, the same search over
   ``[lo, max]`` from the top-k threshold (or the row minimum): the smallest key ``t``
   whose strictly-greater mass (``sum exp(x - max)``) is below ``p * total``. The first
   pass also writes each chunk's total kept mass.
4. :func:`race_kernel`: finishes the last pass's narrowing (the smallest kept key,
   stored in ``lo_key``), then the exponential race ``argmax(e_i / E_i)``,
   ``e_i = exp(x_i - max)``, ``E_i ~ Exp(1)``, over each chunk's kept tokens.
5. :func:`pick_kernel` ``[rows]``: the winner among the chunks (first index on ties);
   greedy rows take the chunks' argmax.

Launches per call: 3 with temperature only, 11 with top-k or top-p, 19 with both (with
the top-p race of :mod:`lmkit_kernels.sampling_race` 5 more: its 4 grid launches and
the finish; the search's passes, the race and the pick then skip the rows it settled,
``HAS_DONE``). The
search used to run one program per row (8-9 serial reads of the row: latency bound,
~3.6 ms for top-p at 256 x 151,936 on an H200); on the shared grid each pass reads the
row once across all programs. Options weighed: 256 buckets per pass (4 passes) halves
the reads and launches, but Triton has a histogram for counts only (``tl.histogram``):
the top-p masses would take a ``[block, 256]`` compare per element (16x the arithmetic
of 16 thresholds, more than the saved reads) or float atomics (not reproducible). 16
thresholds keep 16 compare-adds per element, and folding each narrowing into the next
launch (a ``[chunks, 16]`` load per program) instead of a ``[rows]`` kernel per pass
keeps one launch per pass; the top-p total rides on the first top-p pass. Sums run in
a fixed order (per lane over a chunk's blocks, then over lanes, then over chunks), so
results repeat run to run; the order depends on the chunk count, so a top-p boundary
within float rounding of ``p * total`` can fall on another token at another batch size
(as it can against the torch reference). ``p <= 0`` keeps the most likely token.

The chunk count and size follow the batch size, so they are runtime arguments that
Triton does not specialise on (one compiled variant per vocabulary and filter set,
whatever the batch: as constants they compiled a variant for each new batch size, 54
compiles in the middle of a W1 run with top-p, session 29).
"""

from __future__ import annotations

import triton
import triton.language as tl

NUM_THRESHOLDS = 16  # keys tested per search pass: 4 bits of the 32-bit key per pass
SEARCH_PASSES = 8  # 8 x 4 bits: exact
_TINY = tl.constexpr(1.1754943508222875e-38)  # smallest normal float32
_KEY_MAX = tl.constexpr(2 ** 31 - 1)


@triton.jit
def order_key(x):
    """float32 -> int32 whose order is the floats' order (negative floats flipped)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


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


@triton.jit
def _row_skipped(greedy, done_ptr, row, HAS_DONE: tl.constexpr):
    """Whether a search or race program of the row has nothing to do: a greedy row, or
    (``HAS_DONE``) one whose ``done_ptr`` flag is set (:mod:`lmkit_kernels.sampling_race`
    settled it)."""
    if HAS_DONE:
        greedy = greedy | (tl.load(done_ptr + row) != 0)
    return greedy


@triton.jit
def chunk_winner(value_ptr, index_ptr, row, num_chunks, CHUNKS_PAD: tl.constexpr):
    """The index held by the row's largest per-chunk value (the leftmost chunk on ties):
    ``[rows, chunks]`` partials of an argmax (chunk maxima and their indices) or of the
    race (best scores and their tokens)."""
    chunks = tl.arange(0, CHUNKS_PAD)
    values = tl.load(value_ptr + row * num_chunks + chunks, mask=chunks < num_chunks,
                     other=float("-inf"))
    _, winner = tl.max(values, axis=0, return_indices=True, return_indices_tie_break_left=True)
    return tl.load(index_ptr + row * num_chunks + winner)


@triton.jit
def _row_range(part_max_ptr, part_min_ptr, row, num_chunks, CHUNKS_PAD: tl.constexpr):
    """(row max of x, int64 keys of the row min and max) from the chunk statistics."""
    chunks = tl.arange(0, CHUNKS_PAD)
    ok = chunks < num_chunks
    x_max = tl.max(tl.load(part_max_ptr + row * num_chunks + chunks, mask=ok,
                           other=float("-inf")), axis=0)
    x_min = tl.min(tl.load(part_min_ptr + row * num_chunks + chunks, mask=ok,
                           other=float("inf")), axis=0)
    return x_max, order_key(x_min).to(tl.int64), order_key(x_max).to(tl.int64)


@triton.jit
def _sum_chunks(part_ptr, row, num_chunks, CHUNKS_PAD: tl.constexpr, NT: tl.constexpr):
    """``[NT]``: a pass's partials ``[rows, chunks, NT]`` summed over the row's chunks."""
    chunks = tl.arange(0, CHUNKS_PAD)
    offs = (row * num_chunks + chunks[:, None]) * NT + tl.arange(0, NT)[None, :]
    return tl.sum(tl.load(part_ptr + offs, mask=(chunks < num_chunks)[:, None], other=0),
                  axis=0)


@triton.jit
def _total(total_part_ptr, row, num_chunks, CHUNKS_PAD: tl.constexpr):
    chunks = tl.arange(0, CHUNKS_PAD)
    return tl.sum(tl.load(total_part_ptr + row * num_chunks + chunks,
                          mask=chunks < num_chunks, other=0.0), axis=0)


@triton.jit
def _top_k_thresholds(lo, top, NT: tl.constexpr):
    """([NT] int64 keys lo + i * step, capped at top + 1, step) for a range [lo, top]."""
    step = (top - lo + NT) // NT
    thr = lo + tl.arange(0, NT).to(tl.int64) * step
    return tl.minimum(thr, tl.minimum(top + 1, _KEY_MAX)), step


@triton.jit
def _narrow_top_k(lo, top, counts, k, NT: tl.constexpr):
    """[lo, top] -> the sub-range holding the largest t with count(key >= t) >= k, from
    the counts at :func:`_top_k_thresholds` (count(key >= lo) >= k is the invariant)."""
    _, step = _top_k_thresholds(lo, top, NT)
    j = tl.max(tl.where(counts >= k, tl.arange(0, NT), 0), axis=0)
    new_lo = lo + j.to(tl.int64) * step
    return new_lo, tl.minimum(top, new_lo + step - 1)


@triton.jit
def _top_p_thresholds(lo, hi, NT: tl.constexpr):
    """([NT] int64 keys lo + i * step, capped at hi, step) for a range [lo, hi]."""
    step = (hi - lo + NT) // NT
    return tl.minimum(lo + tl.arange(0, NT).to(tl.int64) * step, hi), step


@triton.jit
def _narrow_top_p(lo, hi, masses, bound, NT: tl.constexpr):
    """[lo, hi] -> the sub-range holding the smallest t whose strictly-greater mass is
    below ``bound``, from the masses at :func:`_top_p_thresholds`. hi always qualifies
    (the most likely token is kept even when ``bound <= 0``)."""
    thr, step = _top_p_thresholds(lo, hi, NT)
    probes = tl.arange(0, NT)
    j = tl.min(tl.where((masses < bound) | (thr >= hi), probes, NT), axis=0).to(tl.int64)
    new_lo = tl.where(j == 0, lo, lo + (j - 1) * step + 1)
    new_hi = tl.where(j == NT, hi, tl.minimum(hi, lo + j * step))
    return new_lo, new_hi


@triton.jit
def _top_k_lo(top_k_ptr, k_state_ptr, k_part_ptr, row, key_min, vocab, num_chunks,
              CHUNKS_PAD: tl.constexpr, NT: tl.constexpr, HAS_TOP_K: tl.constexpr):
    """The row's top-k threshold key after the last top-k pass (key_min when off)."""
    lo = key_min
    if HAS_TOP_K:
        k = tl.load(top_k_ptr + row).to(tl.int64)
        if (k > 0) & (k < vocab):
            lo, _ = _narrow_top_k(tl.load(k_state_ptr + 2 * row), tl.load(k_state_ptr + 2 * row + 1),
                                  _sum_chunks(k_part_ptr, row, num_chunks, CHUNKS_PAD, NT), k, NT)
    return lo


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


@triton.jit(do_not_specialize=["num_chunks", "chunk_size"])
def top_k_pass_kernel(logits_ptr, stride_row, temperature_ptr, top_k_ptr, part_max_ptr,
                      part_min_ptr, state_in_ptr, state_out_ptr, part_in_ptr, part_out_ptr,
                      vocab, num_chunks, chunk_size, CHUNKS_PAD: tl.constexpr,
                      BLOCK_V: tl.constexpr, NT: tl.constexpr, FIRST: tl.constexpr,
                      HAS_TEMPERATURE: tl.constexpr):
    # state: [rows, 2] int64 (lo, top) the pass searched; partials: [rows, chunks, NT] int32
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature, greedy = _row_temperature(temperature_ptr, row, HAS_TEMPERATURE)
    if not greedy:
        k = tl.load(top_k_ptr + row).to(tl.int64)
        if (k > 0) & (k < vocab):
            if FIRST:
                _, lo, top = _row_range(part_max_ptr, part_min_ptr, row, num_chunks, CHUNKS_PAD)
            else:  # finish the previous pass
                lo, top = _narrow_top_k(
                    tl.load(state_in_ptr + 2 * row), tl.load(state_in_ptr + 2 * row + 1),
                    _sum_chunks(part_in_ptr, row, num_chunks, CHUNKS_PAD, NT), k, NT)
            tl.store(state_out_ptr + 2 * row, lo, mask=chunk == 0)
            tl.store(state_out_ptr + 2 * row + 1, top, mask=chunk == 0)
            thr, _ = _top_k_thresholds(lo, top, NT)
            thr = thr.to(tl.int32)
            row_ptr = logits_ptr + row * stride_row
            cols = tl.arange(0, BLOCK_V)
            hits = tl.zeros([BLOCK_V, NT], tl.int32)  # reduced after the loop
            for start in range(chunk * chunk_size,
                               tl.minimum((chunk + 1) * chunk_size, vocab), BLOCK_V):
                offs = start + cols
                ok = offs < vocab
                key = order_key(_load_x(row_ptr, offs, ok, temperature))
                hits += ((key[:, None] >= thr[None, :]) & ok[:, None]).to(tl.int32)
            tl.store(part_out_ptr + (row * num_chunks + chunk) * NT + tl.arange(0, NT),
                     tl.sum(hits, axis=0))


@triton.jit(do_not_specialize=["num_chunks", "chunk_size"])
def top_p_pass_kernel(logits_ptr, stride_row, temperature_ptr, top_k_ptr, top_p_ptr,
                      part_max_ptr, part_min_ptr, k_state_ptr, k_part_ptr, state_in_ptr,
                      state_out_ptr, part_in_ptr, part_out_ptr, total_part_ptr, done_ptr,
                      vocab, num_chunks, chunk_size, CHUNKS_PAD: tl.constexpr,
                      BLOCK_V: tl.constexpr, NT: tl.constexpr, FIRST: tl.constexpr,
                      HAS_TEMPERATURE: tl.constexpr, HAS_TOP_K: tl.constexpr,
                      HAS_DONE: tl.constexpr):
    # state: [rows, 2] int64 (lo, hi); partials: [rows, chunks, NT] float32 masses;
    # total_part: [rows, chunks] kept mass, written by the first pass
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature, greedy = _row_temperature(temperature_ptr, row, HAS_TEMPERATURE)
    if not _row_skipped(greedy, done_ptr, row, HAS_DONE):
        p = tl.load(top_p_ptr + row).to(tl.float32)
        if p < 1.0:
            x_max, key_min, key_max = _row_range(part_max_ptr, part_min_ptr, row, num_chunks,
                                                 CHUNKS_PAD)
            if FIRST:  # keys >= the top-k threshold are kept
                lo = _top_k_lo(top_k_ptr, k_state_ptr, k_part_ptr, row, key_min, vocab,
                               num_chunks, CHUNKS_PAD, NT, HAS_TOP_K)
                hi = key_max
            else:  # finish the previous pass
                lo, hi = _narrow_top_p(
                    tl.load(state_in_ptr + 2 * row), tl.load(state_in_ptr + 2 * row + 1),
                    _sum_chunks(part_in_ptr, row, num_chunks, CHUNKS_PAD, NT),
                    p * _total(total_part_ptr, row, num_chunks, CHUNKS_PAD), NT)
            tl.store(state_out_ptr + 2 * row, lo, mask=chunk == 0)
            tl.store(state_out_ptr + 2 * row + 1, hi, mask=chunk == 0)
            # thresholds >= lo >= the top-k threshold: only kept tokens are above them
            thr, _ = _top_p_thresholds(lo, hi, NT)
            thr = thr.to(tl.int32)
            kept_from = lo.to(tl.int32)
            row_ptr = logits_ptr + row * stride_row
            cols = tl.arange(0, BLOCK_V)
            above = tl.zeros([BLOCK_V, NT], tl.float32)  # reduced after the loop
            lane_total = tl.zeros([BLOCK_V], tl.float32)
            for start in range(chunk * chunk_size,
                               tl.minimum((chunk + 1) * chunk_size, vocab), BLOCK_V):
                offs = start + cols
                ok = offs < vocab
                x = _load_x(row_ptr, offs, ok, temperature)
                key = order_key(x)
                e = tl.where(ok, tl.exp(x - x_max), 0.0)
                if FIRST:
                    lane_total += tl.where(key >= kept_from, e, 0.0)
                above += tl.where(key[:, None] > thr[None, :], e[:, None], 0.0)
            tl.store(part_out_ptr + (row * num_chunks + chunk) * NT + tl.arange(0, NT),
                     tl.sum(above, axis=0))
            if FIRST:
                tl.store(total_part_ptr + row * num_chunks + chunk, tl.sum(lane_total, axis=0))


@triton.jit(do_not_specialize=["num_chunks", "chunk_size"])
def race_kernel(logits_ptr, stride_row, temperature_ptr, top_k_ptr, top_p_ptr, noise_ptr,
                stride_noise, seeds_ptr, part_max_ptr, part_min_ptr, k_state_ptr, k_part_ptr,
                p_state_ptr, p_part_ptr, total_part_ptr, lo_key_ptr, part_best_ptr,
                part_idx_ptr, done_ptr, vocab, num_chunks, chunk_size,
                CHUNKS_PAD: tl.constexpr, BLOCK_V: tl.constexpr, NT: tl.constexpr,
                HAS_TEMPERATURE: tl.constexpr, HAS_TOP_K: tl.constexpr,
                HAS_TOP_P: tl.constexpr, NOISE_TENSOR: tl.constexpr, HAS_DONE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature, greedy = _row_temperature(temperature_ptr, row, HAS_TEMPERATURE)
    if not _row_skipped(greedy, done_ptr, row, HAS_DONE):
        x_max, key_min, _ = _row_range(part_max_ptr, part_min_ptr, row, num_chunks, CHUNKS_PAD)
        p = tl.full([], 1.0, tl.float32)  # (defined in every compiled variant)
        if HAS_TOP_P:
            p = tl.load(top_p_ptr + row).to(tl.float32)
        if p < 1.0:  # finish the last top-p pass
            lo, _ = _narrow_top_p(
                tl.load(p_state_ptr + 2 * row), tl.load(p_state_ptr + 2 * row + 1),
                _sum_chunks(p_part_ptr, row, num_chunks, CHUNKS_PAD, NT),
                p * _total(total_part_ptr, row, num_chunks, CHUNKS_PAD), NT)
        else:
            lo = _top_k_lo(top_k_ptr, k_state_ptr, k_part_ptr, row, key_min, vocab, num_chunks,
                           CHUNKS_PAD, NT, HAS_TOP_K)
        tl.store(lo_key_ptr + row, lo, mask=chunk == 0)
        kept_from = lo.to(tl.int32)
        row_ptr = logits_ptr + row * stride_row
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
            score = tl.where(ok & (order_key(x) >= kept_from), tl.exp(x - x_max) / noise, -1.0)
            better = score > lane_best
            lane_idx = tl.where(better, offs.to(tl.int64), lane_idx)
            lane_best = tl.where(better, score, lane_best)
        best = tl.max(lane_best, axis=0)
        choice = tl.min(tl.where(lane_best == best, lane_idx, vocab), axis=0)
        tl.store(part_best_ptr + row * num_chunks + chunk, best)
        tl.store(part_idx_ptr + row * num_chunks + chunk, choice)


@triton.jit(do_not_specialize=["num_chunks"])
def pick_kernel(temperature_ptr, part_max_ptr, part_arg_ptr, part_best_ptr, part_idx_ptr,
                out_ptr, done_ptr, num_chunks, CHUNKS_PAD: tl.constexpr,
                HAS_TEMPERATURE: tl.constexpr, HAS_DONE: tl.constexpr):
    # with HAS_DONE, rows flagged done already hold their token (sampling_race)
    row = tl.program_id(0).to(tl.int64)
    _, greedy = _row_temperature(temperature_ptr, row, HAS_TEMPERATURE)
    if not _row_skipped(False, done_ptr, row, HAS_DONE):
        if greedy:  # the chunks' argmax (first index on ties)
            token = chunk_winner(part_max_ptr, part_arg_ptr, row, num_chunks, CHUNKS_PAD)
        else:
            token = chunk_winner(part_best_ptr, part_idx_ptr, row, num_chunks, CHUNKS_PAD)
        tl.store(out_ptr + row, token)

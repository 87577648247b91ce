"""Fused temperature / top-k / top-p sampling without a sort.

Token ``i`` of a row wins with probability ``probs[i]``, the softmax of
``logits / temperature`` restricted to the tokens top-k and then top-p keep, by the
exponential race ``argmax(probs / E)``, ``E ~ Exp(1)``. Thresholds are exact (found by
searching the float32 values' order-preserving integer keys); a row with temperature
<= 0 is greedy (``argmax`` of its logits, first index on ties). Every stage spreads a
row over many programs: the row statistics, each of the 8 passes of the top-k and of
the top-p search, and the race (see :mod:`lmkit_kernels.sampling_kernels`). Top-p rows
are drawn by checking the race's winner against the nucleus instead, where that is
cheaper (``race_rounds``, :mod:`lmkit_kernels.sampling_race`): the same token, in about
a third of the search's passes. Semantics match :func:`sample_ref`, the torch
reference at the end of this module.

Measured on an H200 (vocab 151,936, ``bench/sampling.py --kernel-only``, each call
ending with the host copy; session 30): top-p 0.9 at 1 / 32 / 256 rows 0.44 / 0.44 /
2.55 ms, against 1.33 / 1.37 / 3.63 with the previous one-program-per-row search; top-k
50 0.39 / 0.43 / 2.40 ms (1.27 / 1.31 / 3.45). With the race (session 31), top-p at 256
rows 1.45 ms against 2.83 for the search in the same call. Where the engine runs the
kernel instead of the core's torch sampler is :mod:`lmkit_plugins.sampling.policy` (docs/gpu.md,
"Sampling kernels").
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
    top_k_pass_kernel,
    top_p_pass_kernel,
)
from lmkit_kernels.sampling_race import (
    RACE_ROUNDS,
    STATE_WIDTH,
    race_finish_kernel,
    top_p_race_kernel,
)

__all__ = ["RACE_ROUNDS", "sample", "sample_ref", "top_k_top_p_mask_ref"]


# tokens per block of a top-k/top-p search pass (a power of two) and warps per program:
# each pass accumulates a [block, NT] tile in registers, which spilled at 1,024 x 8
# warps. H200, vocab 151,936, kernel alone (``bench/sampling.py --kernel-only``), top-p
# at 1 / 32 / 256 rows: 1,024 x 8: 444 / 797 / 5,095 us; 512 x 4: 421 / 642 / 4,785;
# 256 x 4: 437 / 436 / 2,551; 128 x 4: 721 / 674 / 3,229 (top-k: 256 x 4 best too)
SEARCH_BLOCK_V = 256
SEARCH_WARPS = 4


@functools.cache
def _num_programs_target(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def row_chunks(num_rows: int, vocab: int, device: torch.device) -> tuple[int, int, int]:
    """(block size, chunk size, chunk count) for kernels that spread each of
    ``num_rows`` rows over ``[rows, chunks]`` programs: chunks of whole blocks, enough of
    them to give every SM a few programs (also :mod:`lmkit_kernels.penalties`')."""
    block_v = min(triton.next_power_of_2(vocab), 256 if is_interpreting() else 1024)
    want_chunks = max(1, _num_programs_target(device) // num_rows)
    chunk = block_v * triton.cdiv(triton.cdiv(vocab, block_v), want_chunks)
    return block_v, chunk, triton.cdiv(vocab, chunk)


def sample(logits: torch.Tensor, *, temperature: torch.Tensor | None = None,
           top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
           noise: torch.Tensor | None = None, seeds: torch.Tensor | None = None,
           out: torch.Tensor | None = None, race_rounds: int | None = None) -> torch.Tensor:
    """Draw one token id per row of ``logits``.

    :param logits: ``[num_rows, vocab]`` float32/float16/bfloat16, unit stride in the
        last dimension; not modified.
    :param temperature: float32 ``[num_rows]``; a row with ``<= 0`` is greedy. ``None``:
        1.0 for every row.
    :param top_k: int32/int64 ``[num_rows]``; ``<= 0`` or ``>= vocab`` is off for that
        row. Ties with the k-th largest value are kept.
    :param top_p: float32 ``[num_rows]``; ``>= 1`` is off, ``<= 0`` keeps the most
        likely value (with its ties). Applied after top-k.
    :param noise: float32 ``[num_rows, vocab]`` of Exp(1) draws (reproduces a torch
        reference exactly), or
    :param seeds: int64 ``[num_rows]`` Philox seeds for in-kernel noise (change them
        every step; rows must not share a seed). With neither, seeds are drawn from
        torch's generator on the logits' device.
    :param out: optional int64 ``[num_rows]`` result.
    :param race_rounds: top-p rows are drawn by checking the race's winner against the
        nucleus (:mod:`lmkit_kernels.sampling_race`) in up to this many rounds, and the
        threshold search draws the rows still open; ``None``: :data:`RACE_ROUNDS`; ``0``:
        the search for every row. The token is the same either way (up to a boundary
        within float rounding of ``p`` times the mass, as against the reference).
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
    if race_rounds is not None and race_rounds < 0:
        raise ValueError(f"race_rounds must be >= 0, got {race_rounds}")
    _launch(logits, temperature, top_k, top_p, noise, seeds, out,
            race_rounds=RACE_ROUNDS if race_rounds is None else race_rounds)
    return out


def _launch(logits: torch.Tensor, temperature: torch.Tensor | None, top_k: torch.Tensor | None,
            top_p: torch.Tensor | None, noise: torch.Tensor | None, seeds: torch.Tensor | None,
            out: torch.Tensor, race_rounds: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the kernels on checked arguments (``seeds`` drawn unless ``noise``) into
    ``out``; returns ``(lo_key, done)``. ``lo_key`` (int64 ``[num_rows]``): each
    non-greedy row's smallest kept order key (a token is kept when its key is >= it;
    greedy rows: unset).

    ``race_rounds > 0`` draws top-p rows by checking the race's winner
    (:mod:`lmkit_kernels.sampling_race`) with that many check-and-race launches; the
    threshold search then runs only for the rows still open, and ``lo_key`` is set only
    for those. ``done`` is then the int32 ``[num_rows]`` flags of the rows the race
    settled (and greedy rows); ``None`` otherwise."""
    device = logits.device
    num_rows, vocab = logits.shape
    dummy = out  # stands in for absent optional pointers (never read)
    block_v, chunk, num_chunks = row_chunks(num_rows, vocab, device)
    chunks_pad = triton.next_power_of_2(triton.cdiv(vocab, block_v))  # the most chunks: one
    # compiled variant for every batch size

    def empty(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    part_max, part_min, part_best = (empty(num_rows, num_chunks) for _ in range(3))
    part_arg, part_idx = (empty(num_rows, num_chunks, dtype=torch.int64) for _ in range(2))
    lo_key = empty(num_rows, dtype=torch.int64)
    temp = dummy if temperature is None else temperature
    has_temp = temperature is not None
    grid = (num_rows, num_chunks)
    args = (logits, logits.stride(0), temp)
    sizes = (vocab, num_chunks, chunk)
    tiles = dict(CHUNKS_PAD=chunks_pad, BLOCK_V=block_v, HAS_TEMPERATURE=has_temp)
    # the searches' [block, NT] tiles: smaller blocks than the other stages', as their
    # accumulators live in registers
    search = dict(tiles, BLOCK_V=min(block_v, SEARCH_BLOCK_V), NT=NUM_THRESHOLDS,
                  num_warps=SEARCH_WARPS)
    chunk_stats_kernel[grid](*args, part_max, part_arg, part_min, *sizes, BLOCK_V=block_v,
                             HAS_TEMPERATURE=has_temp, num_warps=4)
    # The passes of a search alternate between two (state, partials) buffers, reading
    # the previous pass's while writing their own; state: [rows, 2] int64, the range
    # searched; partials: [rows, chunks, NT] counts (top-k) or masses (top-p).
    last = (SEARCH_PASSES - 1) % 2
    k_last = p_last = (dummy, dummy)  # the last pass's (state, partials)
    total_part = dummy
    if top_k is not None:
        k_state = empty(2, num_rows, 2, dtype=torch.int64)
        k_part = empty(2, num_rows, num_chunks, NUM_THRESHOLDS, dtype=torch.int32)
        for i in range(SEARCH_PASSES):
            top_k_pass_kernel[grid](
                *args, top_k, part_max, part_min, k_state[(i - 1) % 2], k_state[i % 2],
                k_part[(i - 1) % 2], k_part[i % 2], *sizes, FIRST=i == 0, **search)
        k_last = (k_state[last], k_part[last])
    done = dummy  # [rows] int32: 1 where the race settled the row (race_rounds > 0)
    if top_p is not None and race_rounds > 0:
        done = _race_top_p(args, sizes, tiles, grid, top_k, top_p, noise, seeds, part_max,
                           part_min, part_arg, k_last, out, race_rounds)
    has_done = done is not dummy
    if top_p is not None:
        p_state = empty(2, num_rows, 2, dtype=torch.int64)
        p_part = empty(2, num_rows, num_chunks, NUM_THRESHOLDS)
        total_part = empty(num_rows, num_chunks)  # kept mass, from the first pass
        for i in range(SEARCH_PASSES):
            top_p_pass_kernel[grid](
                *args, dummy if top_k is None else top_k, top_p, part_max, part_min, *k_last,
                p_state[(i - 1) % 2], p_state[i % 2], p_part[(i - 1) % 2], p_part[i % 2],
                total_part, done, *sizes, FIRST=i == 0, HAS_TOP_K=top_k is not None,
                HAS_DONE=has_done, **search)
        p_last = (p_state[last], p_part[last])
    race_kernel[grid](
        *args, dummy if top_k is None else top_k, dummy if top_p is None else top_p,
        dummy if noise is None else noise, 0 if noise is None else noise.stride(0),
        dummy if seeds is None else seeds, part_max, part_min, *k_last, *p_last, total_part,
        lo_key, part_best, part_idx, done, *sizes, NT=NUM_THRESHOLDS,
        HAS_TOP_K=top_k is not None, HAS_TOP_P=top_p is not None, NOISE_TENSOR=noise is not None,
        HAS_DONE=has_done, num_warps=4, **tiles)
    pick_kernel[(num_rows,)](temp, part_max, part_arg, part_best, part_idx, out, done,
                             num_chunks, CHUNKS_PAD=chunks_pad, HAS_TEMPERATURE=has_temp,
                             HAS_DONE=has_done, num_warps=1)
    return lo_key, (done if has_done else None)


def _race_top_p(args: tuple, sizes: tuple, tiles: dict, grid: tuple[int, int],
                top_k: torch.Tensor | None, top_p: torch.Tensor, noise: torch.Tensor | None,
                seeds: torch.Tensor | None, part_max: torch.Tensor, part_min: torch.Tensor,
                part_arg: torch.Tensor, k_last: tuple[torch.Tensor, torch.Tensor],
                out: torch.Tensor, rounds: int) -> torch.Tensor:
    """Top-p rows drawn by checking the race's winner (``1 + rounds`` grid launches and a
    finishing one); writes the settled rows' tokens (and greedy rows') into ``out`` and
    returns their int32 ``[rows]`` done flags (1 settled, 0 for the threshold search)."""
    num_rows, num_chunks = grid
    device = out.device
    dummy = out
    # two of each (read, written), each its own allocation: a slice at an odd row count
    # would not be 16-byte aligned, and Triton compiles a variant per pointer alignment
    state = [torch.empty(num_rows, STATE_WIDTH, dtype=torch.int64, device=device)
             for _ in range(2)]
    best, mass = ([torch.empty(num_rows, num_chunks, device=device) for _ in range(2)]
                  for _ in range(2))
    total_part = torch.empty(num_rows, num_chunks, device=device)  # the first race's masses
    idx = [torch.empty(num_rows, num_chunks, dtype=torch.int64, device=device)
           for _ in range(2)]
    done = torch.empty(num_rows, dtype=torch.int32, device=device)
    race = (*args, dummy if top_k is None else top_k, top_p, dummy if noise is None else noise,
            0 if noise is None else noise.stride(0), dummy if seeds is None else seeds,
            part_max, part_min, *k_last, total_part)
    flags = dict(NT=NUM_THRESHOLDS, HAS_TOP_K=top_k is not None, NOISE_TENSOR=noise is not None,
                 num_warps=4, **tiles)
    # the first race writes its masses as the total; each later launch reads the
    # previous one's (state, best, index, mass) and writes its own
    top_p_race_kernel[grid](*race, dummy, state[0], dummy, dummy, dummy, best[0], idx[0],
                            total_part, *sizes, FIRST=True, **flags)
    for r in range(1, rounds + 1):
        i, o = (r - 1) % 2, r % 2
        top_p_race_kernel[grid](*race, state[i], state[o], best[i], idx[i], mass[i], best[o],
                                idx[o], mass[o], *sizes, FIRST=False, **flags)
    last = rounds % 2
    race_finish_kernel[(num_rows,)](
        args[2], top_p, part_max, part_min, part_arg, total_part, state[last], mass[last], out,
        done, num_chunks, CHUNKS_PAD=tiles["CHUNKS_PAD"],
        HAS_TEMPERATURE=tiles["HAS_TEMPERATURE"], num_warps=1)
    return done


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

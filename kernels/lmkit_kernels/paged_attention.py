"""Paged attention over lmkit's KV cache: the one launcher for decode and prefill.

Cache layout (every lmkit backend uses it, so backends are interchangeable)::

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_size]   # keys, values

A batch packs the new tokens of all requests along one axis (``query_start_loc``,
int32 ``[num_reqs + 1]``); ``seq_lens`` (int32 ``[num_reqs]``) counts each request's
cached tokens including this step's, all already written to the cache
(:func:`lmkit_kernels.cache_write.reshape_and_cache`); ``block_tables`` (int32
``[num_reqs, max_blocks]``) maps a request's logical blocks to cache blocks.

When every request has one new token (``max_query_len == 1``) the split-K decode
kernel runs (:mod:`lmkit_kernels.paged_decode`), merging its context slices in the same
launch when given a zeroed counter buffer (:func:`split_counters`); otherwise the
causal prefill kernel (:mod:`lmkit_kernels.paged_prefill`), which also handles decode
rows mixed in, and every launch with a draft tree (``tree_region`` / ``tree_mask``).
"""

from __future__ import annotations

import functools
import math

import torch

from lmkit_kernels.checks import (
    FLOAT_DTYPES,
    check_batch_layout,
    check_shape,
    check_tensor,
    dot_needs_f32,
    next_power_of_2,
)
from lmkit_kernels.paged_decode import paged_decode_kernel, reduce_splits_kernel
from lmkit_kernels.paged_prefill import paged_prefill_kernel
from lmkit_kernels.pdl import pdl_launch_args, prefetch_enabled, switch_on

__all__ = ["MAX_HEAD_SIZE", "MAX_SPLITS", "MERGE_AT_ONCE_ENV", "MID_SPLITS_ENV",
           "check_decode_tiles",
           "choose_decode_splits",
           "choose_num_splits", "paged_attention",
           "prefill_config", "split_counters"]

MAX_HEAD_SIZE = 256
MAX_SPLITS = 16
#: batches of at least one program per SM aim for this many programs per SM...
MID_PROGRAMS_PER_SM = 16
#: ...in at most this many slices per request
MID_MAX_SPLITS = 4
MID_SPLITS_ENV = "LMKIT_DECODE_MID_SPLITS"
#: ``0``: the decode kernel's in-launch merge loads the partials slice after slice (a
#: round trip each) instead of all at once (:func:`lmkit_kernels.paged_decode.merge_partials`)
MERGE_AT_ONCE_ENV = "LMKIT_DECODE_MERGE_AT_ONCE"
_LOG2E = 1.4426950408889634


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the CPU interpreter: a small, fixed number keeps tests deterministic
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(num_reqs: int, num_kv_heads: int, device: torch.device, *,
                      max_splits: int = MAX_SPLITS) -> int:
    """How many slices to cut each request's context into for decode.

    Aims at about four programs (of four warps) per SM, enough loads in flight to
    saturate memory bandwidth without the cost of merging partials: on an H100, 64
    requests x 8 KV heads with 4096-token contexts ran best unsplit (99% of the copy
    bandwidth, against 93% with 2 splits). A power of two up to :data:`MAX_SPLITS`. Depends only on the batch
    shape, never on context lengths, so a CUDA graph captured with short contexts
    replays as well with long ones. ``num_kv_heads`` counts four-warp programs per
    request (a kernel of wider programs passes more); ``max_splits`` caps the count.
    """
    programs = max(1, num_reqs * num_kv_heads)
    want = max(1, 4 * _sm_count(device) // programs)
    return min(max_splits, 1 << (want.bit_length() - 1))


def choose_decode_splits(num_reqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Context slices per request for the paged decode kernel (batch shape only, like
    :func:`choose_num_splits`, which it follows below one program per SM).

    From one program (request x KV head) per SM up, a batch's contexts differ in
    length, and a program reads its whole slice: at four programs per SM the launch
    waits on the longest contexts. On an H200 (Qwen3-0.6B's 16/8 heads, contexts of
    200-2,048 tokens, graph replay) 48 requests took 95.8 us unsplit and 78.6 us in four
    slices, 64 took 107.6 and 96.4, 96 took 139.0 and 130.2 in two, 128 171.4 and 162.8
    in two; 256 ran alike in one or two. So such batches aim at
    :data:`MID_PROGRAMS_PER_SM` programs per SM in at most :data:`MID_MAX_SPLITS`
    slices. ``LMKIT_DECODE_MID_SPLITS=0`` keeps :func:`choose_num_splits` throughout.
    """
    programs = max(1, num_reqs * num_kv_heads)
    sms = _sm_count(device)
    if programs < sms or not switch_on(MID_SPLITS_ENV):
        return choose_num_splits(num_reqs, num_kv_heads, device)
    want = max(1, MID_PROGRAMS_PER_SM * sms // programs)
    return min(MID_MAX_SPLITS, 1 << (want.bit_length() - 1))


def _kv_prefetch(k_cache: torch.Tensor, head_size: int) -> dict[str, int]:
    """``KV_LINE`` / ``KV_LINES`` of the decode kernel: one KV head's row of a token as
    128-byte lines, prefetched for a slice's first tile before the PDL wait; none when
    prefetching is off or the head's row is not a whole number of lines."""
    line = max(1, 128 // k_cache.element_size())
    lines = head_size // line
    if not prefetch_enabled(k_cache.device) or head_size % line or lines & (lines - 1):
        return {"KV_LINE": line, "KV_LINES": 0}
    return {"KV_LINE": line, "KV_LINES": lines}


def _fp8_decode_layout(fp8_half: bool, v_scale: float) -> dict[str, bool]:
    """The decode kernel's ``K_ROWS`` / ``V_PRESCALE`` for an FP8 cache read by half
    precision queries (``fp8_half``): keys loaded token-major and transposed in
    registers, values widened and scaled where they are loaded, so the values cross
    shared memory as float16 (16-bit transposing loads) instead of byte by byte. On an
    H200 (graph replays, session 21) 256 requests of 200-2,048 tokens (16/8 heads) read
    an FP8 cache in 251.6 us with both against 273.9 without (bf16 cache: 303.1), and
    256 x 512-768 tokens (32/8 heads) in 151.6 against 163.9 (bf16: 173.8); for a bf16
    cache the token-major keys measured slower (306.8 and 182.6), so it keeps the
    dimension-major load. Values are prescaled only while ``448 * v_scale`` fits
    float16."""
    return {"K_ROWS": fp8_half, "V_PRESCALE": fp8_half and 448.0 * v_scale < 65504.0}


def split_counters(num_reqs: int, num_kv_heads: int, device: torch.device | str
                   ) -> torch.Tensor:
    """A zeroed int32 counter buffer for ``num_reqs`` requests' decode launches.

    Passed to :func:`paged_attention` as ``split_counters``, it lets the decode kernel
    merge its context slices itself (one launch instead of two). Every launch leaves it
    zeroed again, so allocate it once (outside CUDA-graph capture) and reuse it for
    every layer and step -- but never for two launches running at the same time
    (different streams): they would count on the same counters.
    """
    return torch.zeros(max(1, num_reqs * num_kv_heads), dtype=torch.int32, device=device)


@functools.cache
def _is_hopper_or_newer(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def prefill_config(head_pad: int, dtype: torch.dtype, device: torch.device,
                   rows: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the prefill kernel, sized to fit
    shared memory on sm80+; ``rows`` is the longest query times the padded group.

    On Hopper (228 KiB of shared memory) half precision with head size <= 128 takes
    128-row tiles over 8 warps and three stages of K/V in flight when a request has
    that many rows; elsewhere 64-row tiles over 4 warps.
    """
    if dtype == torch.float32:
        return (32, 32, 4, 1) if head_pad >= 256 else (32, 32, 4, 2)
    hopper = _is_hopper_or_newer(device)
    if head_pad >= 256:
        return 64, 32, 8, 2 if hopper else 1
    if hopper and rows >= 128:
        return 128, 64, 8, 3
    return 64, 64, 4, 2


def check_decode_tiles(tiles: tuple[int, ...]) -> None:
    """Refuse decode tiles that are not ``(BLOCK_N, num_warps, num_stages)``: BLOCK_N and
    num_warps powers of two, BLOCK_N >= 16, num_stages >= 1.

    :raises ValueError: naming what is wrong.
    """
    if (len(tiles) != 3 or tiles[0] < 16 or any(t < 1 or t & (t - 1) for t in tiles[:2])
            or tiles[2] < 1):
        raise ValueError("decode_tiles must be (BLOCK_N, num_warps, num_stages): BLOCK_N and "
                         "num_warps powers of two, BLOCK_N >= 16, num_stages >= 1; got "
                         f"{list(tiles)}")


def _decode_config(head_pad: int, dtype: torch.dtype, kv_fp8: bool = False,
                   num_reqs: int = 1, group: int = 1) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for the decode kernel (``group``: query heads per
    KV head). An FP8 cache takes twice the tokens per tile (the same bytes as half
    precision's 64): on an H200, 256 requests of 200-2,048 tokens (16/8 heads) read in
    251.6 us with 128/4/2 against 271.6 with 64/4/3 (session 21, graph replays; 128/4/3
    251.4, 128/8/2 305.7). A half-precision cache read by many requests with small query
    groups takes 128-token tiles over 8 warps: the same W1-like batch read in 291.4 us
    against 302.8 (session 22; 297.3 vs 307.4 and 292.9 vs 303.1 in two calls of session
    21), while 8 requests of 2,048 tokens (26.8 vs 31.1 us) and W3's 32/8 heads (173.9 vs
    176.4) were slower with them."""
    if dtype == torch.float32 or head_pad >= 256:
        return 32, 4, 2
    if kv_fp8:
        return 128, 4, 2
    if num_reqs >= 64 and group <= 2:
        return 128, 8, 2
    return 64, 4, 3


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, *, max_query_len: int,
                    scale: float | None = None, out: torch.Tensor | None = None,
                    num_splits: int | None = None,
                    split_counters: torch.Tensor | None = None,
                    prefill_tiles: tuple[int, int, int, int] | None = None,
                    decode_tiles: tuple[int, int, int] | None = None,
                    k_scale: float = 1.0, v_scale: float = 1.0,
                    tree_region: torch.Tensor | None = None,
                    tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each request's new tokens over its paged context, or draft-tree
    attention for requests with a tree region.

    :param q: ``[num_tokens, num_heads, head_size]`` (float32, float16 or bfloat16;
        rows may be strided, the last dimension must have unit stride). Rows past
        ``query_start_loc[-1]`` (CUDA-graph padding) are left untouched in ``out``.
    :param kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_size]``, q's dtype
        or ``torch.float8_e4m3fn`` (an FP8 cache, read as its values times ``k_scale`` /
        ``v_scale``); ``num_heads`` must be a multiple of ``num_kv_heads`` (GQA).
    :param query_start_loc: int32 ``[num_reqs + 1]``, cumulative query lengths.
    :param seq_lens: int32 ``[num_reqs]``, context length including this step's tokens
        (0 for a padding request: its rows get zeros).
    :param block_tables: int32 ``[num_reqs, max_blocks]``.
    :param max_query_len: host-side maximum of the query lengths; 1 selects decode (but
        for a draft tree).
    :param scale: softmax scale, default ``head_size ** -0.5``.
    :param out: optional output, shaped and typed like ``q``.
    :param num_splits: decode only: context slices per request (a power of two up to
        :data:`MAX_SPLITS`); default :func:`choose_decode_splits`. A context needs at most
        one slice per ``BLOCK_N`` tokens (64 for half precision); unneeded slices exit
        at once, and a one-slice context is written without a merge.
    :param split_counters: decode only: a zeroed int32 buffer of at least ``num_reqs *
        num_kv_heads`` counters (:func:`split_counters`, left zeroed by every launch):
        the decode kernel then merges the slices itself; without it a second kernel
        merges them.
    :param prefill_tiles: prefill only, for tuning: ``(BLOCK_M, BLOCK_N, num_warps,
        num_stages)`` instead of :func:`prefill_config`'s choice (powers of two,
        ``BLOCK_M, BLOCK_N >= 16``).
    :param decode_tiles: decode only, for tuning: ``(BLOCK_N, num_warps, num_stages)``
        instead of the default (64, 4, 3 in half precision; powers of two, ``BLOCK_N >=
        16``).
    :param k_scale: an FP8 cache's key scale (folded into the softmax scale).
    :param v_scale: an FP8 cache's value scale (applied to the output).
    :param tree_region: with ``tree_mask``, a draft-tree step (always the prefill kernel):
        int32 ``[num_reqs]`` (contiguous), each request's tree region ``R``: its last
        ``R`` keys (at most 64, its query tokens among them); 0 leaves it causal.
    :param tree_mask: int64 ``[>= query_start_loc[-1]]`` (contiguous), indexed by token
        row like ``q``: bit ``j`` set when the token sees key ``seq_len - R + j`` of its
        request (every key before the region is seen).
    :return: ``out``, ``[num_tokens, num_heads, head_size]``.
    :raises ValueError: on a shape, dtype, device or stride mismatch.
    """
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    device = q.device
    num_tokens, num_heads, head_size = q.shape
    check_tensor("kv_cache", kv_cache, ndim=5, dtypes=(q.dtype, torch.float8_e4m3fn),
                 device=device, last_dim_contiguous=True)
    check_shape("kv_cache", kv_cache, (2, None, None, None, head_size))
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads}) for grouped-query attention")
    if head_size > MAX_HEAD_SIZE:
        raise ValueError(f"head_size {head_size} is above the supported {MAX_HEAD_SIZE}")
    num_reqs = check_batch_layout(query_start_loc, seq_lens, block_tables, device)
    if out is None:
        out = torch.empty_like(q)
    else:
        check_tensor("out", out, ndim=3, dtypes=(q.dtype,), device=device,
                     last_dim_contiguous=True)
        check_shape("out", out, tuple(q.shape))
    if not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"max_query_len must be a non-negative int, got {max_query_len!r}")
    if (tree_region is None) != (tree_mask is None):
        raise ValueError("tree_region and tree_mask come together (a draft-tree step)")
    if tree_region is not None and tree_mask is not None:
        check_tensor("tree_region", tree_region, ndim=1, dtypes=(torch.int32,), device=device,
                     contiguous=True)
        check_shape("tree_region", tree_region, (num_reqs,))
        check_tensor("tree_mask", tree_mask, ndim=1, dtypes=(torch.int64,), device=device,
                     contiguous=True)
    if num_reqs <= 0 or max_query_len == 0 or num_tokens == 0:
        return out
    scale_log2 = (head_size ** -0.5 if scale is None else scale) * _LOG2E * k_scale
    group = num_heads // num_kv_heads
    head_pad = max(16, next_power_of_2(head_size))
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    common = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
              v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0))
    flags = dict(HEAD_SIZE=head_size, HEAD_PAD=head_pad, PAGE_SIZE=block_size,
                 DOT_F32=dot_needs_f32(q.dtype), DOT_IEEE=q.dtype == torch.float32,
                 KV_FP8=kv_cache.dtype == torch.float8_e4m3fn)

    if max_query_len == 1 and tree_mask is None:
        splits = choose_decode_splits(num_reqs, num_kv_heads, device) if num_splits is None \
            else num_splits
        if splits < 1 or splits > MAX_SPLITS or splits & (splits - 1):
            raise ValueError(f"num_splits must be a power of two in [1, {MAX_SPLITS}], "
                             f"got {splits}")
        if decode_tiles is not None:
            check_decode_tiles(decode_tiles)
        block_n, num_warps, num_stages = decode_tiles or _decode_config(
            head_pad, q.dtype, kv_cache.dtype == torch.float8_e4m3fn, num_reqs, group)
        fused_merge = split_counters is not None and splits > 1
        if fused_merge:
            check_tensor("split_counters", split_counters, ndim=1, dtypes=(torch.int32,),
                         device=device, contiguous=True)
            if split_counters.shape[0] < num_reqs * num_kv_heads:
                raise ValueError(f"split_counters has {split_counters.shape[0]} entries; "
                                 f"num_reqs * num_kv_heads = {num_reqs * num_kv_heads} needed")
        if splits > 1:
            part_out = torch.empty((num_reqs, num_heads, splits, head_pad), dtype=torch.float32,
                                   device=device)
            part_lse = torch.empty((num_reqs, num_heads, splits), dtype=torch.float32,
                                   device=device)
        else:
            part_out = part_lse = out  # unused by the kernel
        paged_decode_kernel[(num_reqs, num_kv_heads, splits)](
            q, k_cache, v_cache, out, part_out, part_lse,
            split_counters if fused_merge else seq_lens,
            query_start_loc, seq_lens, block_tables, scale_log2, v_scale,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), *common,
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group,
            ROWS=max(16, next_power_of_2(group)), NUM_SPLITS=splits, FUSED_MERGE=fused_merge,
            MERGE_AT_ONCE=switch_on(MERGE_AT_ONCE_ENV), MERGE_ROWS=next_power_of_2(group),
            BLOCK_N=block_n, **flags, num_warps=num_warps, num_stages=num_stages,
            **_kv_prefetch(k_cache, head_size), **pdl_launch_args(device),
            **_fp8_decode_layout(kv_cache.dtype == torch.float8_e4m3fn
                                 and q.dtype != torch.float32 and not dot_needs_f32(q.dtype),
                                 v_scale),
        )
        if splits > 1 and not fused_merge:
            reduce_splits_kernel[(num_reqs, num_heads)](
                out, part_out, part_lse, query_start_loc, seq_lens, out.stride(0),
                out.stride(1), NUM_HEADS=num_heads, NUM_SPLITS=splits, BLOCK_N=block_n,
                HEAD_SIZE=head_size, HEAD_PAD=head_pad, num_warps=4,
                **pdl_launch_args(device),
            )
        return out

    group_pad = next_power_of_2(group)
    if prefill_tiles is not None and (
            len(prefill_tiles) != 4 or min(prefill_tiles[:2]) < 16
            or any(t < 1 or t & (t - 1) for t in prefill_tiles[:3]) or prefill_tiles[3] < 1):
        raise ValueError("prefill_tiles must be (BLOCK_M, BLOCK_N, num_warps, num_stages): "
                         f"powers of two with BLOCK_M, BLOCK_N >= 16; got {prefill_tiles}")
    block_m, block_n, num_warps, num_stages = prefill_tiles or prefill_config(
        head_pad, q.dtype, device, max_query_len * group_pad)
    block_q = max(1, block_m // group_pad)
    block_m = block_q * group_pad
    assert block_m >= 16, "tl.dot needs at least 16 rows"
    grid = (math.ceil(max_query_len / block_q), num_reqs, num_kv_heads)
    has_tree = tree_mask is not None
    paged_prefill_kernel[grid](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables,
        tree_region if has_tree else seq_lens, tree_mask if has_tree else seq_lens,
        scale_log2, v_scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1), *common,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        **flags, HAS_TREE=has_tree, num_warps=num_warps, num_stages=num_stages,
    )
    return out


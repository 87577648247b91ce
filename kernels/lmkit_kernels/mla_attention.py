"""MLA attention launchers: absorbed decode over the latent cache, and causal prefill
over decompressed keys and values, plus the per-head projections around them.

Latent cache (``lmkit.api.mla_attention``): ``[num_blocks, block_size, kv_lora_rank +
qk_rope_head_dim]``, ``c_kv`` then ``k_pe``. Batches pack requests as the paged
attention kernels do (``query_start_loc``, ``seq_lens``, ``block_tables``; see
:mod:`lmkit_kernels.paged_attention`).

* decode (and short multi-token queries): :func:`absorb_query` folds ``w_uk`` into the
  query, :func:`mla_decode` attends over the latent (:mod:`lmkit_kernels.mla_decode`),
  :func:`apply_w_uv` maps the latent output to each head's values.
* prefill: :func:`gather_latent` + :func:`decompress_latent` build per-head keys and
  values for the context, :func:`mla_prefill` attends (:mod:`lmkit_kernels.mla_prefill`).

References: :mod:`lmkit_kernels.mla_ref`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from lmkit_kernels.checks import (
    FLOAT_DTYPES,
    check_batch_layout,
    check_shape,
    check_tensor,
    dot_needs_f32,
    next_power_of_2,
)
from lmkit_kernels.mla_decode import mla_decode_kernel, mla_reduce_splits_kernel
from lmkit_kernels.mla_prefill import mla_prefill_kernel
from lmkit_kernels.paged_attention import MAX_SPLITS, choose_num_splits

__all__ = ["MAX_DECODE_QUERY_LEN", "MLA_MAX_SPLITS", "DecodeGeometry", "absorb_query",
           "apply_w_uv", "decode_geometry", "decode_head_tile", "decode_num_splits",
           "decompress_latent", "gather_latent", "mla_decode", "mla_prefill"]

#: The longest query (tokens per request) :func:`mla_decode` takes: speculative
#: verification; longer queries go through the decompressed prefill.
MAX_DECODE_QUERY_LEN = 16
_LOG2E = 1.4426950408889634


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """``q_lat[t, h] = q_nope[t, h] @ w_uk[h]``: ``[num_heads, num_tokens, kv_lora_rank]``
    (head-major, as the batched matmul leaves it; kernels take its strides).

    :param q_nope: ``[num_tokens, num_heads, nope]``
    :param w_uk: ``[num_heads, nope, kv_lora_rank]`` (:func:`lmkit_kernels.mla_ref.split_kv_b`)
    """
    return torch.bmm(q_nope.transpose(0, 1), w_uk)


def apply_w_uv(out_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """``out[t, h] = out_lat[t, h] @ w_uv[h].T``: ``[num_tokens, num_heads, v_dim]``.

    :param out_lat: ``[num_tokens, num_heads, kv_lora_rank]`` (any strides)
    :param w_uv: ``[num_heads, v_dim, kv_lora_rank]``
    """
    return torch.bmm(out_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def gather_latent(kv_cache: torch.Tensor, kv_slots: torch.Tensor) -> torch.Tensor:
    """The cache entries at ``kv_slots`` (int64 ``[num_keys]``): ``[num_keys, kv_lora_rank
    + rope]``."""
    return kv_cache.view(-1, kv_cache.shape[-1]).index_select(0, kv_slots)


def decompress_latent(latent: torch.Tensor, w_kv_b: torch.Tensor, num_heads: int,
                      qk_nope_head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(k_nope, k_pe, v)`` of gathered latent entries: ``[num_keys, num_heads, nope]``,
    ``[num_keys, rope]`` and ``[num_keys, num_heads, v_dim]`` (strided views of one
    matmul's output and of ``latent``)."""
    rank = w_kv_b.shape[-1]
    kv = (latent[:, :rank] @ w_kv_b.t()).view(latent.shape[0], num_heads, -1)
    return kv[..., :qk_nope_head_dim], latent[:, rank:], kv[..., qk_nope_head_dim:]


#: Query heads up to which a decode program takes every head (V2-Lite's 16, V2/V3 on 8
#: GPUs): one read of each latent tile per request, four warps, the tiles measured at
#: 74-82% of the copy bandwidth on an H100 (docs/gpu.md).
NARROW_HEADS = 16
#: Rows (query tokens x heads) of a decode program above :data:`NARROW_HEADS`: V3's 128
#: heads as two 64-row tiles over eight warps, so each latent tile is read twice per
#: request (not eight times, as 16-head tiles did) and each ``tl.dot`` has the 64 rows
#: of a Hopper warpgroup MMA.
WIDE_ROWS = 64
#: The most context slices :func:`mla_decode` takes: with two wide head tiles, batch 1
#: needs 64 slices for 128 programs (about one per SM of an H100).
MLA_MAX_SPLITS = 64


class DecodeGeometry(NamedTuple):
    """How :func:`mla_decode` tiles a batch: query heads per program, keys per tile,
    warps and pipeline stages per program."""

    head_tile: int
    block_n: int
    num_warps: int
    num_stages: int

    @property
    def is_wide(self) -> bool:
        """Eight-warp programs (the wide tiles above :data:`NARROW_HEADS` heads)."""
        return self.num_warps > 4


F32_MAX_ROWS = 32
"""Most query rows (heads x padded tokens) of one float32 decode program."""


def decode_head_tile(num_heads: int, q_pad: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Query heads per decode program: every head up to :data:`NARROW_HEADS` (at least
    16 rows, ``tl.dot``'s minimum, of ``q_pad`` tokens times heads); more heads go in
    tiles of :data:`WIDE_ROWS` rows, except in float32 (16 heads: its 64-row operands
    would not fit registers and shared memory). Float32 programs hold at most
    :data:`F32_MAX_ROWS` rows: 16 heads of 8 query tokens (128 rows of rank 512) asked
    the H100 for 340 KB of shared memory, over its 227 KB."""
    heads = next_power_of_2(num_heads)
    if dtype == torch.float32:
        return max(min(heads, NARROW_HEADS, F32_MAX_ROWS // q_pad), 16 // q_pad)
    if heads <= NARROW_HEADS:
        return max(min(heads, NARROW_HEADS), 16 // q_pad)
    return max(min(heads, WIDE_ROWS // q_pad), 1)


def decode_geometry(num_heads: int, q_pad: int, rank_pad: int, dtype: torch.dtype,
                    head_tile: int | None = None) -> DecodeGeometry:
    """The decode kernel's tiling for ``num_heads`` heads of ``q_pad`` (padded) query
    tokens; ``head_tile`` overrides :func:`decode_head_tile` (a power of two with at
    least 16 rows). Programs of :data:`WIDE_ROWS` rows or more over more than
    :data:`NARROW_HEADS` heads in float16/bfloat16 take eight warps (their ``[rows,
    rank]`` float32 accumulator is 128 KiB at rank 512); the others four, as before."""
    tile = head_tile or decode_head_tile(num_heads, q_pad, dtype)
    if tile < 1 or tile & (tile - 1) or q_pad * tile < 16:
        raise ValueError(f"head_tile must be a power of two with head_tile * "
                         f"{q_pad} query rows >= 16, got {tile}")
    block_n = 16 if dtype == torch.float32 or rank_pad >= 1024 else 32
    wide = (next_power_of_2(num_heads) > NARROW_HEADS and q_pad * tile >= WIDE_ROWS
            and dtype != torch.float32)
    return DecodeGeometry(tile, block_n, 8 if wide else 4, 2)


def decode_num_splits(num_reqs: int, num_heads: int, max_query_len: int,
                      device: torch.device, dtype: torch.dtype = torch.bfloat16,
                      head_tile: int | None = None) -> int:
    """Context slices per request for :func:`mla_decode`, from the batch shape only (a
    CUDA graph's count stays right for any context length): about sixteen warps per SM
    (:func:`~lmkit_kernels.paged_attention.choose_num_splits`), an eight-warp program
    counting as two; up to :data:`~lmkit_kernels.paged_attention.MAX_SPLITS` for
    narrow tiles (unchanged), :data:`MLA_MAX_SPLITS` for wide ones, whose few head
    tiles per request would otherwise leave SMs idle at small batches."""
    q_pad = next_power_of_2(max(max_query_len, 1))
    geo = decode_geometry(num_heads, q_pad, 512, dtype, head_tile)  # rank: no effect on warps
    head_tiles = -(-num_heads // geo.head_tile)
    per_req = head_tiles * geo.num_warps // 4
    return choose_num_splits(num_reqs, per_req, device,
                             max_splits=MLA_MAX_SPLITS if geo.is_wide else MAX_SPLITS)


def mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
               query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
               block_tables: torch.Tensor, *, max_query_len: int, scale: float,
               out: torch.Tensor | None = None, num_splits: int = 1,
               head_tile: int | None = None,
               geometry: DecodeGeometry | None = None) -> torch.Tensor:
    """Causal attention of each request's few new tokens over its latent context.

    :param q_lat: ``[num_tokens, num_heads, kv_lora_rank]`` (any row/head strides, unit
        last stride), e.g. ``absorb_query(...).transpose(0, 1)``.
    :param q_pe: ``[num_tokens, num_heads, rope]``.
    :param kv_cache: ``[num_blocks, block_size, kv_lora_rank + rope]``, q's dtype.
    :param query_start_loc: int32 ``[num_reqs + 1]``; ``seq_lens``: int32 ``[num_reqs]``
        (0 for a padding request); ``block_tables``: int32 ``[num_reqs, max_blocks]``.
    :param max_query_len: host-side longest query, at most :data:`MAX_DECODE_QUERY_LEN`.
    :param scale: softmax scale over the full query/key width (``nope + rope``).
    :param out: optional ``[num_tokens, num_heads, kv_lora_rank]`` output (any strides,
        unit last stride).
    :param num_splits: context slices per request, a power of two up to
        :data:`MLA_MAX_SPLITS` (:func:`decode_num_splits` picks one); unneeded slices
        exit at once.
    :param head_tile: query heads per program (a power of two), default
        :func:`decode_head_tile`; see :func:`decode_geometry`.
    :param geometry: the whole tiling instead (``head_tile`` then unused): for tuning
        sweeps (``bench/mla_decode.py --sweep-geometry``).
    :return: ``out``: the latent attention output, before ``w_uv``.
    :raises ValueError: on a shape, dtype, device or stride mismatch.
    """
    check_tensor("q_lat", q_lat, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    device, dtype = q_lat.device, q_lat.dtype
    num_tokens, num_heads, rank = q_lat.shape
    check_tensor("q_pe", q_pe, ndim=3, dtypes=(dtype,), device=device, last_dim_contiguous=True)
    check_shape("q_pe", q_pe, (num_tokens, num_heads, None))
    rope = q_pe.shape[2]
    check_tensor("kv_cache", kv_cache, ndim=3, dtypes=(dtype,), device=device,
                 last_dim_contiguous=True)
    check_shape("kv_cache", kv_cache, (None, None, rank + rope))
    num_reqs = check_batch_layout(query_start_loc, seq_lens, block_tables, device)
    if out is None:
        out = torch.empty_like(q_lat)
    else:
        check_tensor("out", out, ndim=3, dtypes=(dtype,), device=device,
                     last_dim_contiguous=True)
        check_shape("out", out, tuple(q_lat.shape))
    if not isinstance(max_query_len, int) or not 0 <= max_query_len <= MAX_DECODE_QUERY_LEN:
        raise ValueError(f"max_query_len must be an int in [0, {MAX_DECODE_QUERY_LEN}] for "
                         f"the decode kernel, got {max_query_len!r}; use mla_prefill")
    if num_splits < 1 or num_splits > MLA_MAX_SPLITS or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two in [1, {MLA_MAX_SPLITS}], "
                         f"got {num_splits}")
    if num_reqs == 0 or max_query_len == 0 or num_tokens == 0:
        return out
    q_pad = next_power_of_2(max_query_len)
    rank_pad, rope_pad = max(16, next_power_of_2(rank)), max(16, next_power_of_2(rope))
    if geometry is not None:
        _check_geometry(geometry, q_pad)
    tile, block_n, num_warps, num_stages = geometry or decode_geometry(
        num_heads, q_pad, rank_pad, dtype, head_tile)
    if num_splits > 1:
        part_out = torch.empty((num_tokens, num_heads, num_splits, rank_pad),
                               dtype=torch.float32, device=device)
        part_lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32,
                               device=device)
    else:
        part_out = part_lse = out  # unused by the kernel
    scale_log2 = scale * _LOG2E
    mla_decode_kernel[(math.ceil(num_heads / tile), num_reqs, num_splits)](
        q_lat, q_pe, kv_cache, out, part_out, part_lse, query_start_loc, seq_lens,
        block_tables, scale_log2, q_lat.stride(0), q_lat.stride(1), q_pe.stride(0),
        q_pe.stride(1), out.stride(0), out.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        block_tables.stride(0),
        NUM_HEADS=num_heads, HEAD_TILE=tile, Q_PAD=q_pad, ROWS=q_pad * tile,
        NUM_SPLITS=num_splits, BLOCK_N=block_n, RANK=rank, RANK_PAD=rank_pad, ROPE=rope,
        ROPE_PAD=rope_pad, PAGE_SIZE=kv_cache.shape[1], DOT_F32=dot_needs_f32(dtype),
        DOT_IEEE=dtype == torch.float32, num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        mla_reduce_splits_kernel[(num_reqs, num_heads, q_pad)](
            out, part_out, part_lse, query_start_loc, seq_lens, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, NUM_SPLITS=num_splits, BLOCK_N=block_n, RANK=rank,
            RANK_PAD=rank_pad, num_warps=4,
        )
    return out


def _check_geometry(geo: DecodeGeometry, q_pad: int) -> None:
    decode_geometry(1, q_pad, 16, torch.float32, geo.head_tile)  # the head tile's checks
    for name, value, low in (("block_n", geo.block_n, 16), ("num_warps", geo.num_warps, 1)):
        if value < low or value & (value - 1):
            raise ValueError(f"geometry {name} must be a power of two >= {low}, got {value}")
    if geo.num_stages < 1:
        raise ValueError(f"geometry num_stages must be >= 1, got {geo.num_stages}")


def _prefill_config(dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the prefill kernel."""
    if dtype == torch.float32:
        return 32, 32, 4, 1
    return 64, 64, 4, 2


def mla_prefill(q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor,
                k_pe: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_k: torch.Tensor, *, max_query_len: int, scale: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal varlen attention with per-head ``[k_nope | k_pe]`` keys (``k_pe`` shared by
    the heads) and values of another width.

    :param q_nope: ``[num_tokens, num_heads, nope]``; ``q_pe``: ``[num_tokens, num_heads,
        rope]`` (any row/head strides, unit last stride).
    :param k_nope: ``[num_keys, num_heads, nope]``; ``k_pe``: ``[num_keys, rope]``;
        ``v``: ``[num_keys, num_heads, v_dim]`` (:func:`decompress_latent`'s views).
    :param cu_seqlens_q: int32 ``[num_reqs + 1]``: request ``r``'s query rows.
    :param cu_seqlens_k: int32 ``[num_reqs + 1]``: its key rows; its queries are the
        last ``q_len`` of its ``k_len`` positions.
    :param max_query_len: host-side longest query.
    :param out: optional ``[num_tokens, num_heads, v_dim]`` output.
    :return: ``out``, in ``q_nope``'s dtype.
    :raises ValueError: on a shape, dtype, device or stride mismatch.
    """
    check_tensor("q_nope", q_nope, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    device, dtype = q_nope.device, q_nope.dtype
    num_tokens, num_heads, nope = q_nope.shape
    check_tensor("q_pe", q_pe, ndim=3, dtypes=(dtype,), device=device, last_dim_contiguous=True)
    check_shape("q_pe", q_pe, (num_tokens, num_heads, None))
    rope = q_pe.shape[2]
    check_tensor("k_nope", k_nope, ndim=3, dtypes=(dtype,), device=device,
                 last_dim_contiguous=True)
    check_shape("k_nope", k_nope, (None, num_heads, nope))
    num_keys = k_nope.shape[0]
    check_tensor("k_pe", k_pe, ndim=2, dtypes=(dtype,), device=device, last_dim_contiguous=True)
    check_shape("k_pe", k_pe, (num_keys, rope))
    check_tensor("v", v, ndim=3, dtypes=(dtype,), device=device, last_dim_contiguous=True)
    check_shape("v", v, (num_keys, num_heads, None))
    v_dim = v.shape[2]
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(name, t, ndim=1, dtypes=(torch.int32,), device=device, contiguous=True)
    num_reqs = cu_seqlens_q.shape[0] - 1
    check_shape("cu_seqlens_k", cu_seqlens_k, (num_reqs + 1,))
    if out is None:
        out = torch.empty((num_tokens, num_heads, v_dim), dtype=dtype, device=device)
    else:
        check_tensor("out", out, ndim=3, dtypes=(dtype,), device=device,
                     last_dim_contiguous=True)
        check_shape("out", out, (num_tokens, num_heads, v_dim))
    if num_reqs <= 0 or max_query_len <= 0 or num_tokens == 0:
        return out
    block_m, block_n, num_warps, num_stages = _prefill_config(dtype)
    mla_prefill_kernel[(math.ceil(max_query_len / block_m), num_reqs, num_heads)](
        q_nope, q_pe, k_nope, k_pe, v, out, cu_seqlens_q, cu_seqlens_k, scale * _LOG2E,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        k_nope.stride(0), k_nope.stride(1), k_pe.stride(0), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        NOPE=nope, NOPE_PAD=max(16, next_power_of_2(nope)), ROPE=rope,
        ROPE_PAD=max(16, next_power_of_2(rope)), V_DIM=v_dim,
        V_PAD=max(16, next_power_of_2(v_dim)), BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_F32=dot_needs_f32(dtype), DOT_IEEE=dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out

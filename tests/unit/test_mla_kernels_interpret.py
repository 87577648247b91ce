"""The MLA Triton kernels and the ``mla_triton`` backend against their torch references
(:mod:`lmkit_kernels.mla_ref`) in Triton's CPU interpreter (``TRITON_INTERPRET=1``), at
small shapes: DeepSeek's dimensions scaled down (kv_lora_rank 64, rope 16, nope 32,
v 24), float32/float16/bfloat16, uneven block counts, several context slices, heads
not a multiple of the decode kernel's head tile, multi-token (speculative) queries,
mixed prefill/decode batches over cached prefixes; one case at DeepSeek's real
kv_lora_rank 512 and rope 64 (about a second here).
"""

from __future__ import annotations

import pytest
from interpret_mode import require_triton_interpreter

require_triton_interpreter()
torch = pytest.importorskip("torch")

from lmkit.api import AttentionMetadata  # noqa: E402
from lmkit_kernels.mla_attention import (  # noqa: E402
    absorb_query,
    apply_w_uv,
    mla_decode,
    mla_prefill,
)
from lmkit_kernels.mla_batch import make_mla_batch  # noqa: E402
from lmkit_kernels.mla_cache_write import mla_cache_write  # noqa: E402
from lmkit_kernels.mla_ref import (  # noqa: E402
    mla_attention_ref,
    mla_cache_write_ref,
    mla_latent_attention_ref,
    split_kv_b,
)
from lmkit_plugins.attention.mla_options import MLATritonAttentionOptions  # noqa: E402
from lmkit_plugins.attention.mla_triton import MLATritonAttention  # noqa: E402

TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SMALL = dict(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24)


def _batch(reqs, *, num_heads=5, dtype=torch.float32, block_size=16, dims=None, **kwargs):
    return make_mla_batch(reqs, num_heads=num_heads, **(dims or SMALL), block_size=block_size,
                          dtype=dtype, **kwargs)


def _written_cache(batch):
    cache = batch.kv_cache.clone()
    mla_cache_write_ref(batch.kv_c, batch.k_pe, cache, batch.layout.slot_mapping)
    return cache


def _close(out, ref, n, dtype):
    assert out.dtype == dtype
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=TOL[dtype],
                               rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_write_matches_reference_and_skips_padding(dtype):
    batch = _batch([(3, 2), (30, 1), (0, 17)], dtype=dtype, extra_rows=2)
    slots = batch.layout.slot_mapping.clone()
    slots[1] = -1  # a padding token: not written
    cache = batch.kv_cache.clone()
    mla_cache_write(batch.kv_c, batch.k_pe, cache, slots)
    ref = batch.kv_cache.clone()
    mla_cache_write_ref(batch.kv_c, batch.k_pe, ref, slots)
    assert torch.equal(cache, ref)


def test_cache_write_checks_widths():
    batch = _batch([(3, 2)])
    with pytest.raises(ValueError, match="must fill the cache entry"):
        mla_cache_write(batch.kv_c[:, :-1], batch.k_pe, batch.kv_cache,
                        batch.layout.slot_mapping)


def _decode(batch, cache, num_heads, **kwargs):
    lay = batch.layout
    w_uk, _ = split_kv_b(batch.w_kv_b, num_heads, SMALL["qk_nope_head_dim"])
    q_lat = absorb_query(batch.q_nope, w_uk).transpose(0, 1)
    out = mla_decode(q_lat, batch.q_pe, cache, lay.query_start_loc, lay.seq_lens,
                     lay.block_tables, max_query_len=lay.max_query_len, scale=batch.scale,
                     **kwargs)
    ref = mla_latent_attention_ref(q_lat, batch.q_pe, cache, lay.query_start_loc,
                                   lay.seq_lens, lay.block_tables, batch.scale)
    return out, ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "block_size"), [(5, 16), (20, 32)])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_latent_attention(dtype, num_heads, block_size, num_splits):
    # contexts within one tile, at a block edge, over several tiles and slices, empty
    reqs = [(3, 1), (31, 1), (150, 1), (0, 1), (47, 1)]
    batch = _batch(reqs, num_heads=num_heads, dtype=dtype, block_size=block_size, seed=1)
    cache = _written_cache(batch)
    out, ref = _decode(batch, cache, num_heads, num_splits=num_splits)
    _close(out, ref, batch.num_tokens, dtype)


@pytest.mark.parametrize(("dtype", "num_splits"), [(torch.float32, 8), (torch.bfloat16, 2)])
def test_decode_multi_token_queries_are_causal(dtype, num_splits):
    """Speculative verification: several query tokens per request, each seeing the
    keys up to its own position, with slices that some rows see nothing of."""
    batch = _batch([(40, 3), (0, 4), (100, 2), (7, 1)], dtype=dtype, seed=2)
    cache = _written_cache(batch)
    out, ref = _decode(batch, cache, 5, num_splits=num_splits)
    _close(out, ref, batch.num_tokens, dtype)


def test_decode_rejects_long_queries_and_bad_splits():
    batch = _batch([(4, 17)])
    lay = batch.layout
    q_lat = torch.zeros(17, 5, SMALL["kv_lora_rank"])
    with pytest.raises(ValueError, match="use mla_prefill"):
        mla_decode(q_lat, batch.q_pe, batch.kv_cache, lay.query_start_loc, lay.seq_lens,
                   lay.block_tables, max_query_len=17, scale=1.0)
    with pytest.raises(ValueError, match="power of two"):
        mla_decode(q_lat, batch.q_pe, batch.kv_cache, lay.query_start_loc, lay.seq_lens,
                   lay.block_tables, max_query_len=1, scale=1.0, num_splits=3)
    with pytest.raises(ValueError, match="q_pe must have shape"):
        mla_decode(q_lat, batch.q_pe[:, :2], batch.kv_cache, lay.query_start_loc,
                   lay.seq_lens, lay.block_tables, max_query_len=1, scale=1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_absorbed_decode_equals_decompressed_attention(dtype):
    """q_nope @ w_uk, the latent kernel, @ w_uv^T: the contract's attention."""
    batch = _batch([(20, 1), (70, 1), (1, 1)], dtype=dtype, seed=3)
    cache = _written_cache(batch)
    out_lat, _ = _decode(batch, cache, 5, num_splits=2)
    _, w_uv = split_kv_b(batch.w_kv_b, 5, SMALL["qk_nope_head_dim"])
    lay = batch.layout
    ref = mla_attention_ref(batch.q_nope, batch.q_pe, cache, batch.w_kv_b, lay.query_start_loc,
                            lay.seq_lens, lay.block_tables, batch.scale)
    _close(apply_w_uv(out_lat, w_uv), ref, batch.num_tokens, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_over_decompressed_context(dtype):
    # a fresh prompt, a prompt over a cached prefix, a chunk, longer than one tile
    batch = _batch([(0, 37), (50, 20), (16, 70)], dtype=dtype, seed=4)
    cache = _written_cache(batch)
    lay = batch.layout
    lat = torch.cat([cache[lay.block_tables[r, : -(-s // 16)].long()].reshape(
        -1, cache.shape[-1])[:s] for r, s in enumerate(lay.seq_lens.tolist())])
    rank, nope = SMALL["kv_lora_rank"], SMALL["qk_nope_head_dim"]
    kv = (lat[:, :rank] @ batch.w_kv_b.t()).view(lat.shape[0], 5, -1)
    cu_k = torch.zeros(lay.num_reqs + 1, dtype=torch.int32)
    cu_k[1:] = lay.seq_lens.cumsum(0)
    out = mla_prefill(batch.q_nope, batch.q_pe, kv[..., :nope], lat[:, rank:], kv[..., nope:],
                      lay.query_start_loc, cu_k, max_query_len=lay.max_query_len,
                      scale=batch.scale)
    ref = mla_attention_ref(batch.q_nope, batch.q_pe, cache, batch.w_kv_b, lay.query_start_loc,
                            lay.seq_lens, lay.block_tables, batch.scale)
    _close(out, ref, batch.num_tokens, dtype)


def _backend(batch, num_heads, dtype, dims=None, block_size=16, **options):
    dims = dims or SMALL
    return MLATritonAttention(
        num_heads=num_heads, num_kv_heads=1,
        head_size=dims["kv_lora_rank"] + dims["qk_rope_head_dim"], scale=batch.scale,
        dtype=dtype, device=torch.device("cpu"), block_size=block_size,
        options=MLATritonAttentionOptions(**options), **dims)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_mixed_batch(dtype):
    """Decodes and a short speculative query first (absorbed), then a prompt, a prompt
    over a cached prefix and a chunk (decompressed); padding rows come back zero."""
    reqs = [(9, 1), (33, 3), (70, 1), (0, 20), (40, 12), (17, 33)]
    batch = _batch(reqs, num_heads=20, dtype=dtype, extra_rows=2, seed=5)
    backend = _backend(batch, 20, dtype, absorbed_max_query_len=4)
    backend.plan(AttentionMetadata(**batch.layout.metadata_kwargs()))
    assert backend._plan.num_decodes == 3
    cache = batch.kv_cache.clone()
    out = backend.run_mla(0, batch.q_nope, batch.q_pe, batch.kv_c, batch.k_pe, cache,
                          batch.w_kv_b)
    ref_cache = _written_cache(batch)
    assert torch.equal(cache, ref_cache)
    lay = batch.layout
    ref = mla_attention_ref(batch.q_nope, batch.q_pe, ref_cache, batch.w_kv_b,
                            lay.query_start_loc, lay.seq_lens, lay.block_tables, batch.scale)
    n = batch.num_tokens
    assert out.shape == (n + 2, 20, SMALL["v_head_dim"])
    _close(out, ref, n, dtype)
    assert torch.all(out[n:] == 0)


def test_backend_refuses_graph_capture_of_prefill_and_run_before_plan():
    batch = _batch([(3, 1), (0, 20)])
    backend = _backend(batch, 5, torch.float32)
    with pytest.raises(RuntimeError, match="before plan"):
        backend.run_mla(0, batch.q_nope, batch.q_pe, batch.kv_c, batch.k_pe,
                        batch.kv_cache, batch.w_kv_b)
    with pytest.raises(RuntimeError, match="only decode steps in a CUDA graph"):
        backend.plan(AttentionMetadata(**batch.layout.metadata_kwargs(cuda_graph=True)))
    with pytest.raises(TypeError, match="run_mla"):
        backend.run(0, batch.q_nope, batch.q_nope, batch.q_nope, batch.kv_cache)


def test_backend_at_deepseek_rank_and_rope():
    """kv_lora_rank 512, rope 64 (DeepSeek-V2/V3), nope 64 and v 32 to keep it short."""
    dims = dict(kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=32)
    batch = _batch([(40, 1), (20, 2), (0, 18)], num_heads=3, dims=dims, seed=6)
    backend = _backend(batch, 3, torch.float32, dims=dims)
    backend.plan(AttentionMetadata(**batch.layout.metadata_kwargs()))
    cache = batch.kv_cache.clone()
    out = backend.run_mla(0, batch.q_nope, batch.q_pe, batch.kv_c, batch.k_pe, cache,
                          batch.w_kv_b)
    lay = batch.layout
    ref = mla_attention_ref(batch.q_nope, batch.q_pe, cache, batch.w_kv_b, lay.query_start_loc,
                            lay.seq_lens, lay.block_tables, batch.scale)
    _close(out, ref, batch.num_tokens, torch.float32)


def test_decode_geometry_by_head_count():
    """Up to 16 heads: one program for all heads, four warps (the session-9 tiling);
    V2/V3's 128 heads: 64-row tiles over eight warps, more slices per request."""
    from lmkit_kernels.mla_attention import decode_geometry, decode_num_splits
    from lmkit_kernels.paged_attention import choose_num_splits
    bf16 = torch.bfloat16
    assert decode_geometry(16, 1, 512, bf16) == (16, 32, 4, 2)
    assert decode_geometry(5, 2, 64, bf16) == (8, 32, 4, 2)
    assert decode_geometry(128, 1, 512, bf16) == (64, 32, 8, 2)
    assert decode_geometry(128, 4, 512, bf16) == (16, 32, 8, 2)  # 64 rows
    assert decode_geometry(20, 1, 64, bf16) == (32, 32, 4, 2)  # 32 rows: four warps
    assert decode_geometry(128, 1, 512, torch.float32) == (16, 16, 4, 2)  # float32: narrow
    assert decode_geometry(128, 1, 512, bf16, head_tile=16) == (16, 32, 4, 2)
    with pytest.raises(ValueError, match="head_tile must be a power of two"):
        decode_geometry(128, 1, 512, bf16, head_tile=8)
    cpu = torch.device("cpu")  # the interpreter counts 8 SMs
    for num_reqs in (1, 2, 8, 64):  # the 16-head path keeps its split counts
        assert decode_num_splits(num_reqs, 16, 1, cpu) == choose_num_splits(num_reqs, 1, cpu)
    # 128 heads, 1 request: two 8-warp tiles count as four programs: 4 * 8 // 4 = 8
    assert decode_num_splits(1, 128, 1, cpu) == 8
    assert decode_num_splits(1, 128, 1, cpu, head_tile=16) == 4  # eight 4-warp tiles
    assert decode_num_splits(1, 128, 1, cpu, torch.float32) == 4  # as with head_tile=16


def test_decode_geometry_override():
    """``mla_decode(geometry=...)`` (the bench's tiling sweep) gives the same result; a
    tiling the kernel cannot take is refused."""
    from lmkit_kernels.mla_attention import DecodeGeometry
    batch = _batch([(40, 1), (3, 1), (0, 1)], num_heads=20, dtype=torch.bfloat16, seed=11)
    cache = _written_cache(batch)
    out, ref = _decode(batch, cache, 20, num_splits=2,
                       geometry=DecodeGeometry(32, 16, 8, 3))
    _close(out, ref, batch.num_tokens, torch.bfloat16)
    with pytest.raises(ValueError, match="geometry block_n must be a power of two"):
        _decode(batch, cache, 20, geometry=DecodeGeometry(32, 24, 4, 2))
    with pytest.raises(ValueError, match="head_tile must be a power of two"):
        _decode(batch, cache, 20, geometry=DecodeGeometry(8, 32, 4, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, pytest.param(8, marks=pytest.mark.slow)])
def test_decode_at_128_heads_wide_tiles(dtype, num_splits):
    """V3's 128 query heads (bfloat16: two 64-row tiles; float32: 16-head tiles) against
    the reference, and equal to the 16-head tiling of the same batch."""
    batch = _batch([(3, 1), (150, 1), (0, 1), (47, 1)], num_heads=128, dtype=dtype, seed=8)
    cache = _written_cache(batch)
    out, ref = _decode(batch, cache, 128, num_splits=num_splits)
    _close(out, ref, batch.num_tokens, dtype)
    narrow, _ = _decode(batch, cache, 128, num_splits=num_splits, head_tile=16)
    _close(out, narrow, batch.num_tokens, dtype)


@pytest.mark.slow
def test_decode_at_128_heads_multi_token_queries():
    """Speculative queries at 128 heads: 2 and 3 tokens (q_pad 4: 16-head tiles of 64
    rows), causal within the query."""
    batch = _batch([(40, 3), (9, 2), (70, 1)], num_heads=128, dtype=torch.bfloat16, seed=9)
    cache = _written_cache(batch)
    out, ref = _decode(batch, cache, 128, num_splits=4)
    _close(out, ref, batch.num_tokens, torch.bfloat16)


@pytest.mark.slow
def test_backend_at_128_heads_and_head_tile_option():
    """``mla_triton`` at 128 heads: decodes (wide tiles) beside a prompt, by default and
    with ``decode_head_tile`` 16; the option refuses what the kernel cannot tile."""
    batch = _batch([(30, 1), (65, 1), (0, 20)], num_heads=128, dtype=torch.bfloat16, seed=10)
    lay = batch.layout
    ref = None
    for options in ({}, {"decode_head_tile": 16}):
        backend = _backend(batch, 128, torch.bfloat16, **options)
        backend.plan(AttentionMetadata(**lay.metadata_kwargs()))
        cache = batch.kv_cache.clone()
        out = backend.run_mla(0, batch.q_nope, batch.q_pe, batch.kv_c, batch.k_pe, cache,
                              batch.w_kv_b)
        if ref is None:
            ref = mla_attention_ref(batch.q_nope, batch.q_pe, cache, batch.w_kv_b,
                                    lay.query_start_loc, lay.seq_lens, lay.block_tables,
                                    batch.scale)
        _close(out, ref, batch.num_tokens, torch.bfloat16)
    with pytest.raises(ValueError, match="decode_head_tile must be a power of two in"):
        MLATritonAttentionOptions(decode_head_tile=8)
    with pytest.raises(ValueError, match="decode_num_splits must be a power of two in"):
        MLATritonAttentionOptions(decode_num_splits=128)


@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("q_pad", [1, 2, 4, 8])
def test_float32_decode_programs_stay_within_the_row_budget(num_heads, q_pad):
    """Float32 programs of 16 heads x 8 query tokens (128 rows) overflowed the H100's
    shared memory (340 KB asked, 227 KB there); float32 tiles hold at most 32 rows, and
    the 16-row minimum of ``tl.dot`` still holds."""
    from lmkit_kernels.mla_attention import F32_MAX_ROWS, decode_head_tile

    tile = decode_head_tile(num_heads, q_pad, torch.float32)
    assert 16 <= tile * q_pad <= F32_MAX_ROWS
    assert decode_head_tile(num_heads, q_pad, torch.bfloat16) * q_pad >= tile * q_pad

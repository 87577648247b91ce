"""lmkit_kernels' Triton kernels against their torch references, in Triton's CPU
interpreter (``TRITON_INTERPRET=1``), at tiny shapes.

Covers paged attention (decode with and without split-K, prefill, prefill over a cached
prefix, chunked prefill, mixed batches, GQA, block sizes 16/32, head sizes 64/80/128,
float32/float16/bfloat16), the KV-cache write and top-k/top-p sampling, plus the
``triton`` attention backend against the torch reference backend. On a machine with
CUDA this module runs only when TRITON_INTERPRET=1 is set for the whole session (the
compiled kernels are covered by tests/gpu).
"""

from __future__ import annotations

import pytest
from interpret_mode import require_triton_interpreter

require_triton_interpreter("CUDA is available: compiled kernels are tested in tests/gpu (set "
                "TRITON_INTERPRET=1 to run the interpreter tests here)")
torch = pytest.importorskip("torch")

from lmkit.api import AttentionMetadata  # noqa: E402
from lmkit_kernels.cache_write import reshape_and_cache  # noqa: E402
from lmkit_kernels.paged_attention import paged_attention, split_counters  # noqa: E402
from lmkit_kernels.random_batch import make_paged_batch  # noqa: E402
from lmkit_kernels.reference import (  # noqa: E402
    paged_attention_ref,
    reshape_and_cache_ref,
)
from lmkit_plugins.attention.torch_ref import TorchAttention  # noqa: E402
from lmkit_plugins.attention.triton_backend import TritonAttention  # noqa: E402

TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _attend(batch, **kwargs):
    return paged_attention(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens,
                           batch.block_tables, max_query_len=batch.max_query_len, **kwargs)


def _check_attention(batch, out, dtype):
    head_size = batch.q.shape[-1]
    ref = paged_attention_ref(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens,
                              batch.block_tables, head_size ** -0.5)
    n = batch.num_tokens
    assert out.dtype == dtype
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=TOL[dtype], rtol=TOL[dtype])


# ---------------------------------------------------------------- paged attention


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "head_size"), [(16, 64), (32, 128)])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 2)])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode(dtype, block_size, head_size, num_heads, num_kv_heads, num_splits):
    # contexts shorter than, equal to and several times one 64-token tile
    reqs = [(4, 1), (63, 1), (150, 1)]
    batch = make_paged_batch(reqs, num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_size=head_size, block_size=block_size, dtype=dtype)
    _check_attention(batch, _attend(batch, num_splits=num_splits), dtype)


@pytest.mark.parametrize(("dtype", "num_heads", "num_kv_heads", "num_splits"),
                         [(torch.float32, 2, 2, 2), (torch.bfloat16, 8, 2, 8),
                          (torch.bfloat16, 6, 2, 16)])
def test_decode_merges_slices_in_one_launch(dtype, num_heads, num_kv_heads, num_splits):
    """With a counter buffer the last slice to finish merges the partials: the same
    result, the counters left at zero for the next launch (run twice), and short
    contexts (one slice, written directly) mixed with long ones and a padding row."""
    reqs = [(4, 1), (63, 1), (64, 1), (200, 1), (0, 1)]
    batch = make_paged_batch(reqs, num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_size=64, block_size=16, dtype=dtype, seed=7)
    counters = split_counters(batch.num_reqs, num_kv_heads, "cpu")
    assert counters.shape == (batch.num_reqs * num_kv_heads,)
    for _ in range(2):
        out = _attend(batch, num_splits=num_splits, split_counters=counters)
        _check_attention(batch, out, dtype)
        assert torch.all(counters == 0)
    two_launches = _attend(batch, num_splits=num_splits)
    assert torch.equal(out, two_launches)
    batch.seq_lens[4] = 0  # a padded decode row without context: zeros
    assert torch.all(_attend(batch, num_splits=num_splits, split_counters=counters)[4] == 0)
    with pytest.raises(ValueError, match="split_counters has 3 entries"):
        _attend(batch, num_splits=num_splits, split_counters=counters[:3])


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (8, 8)])
def test_decode_merge_at_once_is_the_loops_bits(monkeypatch, num_heads, num_kv_heads):
    """The in-launch merge loads every slice's partial at once (unrolled, masked past
    the active slices); with ``LMKIT_DECODE_MERGE_AT_ONCE=0`` it loops slice by slice.
    Both sum in the same order: the same bits, for groups of 3 (padded to 4 rows) and 1."""
    from lmkit_kernels.paged_attention import MERGE_AT_ONCE_ENV

    reqs = [(40, 1), (150, 1), (300, 1), (1, 1)]
    batch = make_paged_batch(reqs, num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_size=64, block_size=16, dtype=torch.bfloat16, seed=11)
    counters = split_counters(batch.num_reqs, num_kv_heads, "cpu")
    at_once = _attend(batch, num_splits=8, split_counters=counters, decode_tiles=(16, 4, 2))
    monkeypatch.setenv(MERGE_AT_ONCE_ENV, "0")
    looped = _attend(batch, num_splits=8, split_counters=counters, decode_tiles=(16, 4, 2))
    assert torch.equal(at_once, looped)
    assert torch.all(counters == 0)
    _check_attention(batch, at_once, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "head_size"), [(16, 64), (32, 128)])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 2)])
def test_prefill_cached_prefix_and_chunks(dtype, block_size, head_size, num_heads, num_kv_heads):
    # a fresh prompt, a prompt over a cached prefix, a later chunk of a chunked prefill,
    # and a decode row mixed in
    reqs = [(0, 19), (37, 11), (70, 40), (25, 1)]
    batch = make_paged_batch(reqs, num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_size=head_size, block_size=block_size, dtype=dtype, seed=1)
    _check_attention(batch, _attend(batch), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiles", [(32, 16, 4, 1), (16, 32, 4, 1)])
def test_prefill_tile_sizes(dtype, tiles):
    """Small tiles: many whole unmasked tiles before each query tile's diagonal, tiles
    ending inside a page and pages inside a tile, a cached prefix not a tile multiple."""
    reqs = [(0, 50), (33, 20), (5, 1), (100, 3)]
    batch = make_paged_batch(reqs, num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                             dtype=dtype, seed=8)
    _check_attention(batch, _attend(batch, prefill_tiles=tiles), dtype)
    with pytest.raises(ValueError, match="prefill_tiles must be"):
        _attend(batch, prefill_tiles=(8, 16, 4, 1))


def test_decode_split_choice_by_batch_shape(monkeypatch):
    """Below one program (request x KV head) per SM: equal slices aiming at four per SM
    (choose_num_splits); from there up to 16 per SM in at most four slices; the switch
    keeps the first rule throughout and refuses anything but 0/1."""
    from lmkit_kernels import paged_attention as pa

    cpu = torch.device("cpu")  # the interpreter counts 8 SMs
    monkeypatch.delenv(pa.MID_SPLITS_ENV, raising=False)
    assert pa.choose_decode_splits(1, 2, cpu) == pa.choose_num_splits(1, 2, cpu) == 16
    assert pa.choose_decode_splits(3, 2, cpu) == 4  # 6 programs: below one per SM
    assert [pa.choose_decode_splits(n, 8, cpu) for n in (1, 2, 4, 8, 16, 64)] == [
        4, 4, 4, 2, 1, 1]
    assert [pa.choose_num_splits(n, 8, cpu) for n in (1, 2, 4, 8, 16, 64)] == [
        4, 2, 1, 1, 1, 1]
    monkeypatch.setenv(pa.MID_SPLITS_ENV, "0")
    assert pa.choose_decode_splits(4, 8, cpu) == 1
    monkeypatch.setenv(pa.MID_SPLITS_ENV, "maybe")
    with pytest.raises(ValueError, match="LMKIT_DECODE_MID_SPLITS='maybe'"):
        pa.choose_decode_splits(4, 8, cpu)


def test_decode_tile_choice_by_batch_and_group():
    """Half precision: 128-token tiles over 8 warps for 64+ requests with at most two
    query heads per KV head (measured faster at W1's shape), else 64/4/3; an FP8 cache
    128/4/2; float32 and 256-wide heads 32/4/2."""
    from lmkit_kernels.paged_attention import _decode_config

    bf16, f8 = torch.bfloat16, True
    assert _decode_config(128, bf16, num_reqs=256, group=2) == (128, 8, 2)
    assert _decode_config(128, bf16, num_reqs=64, group=1) == (128, 8, 2)
    assert _decode_config(128, bf16, num_reqs=63, group=2) == (64, 4, 3)
    assert _decode_config(128, bf16, num_reqs=256, group=4) == (64, 4, 3)  # W3's heads
    assert _decode_config(128, bf16, f8, num_reqs=256, group=2) == (128, 4, 2)
    assert _decode_config(128, torch.float32, num_reqs=256, group=2) == (32, 4, 2)
    assert _decode_config(256, bf16, num_reqs=256, group=2) == (32, 4, 2)


@pytest.mark.parametrize("tiles", [(32, 4, 2), (128, 4, 2), (64, 8, 3), (128, 8, 2)])
def test_decode_tiles(tiles):
    """Other decode tile configurations (a tuning knob) give the same attention."""
    batch = make_paged_batch([(4, 1), (150, 1), (300, 1)], num_heads=8, num_kv_heads=2,
                             head_size=64, block_size=16, dtype=torch.bfloat16, seed=5)
    counters = split_counters(batch.num_reqs, 2, "cpu")
    out = _attend(batch, num_splits=2, split_counters=counters, decode_tiles=tiles)
    _check_attention(batch, out, torch.bfloat16)
    with pytest.raises(ValueError, match="decode_tiles must be"):
        _attend(batch, decode_tiles=(8, 4, 2))


def test_decode_tiles_option_is_checked():
    from lmkit_plugins.attention import TritonAttentionOptions
    from pydantic import ValidationError

    assert TritonAttentionOptions(decode_tiles=[128, 4, 2]).decode_tiles == (128, 4, 2)
    with pytest.raises(ValidationError, match="decode_tiles must be"):
        TritonAttentionOptions(decode_tiles=[100, 4, 2])


def test_head_size_not_power_of_two_and_default_splits():
    batch = make_paged_batch([(40, 1), (9, 1)], num_heads=4, num_kv_heads=4, head_size=80,
                             block_size=16, dtype=torch.float16, seed=2)
    _check_attention(batch, _attend(batch), torch.float16)
    batch = make_paged_batch([(40, 5), (0, 3)], num_heads=6, num_kv_heads=2, head_size=80,
                             block_size=16, seed=3)  # group of 3 (padded to 4)
    _check_attention(batch, _attend(batch), torch.float32)


def test_padding_rows_and_empty_requests():
    """Rows past the batch are untouched; a zero-length padding request gets zeros."""
    batch = make_paged_batch([(20, 1), (0, 0)], num_heads=2, num_kv_heads=1, head_size=64,
                             block_size=16, extra_rows=2, seed=4)
    assert batch.query_start_loc.tolist() == [0, 1, 1]  # the second owns no query row...
    out = torch.full_like(batch.q, 7.0)
    paged_attention(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens,
                    batch.block_tables, max_query_len=1, out=out, num_splits=2)
    _check_attention(batch, out, torch.float32)
    assert torch.all(out[1:] == 7.0)
    # ...or, in a padded decode batch, a row with seq_len 0: its output is zeros
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    seq_lens = torch.tensor([21, 0], dtype=torch.int32)
    paged_attention(batch.q, batch.kv_cache, qsl, seq_lens, batch.block_tables,
                    max_query_len=1, out=out, num_splits=2)
    assert torch.all(out[1] == 0.0)


def test_launcher_rejects_bad_arguments():
    batch = make_paged_batch([(5, 2)], num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    args = (batch.query_start_loc, batch.seq_lens, batch.block_tables)
    with pytest.raises(ValueError, match="kv_cache has dtype float16"):
        paged_attention(batch.q, batch.kv_cache.half(), *args, max_query_len=2)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention(batch.q[:, :3], batch.kv_cache, *args, max_query_len=2)
    with pytest.raises(ValueError, match="unit stride"):
        paged_attention(batch.q.transpose(1, 2).contiguous().transpose(1, 2), batch.kv_cache,
                        *args, max_query_len=2)
    with pytest.raises(ValueError, match="seq_lens has dtype int64"):
        paged_attention(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens.long(),
                        batch.block_tables, max_query_len=2)
    with pytest.raises(ValueError, match="num_splits must be a power of two"):
        paged_attention(batch.q, batch.kv_cache, *args, max_query_len=1, num_splits=3)
    with pytest.raises(ValueError, match=r"kv_cache must have shape \[2, \*, \*, \*, 64\]"):
        paged_attention(batch.q, batch.kv_cache[..., :32], *args, max_query_len=2)


# ---------------------------------------------------------------- KV-cache write


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32, 256])  # 256: FA2's pages
def test_reshape_and_cache(dtype, block_size):
    num_kv_heads, head_size, num_blocks = 3, 64, 6
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size).to(dtype)
    expected = kv_cache.clone()
    # k and v as strided views into a fused QKV output, two padding rows at the end
    qkv = torch.randn(9, 4 + 2 * num_kv_heads, head_size).to(dtype)
    key, value = qkv[:, 4:4 + num_kv_heads], qkv[:, 4 + num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size)[:7]
    slots[2] = -1  # a padding token: skipped
    reshape_and_cache(key, value, kv_cache, slots)
    reshape_and_cache_ref(key, value, expected, slots)
    assert torch.equal(kv_cache, expected)


def test_reshape_and_cache_rejects_bad_arguments():
    kv_cache = torch.zeros(2, 4, 16, 2, 64)
    key = torch.randn(3, 2, 64)
    with pytest.raises(ValueError, match="key must have shape"):
        reshape_and_cache(key[:, :1], key, kv_cache, torch.arange(3))
    with pytest.raises(ValueError, match="slot_mapping has 4 entries"):
        reshape_and_cache(key, key, kv_cache, torch.arange(4))
    with pytest.raises(ValueError, match="value has dtype float16"):
        reshape_and_cache(key, key.half(), kv_cache, torch.arange(3))


# ---------------------------------------------------------------- triton backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8_cache", [False, True])
def test_triton_backend_matches_torch_reference(dtype, fp8_cache):
    # decodes first, then a fresh prompt, a cached-prefix prompt and a chunk; padded rows
    reqs = [(30, 1), (70, 1), (0, 9), (33, 20), (100, 3)]
    kwargs = dict(num_heads=8, num_kv_heads=2, head_size=64, block_size=16)
    batch = make_paged_batch(reqs, dtype=dtype, extra_rows=3, table_width=12, seed=5, **kwargs)
    md = AttentionMetadata(**batch.metadata_kwargs())
    outputs, caches = [], []
    for cls in (TorchAttention, TritonAttention):
        backend = cls(scale=64 ** -0.5, dtype=dtype, device=torch.device("cpu"),
                      kv_cache_dtype=torch.float8_e4m3fn if fp8_cache else None, **kwargs)
        assert backend.kv_cache_shape(7) == (2, 7, 16, 2, 64)
        cache = batch.kv_cache.clone()
        if fp8_cache:  # an FP8 cache, read with scales 0.5 (keys) and 2 (values)
            backend.k_scale, backend.v_scale = 0.5, 2.0
            cache = torch.stack((cache[0] * 2, cache[1] / 2)).clamp(-448, 448).to(
                torch.float8_e4m3fn)
        backend.plan(md)
        outputs.append(backend.run(0, batch.q, batch.k, batch.v, cache))
        caches.append(cache.view(torch.uint8) if fp8_cache else cache)
    assert torch.equal(caches[0], caches[1])
    n = batch.num_tokens
    torch.testing.assert_close(outputs[1][:n].float(), outputs[0][:n].float(),
                               atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.all(outputs[1][n:] == 0)

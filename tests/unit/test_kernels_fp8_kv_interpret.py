"""An FP8 (e4m3) KV cache in lmkit_kernels' Triton kernels, in Triton's CPU interpreter:
the cache write quantizes (scaled, saturated, rounded to nearest even, bit for bit as
torch does) and decode and prefill read the stored values times their scales (against
the float32 reference over the dequantized cache). The ``triton`` backend over an FP8
cache against the torch reference: ``test_kernels_interpret.py``; the compiled kernels:
tests/gpu/test_fp8_kv_cache_gpu.py.
"""

from __future__ import annotations

import pytest
from interpret_mode import require_triton_interpreter

require_triton_interpreter("CUDA is available: compiled kernels are tested in tests/gpu (set "
                           "TRITON_INTERPRET=1 to run the interpreter tests here)")
torch = pytest.importorskip("torch")

from lmkit_kernels.cache_write import reshape_and_cache  # noqa: E402
from lmkit_kernels.fp8 import E4M3_MAX as FP8_MAX  # noqa: E402
from lmkit_kernels.paged_attention import paged_attention, split_counters  # noqa: E402
from lmkit_kernels.random_batch import make_paged_batch  # noqa: E402
from lmkit_kernels.reference import paged_attention_ref  # noqa: E402

FP8 = torch.float8_e4m3fn
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}


def _quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _fp8_cache(kv_cache: torch.Tensor, k_scale: float, v_scale: float) -> torch.Tensor:
    return torch.stack((_quantize(kv_cache[0], k_scale), _quantize(kv_cache[1], v_scale)))


def _dequantized(cache8: torch.Tensor, k_scale: float, v_scale: float,
                 dtype: torch.dtype) -> torch.Tensor:
    return torch.stack((cache8[0].float() * k_scale, cache8[1].float() * v_scale)).to(dtype)


def _check_fp8(batch, dtype, k_scale, v_scale, **kwargs):
    """The kernels over ``batch``'s cache in FP8 against the float32 reference over the
    values that cache holds."""
    cache8 = _fp8_cache(batch.kv_cache, k_scale, v_scale)
    out = paged_attention(batch.q, cache8, batch.query_start_loc, batch.seq_lens,
                          batch.block_tables, max_query_len=batch.max_query_len,
                          k_scale=k_scale, v_scale=v_scale, **kwargs)
    ref = paged_attention_ref(batch.q, _dequantized(cache8, k_scale, v_scale, dtype),
                              batch.query_start_loc, batch.seq_lens, batch.block_tables,
                              batch.q.shape[-1] ** -0.5)
    n = batch.num_tokens
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=TOL[dtype],
                               rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k_scale", "v_scale"), [(1.0, 1.0), (0.5, 1.7)])
def test_cache_write_quantizes_like_torch(dtype, k_scale, v_scale):
    num_kv_heads, head_size, block_size, num_blocks = 2, 64, 16, 5
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size, dtype=FP8)
    qkv = torch.randn(7, 4 + 2 * num_kv_heads, head_size) * 40  # some beyond +-448 / scale
    qkv[0, 4, :3] = torch.tensor([1e4, -1e4, 447.9])  # saturated, not inf or NaN
    qkv = qkv.to(dtype)
    key, value = qkv[:, 4:4 + num_kv_heads], qkv[:, 4 + num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size)[:6]
    slots[3] = -1  # padding: skipped (and the seventh row is past the step's tokens)
    reshape_and_cache(key, value, kv_cache, slots, k_scale, v_scale)
    expected = torch.zeros_like(kv_cache)
    keep = slots >= 0
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    expected[0, blocks, offsets] = _quantize(key[:6][keep], k_scale)
    expected[1, blocks, offsets] = _quantize(value[:6][keep], v_scale)
    assert torch.equal(kv_cache.view(torch.uint8), expected.view(torch.uint8))
    assert torch.isfinite(kv_cache.float()).all()
    assert kv_cache.float().abs().max() == FP8_MAX


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_reads_scaled_fp8(dtype, num_splits):
    k_scale, v_scale = 0.25, 1.7
    batch = make_paged_batch([(5, 1), (63, 1), (150, 1)], num_heads=8, num_kv_heads=2,
                             head_size=64, block_size=16, dtype=dtype, seed=3)
    _check_fp8(batch, dtype, k_scale, v_scale, num_splits=num_splits,
               split_counters=split_counters(3, 2, "cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_reads_scaled_fp8(dtype):
    k_scale, v_scale = 2.0, 0.6
    # a fresh prompt, one over a cached prefix, a chunk and a decode row mixed in
    batch = make_paged_batch([(0, 9), (33, 20), (100, 3), (40, 1)], num_heads=4,
                             num_kv_heads=2, head_size=64, block_size=16, dtype=dtype, seed=4)
    _check_fp8(batch, dtype, k_scale, v_scale)


def test_fp8_scales_change_the_result():
    # the control: the kernels must apply the scales, not just widen the bytes
    batch = make_paged_batch([(40, 1)], num_heads=4, num_kv_heads=2, head_size=64,
                             block_size=16, seed=5)
    cache8 = _fp8_cache(batch.kv_cache, 1.0, 1.0)
    args = (batch.q, cache8, batch.query_start_loc, batch.seq_lens, batch.block_tables)
    one = paged_attention(*args, max_query_len=1)
    halved = paged_attention(*args, max_query_len=1, v_scale=0.5)
    torch.testing.assert_close(halved, one * 0.5)
    sharper = paged_attention(*args, max_query_len=1, k_scale=3.0)
    assert not torch.allclose(sharper, one, atol=1e-3)


def test_launchers_refuse_mismatched_dtypes():
    q = torch.randn(3, 4, 64)
    batch = make_paged_batch([(8, 1)], num_heads=4, num_kv_heads=2, head_size=64,
                             block_size=16)
    with pytest.raises(ValueError, match="kv_cache"):
        paged_attention(q[:1], batch.kv_cache.half(), batch.query_start_loc, batch.seq_lens,
                        batch.block_tables, max_query_len=1)
    cache8 = torch.zeros(2, 4, 16, 2, 64, dtype=FP8)
    with pytest.raises(ValueError, match="value has dtype"):  # k/v: one float dtype
        reshape_and_cache(q[:, :2], q[:, :2].to(torch.int32), cache8, torch.arange(3))

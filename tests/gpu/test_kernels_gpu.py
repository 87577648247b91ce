"""lmkit_kernels' compiled Triton kernels on CUDA against their torch references.

Real shapes: long contexts (split-K decode), long prompts, head sizes 64/128/256, GQA
(32 query heads on 8 KV heads), bf16/fp16/fp32, and a
decode launch captured in a CUDA graph and replayed over longer contexts.
"""

from __future__ import annotations

import pytest
from gpu_only import require_cuda_and_triton

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
require_cuda_and_triton()

from lmkit_kernels.cache_write import reshape_and_cache  # noqa: E402
from lmkit_kernels.paged_attention import paged_attention, split_counters  # noqa: E402
from lmkit_kernels.random_batch import make_paged_batch  # noqa: E402
from lmkit_kernels.reference import (  # noqa: E402
    paged_attention_ref,
    reshape_and_cache_ref,
)

CUDA = torch.device("cuda")
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _check(batch, out, dtype):
    ref = paged_attention_ref(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens,
                              batch.block_tables, batch.q.shape[-1] ** -0.5)
    n = batch.num_tokens
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=TOL[dtype], rtol=TOL[dtype])


def _attend(batch, **kwargs):
    return paged_attention(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens,
                           batch.block_tables, max_query_len=batch.max_query_len, **kwargs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(32, 8), (8, 8)])
@pytest.mark.parametrize("num_splits", [None, 1, 16])
@pytest.mark.parametrize("merge_in_kernel", [False, True])
def test_decode(dtype, head_size, num_heads, num_kv_heads, num_splits, merge_in_kernel):
    reqs = [(0, 1), (15, 1), (16, 1), (777, 1), (2500, 1), (4095, 1)]
    batch = make_paged_batch(reqs, num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_size=head_size, block_size=16, dtype=dtype, device=CUDA)
    counters = split_counters(len(reqs), num_kv_heads, CUDA) if merge_in_kernel else None
    for _ in range(3):  # the counters come back to zero for the next launch
        _check(batch, _attend(batch, num_splits=num_splits, split_counters=counters), dtype)
    assert counters is None or torch.all(counters == 0)


def test_decode_merge_in_kernel_many_launches():
    """The one-launch merge under load: 64 requests x 16 slices, 50 launches back to
    back (a lost update or a stale partial would show as a wrong row)."""
    reqs = [(int(c), 1) for c in torch.randint(1, 3000, (64,), generator=torch.Generator()
                                               .manual_seed(4))]
    batch = make_paged_batch(reqs, num_heads=32, num_kv_heads=8, head_size=128,
                             block_size=16, dtype=torch.bfloat16, device=CUDA, seed=4)
    counters = split_counters(64, 8, CUDA)
    first = _attend(batch, num_splits=16, split_counters=counters)
    _check(batch, first, torch.bfloat16)
    torch.testing.assert_close(first, _attend(batch, num_splits=16), atol=2e-2, rtol=0)
    for _ in range(50):  # deterministic: every launch gives the same bits
        assert torch.equal(_attend(batch, num_splits=16, split_counters=counters), first)
    assert torch.all(counters == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_cached_prefix_chunks_and_decodes(dtype, head_size, block_size):
    # fresh prompts, prompts over cached prefixes, chunks of a chunked prefill, decodes
    reqs = [(0, 700), (512, 300), (1000, 64), (33, 1), (0, 1), (2000, 5), (100, 129)]
    batch = make_paged_batch(reqs, num_heads=32, num_kv_heads=8, head_size=head_size,
                             block_size=block_size, dtype=dtype, device=CUDA, seed=1)
    _check(batch, _attend(batch), dtype)


@pytest.mark.parametrize("tiles", [None, (64, 64, 4, 2), (128, 64, 8, 3), (128, 128, 8, 2),
                                   (64, 32, 4, 3)])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(16, 8), (32, 8)])
def test_prefill_tiles_gqa(tiles, num_heads, num_kv_heads):
    """Qwen3-0.6B (group 2) and Llama-8B (group 4) heads, the default and other tiles of
    bench/attention_prefill.py --sweep-tiles: long prompts, a cached prefix, a chunk."""
    reqs = [(0, 1024), (0, 100), (300, 517), (1000, 64), (0, 1)]
    batch = make_paged_batch(reqs, num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_size=128, block_size=16, dtype=torch.bfloat16, device=CUDA,
                             seed=5)
    _check(batch, _attend(batch, prefill_tiles=tiles), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_head_size_80_and_group_7(dtype):
    batch = make_paged_batch([(300, 1), (50, 40), (0, 17)], num_heads=28, num_kv_heads=4,
                             head_size=80, block_size=16, dtype=dtype, device=CUDA, seed=2)
    _check(batch, _attend(batch), dtype)


def test_decode_graph_replay_over_longer_contexts():
    """A decode launch captured with short contexts replays correctly with long ones."""
    kwargs = dict(num_heads=32, num_kv_heads=8, head_size=128, block_size=16,
                  dtype=torch.bfloat16, device=CUDA, num_blocks=2048, table_width=300)
    short = make_paged_batch([(10, 1)] * 8, **kwargs)
    long = make_paged_batch([(4000, 1), (10, 1), (2047, 1), (0, 1)] * 2, seed=3, **kwargs)
    out = torch.empty_like(short.q)
    args = (short.q, short.kv_cache, short.query_start_loc, short.seq_lens, short.block_tables)
    counters = split_counters(8, 8, CUDA)  # the merge in the decode kernel, replayed
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture
        paged_attention(*args, max_query_len=1, out=out, split_counters=counters)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(*args, max_query_len=1, out=out, split_counters=counters)
    for name in ("q", "kv_cache", "seq_lens", "block_tables"):
        getattr(short, name).copy_(getattr(long, name))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    _check(long, out, torch.bfloat16)
    assert torch.all(counters == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reshape_and_cache(dtype):
    num_blocks, block_size, num_kv_heads, head_size = 512, 16, 8, 128
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size,
                           device=CUDA).to(dtype)
    expected = kv_cache.clone()
    qkv = torch.randn(1000, 32 + 2 * num_kv_heads, head_size, device=CUDA).to(dtype)
    key, value = qkv[:, 32:32 + num_kv_heads], qkv[:, 32 + num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, device=CUDA)[:990]
    slots[::7] = -1
    reshape_and_cache(key, value, kv_cache, slots)
    reshape_and_cache_ref(key, value, expected, slots)
    assert torch.equal(kv_cache, expected)


# ---------------------------------------------------------------- fused layer kernels


def _differs_by_at_most_one_ulp_rarely(actual, expected):
    """Bit-equal but for a float32 reduction order: under 0.1% of elements differ, by
    one ulp where it rounded (a few where later ops, RoPE after a q/k norm, carry it)."""
    differ = actual != expected
    assert differ.float().mean().item() < 1e-3, f"{int(differ.sum())} elements differ"
    ulp = (2.0 ** -7 if actual.dtype == torch.bfloat16 else 2.0 ** -10)
    assert torch.all((actual.float() - expected.float()).abs()
                     <= 4 * ulp * expected.float().abs().clamp_min(1.0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotary_with_cache_write(dtype, qk_norm):
    """Llama-8B heads: RoPE in place equals the HF-rounded reference bit for bit (norms:
    up to a reduction-order ulp), and K/V land where reshape_and_cache puts them."""
    from lmkit_kernels.rotary import rotary_qk_, rotary_qk_ref

    heads, kv_heads, size, n = 32, 8, 128, 777
    gen = torch.Generator(device=CUDA).manual_seed(0)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * size, device=CUDA, generator=gen).to(dtype)
    pos = torch.randint(0, 100_000, (n,), device=CUDA, generator=gen).float()[:, None]
    freqs = pos * (1.0 / 500000.0 ** (torch.arange(0, size, 2, device=CUDA) / size))[None]
    cos = torch.cat((freqs.cos(), freqs.cos()), -1)[:, None].to(dtype)
    sin = torch.cat((-freqs.sin(), freqs.sin()), -1)[:, None].to(dtype)
    norms = {}
    if qk_norm:
        norms = {name: (1 + 0.2 * torch.randn(size, device=CUDA, generator=gen)).to(dtype)
                 for name in ("q_norm", "k_norm")}
    kw = dict(num_heads=heads, num_kv_heads=kv_heads, head_size=size, **norms)
    cache = torch.randn(2, 100, 16, kv_heads, size, device=CUDA, generator=gen).to(dtype)
    slots = torch.randperm(1600, device=CUDA, generator=gen)[:n - 5]  # 5 padding rows
    slots[::9] = -1
    out, written = qkv.clone(), cache.clone()
    rotary_qk_(out, cos, sin, kv_cache=written, slot_mapping=slots, **kw)
    expected = rotary_qk_ref(qkv, cos, sin, **kw)
    if qk_norm:
        _differs_by_at_most_one_ulp_rarely(out, expected)
    else:
        assert torch.equal(out, expected)
    rows = out.view(n, -1, size)
    reshape_and_cache_ref(rows[:, heads:heads + kv_heads], rows[:, heads + kv_heads:], cache,
                          slots)
    assert torch.equal(written, cache)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_layer_kernels_round_like_transformers(dtype):
    """The compiled kernels against transformers' own modules on the GPU: RoPE and the
    residual add bit for bit; RMSNorm and SiLU-and-multiply up to rare reduction-order ulps."""
    transformers = pytest.importorskip("transformers")
    from lmkit_kernels.activation import silu_and_mul
    from lmkit_kernels.norm import rms_norm
    from lmkit_kernels.rotary import rotary_qk_
    from transformers.models.llama import modeling_llama as hf

    gen = torch.Generator(device=CUDA).manual_seed(1)
    heads, kv_heads, size, n, hidden = 32, 8, 128, 300, 4096
    config = transformers.LlamaConfig(hidden_size=hidden, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, rope_theta=500000.0)
    positions = torch.arange(n, device=CUDA) * 37
    qkv = torch.randn(n, (heads + 2 * kv_heads) * size, device=CUDA, generator=gen).to(dtype)
    cos, sin = hf.LlamaRotaryEmbedding(config).to(CUDA)(qkv[None], positions[None])
    q = qkv[:, :heads * size].view(1, n, heads, size).transpose(1, 2)
    k = qkv[:, heads * size:(heads + kv_heads) * size].view(1, n, kv_heads, size).transpose(1, 2)
    q_hf, k_hf = hf.apply_rotary_pos_emb(q, k, cos, sin)
    sign = torch.cat((-torch.ones(size // 2), torch.ones(size // 2))).to(CUDA, dtype)
    out = qkv.clone()
    rotary_qk_(out, cos[0, :, None], sin[0, :, None] * sign, num_heads=heads,
               num_kv_heads=kv_heads, head_size=size)
    rotated = out.view(n, -1, size)
    assert torch.equal(rotated[:, :heads], q_hf[0].transpose(0, 1))
    assert torch.equal(rotated[:, heads:heads + kv_heads], k_hf[0].transpose(0, 1))

    x = (torch.randn(n, hidden, device=CUDA, generator=gen) * 3).to(dtype)
    res = (torch.randn(n, hidden, device=CUDA, generator=gen) * 5).to(dtype)
    norm = hf.LlamaRMSNorm(hidden, 1e-5).to(CUDA)
    norm.weight.data = 1 + 0.2 * torch.randn(hidden, device=CUDA, generator=gen)
    norm.to(dtype)
    with torch.no_grad():
        normed, summed = rms_norm(x, norm.weight.data, 1e-5, res)
        assert torch.equal(summed, res + x)
        _differs_by_at_most_one_ulp_rarely(normed, norm(res + x))
    gate, up = (torch.randn(2, n, 14336, device=CUDA, generator=gen) * 4).to(dtype)
    _differs_by_at_most_one_ulp_rarely(silu_and_mul(torch.cat((gate, up), -1)),
                                       torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_cos_sin_matches_the_torch_ops_bit_for_bit(dtype):
    from lmkit_kernels.rotary_cos_sin import rotary_cos_sin, rotary_cos_sin_ref

    inv_freq = (1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))).cuda()
    positions = torch.cat([torch.arange(0, 4096), torch.tensor([65535, 131071])]).cuda()
    cos, sin = rotary_cos_sin(positions, inv_freq, dtype)
    ref_cos, ref_sin = rotary_cos_sin_ref(positions, inv_freq, dtype)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


@pytest.mark.parametrize("rows", [1, 8, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_matches_torch_argmax(rows, dtype):
    from lmkit_kernels.argmax import argmax_rows

    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 128256, generator=g, device="cuda").to(dtype)
    x[0, [7, 90000]] = 100.0  # a tie across chunks: the first index
    if rows > 1:
        x[1, 5000] = float("nan")
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))

"""The C encoder attention kernel (``lmkit_kernels.cpu.encoder_attention``) and the
``cpu`` backend's encoder steps: every query of a request over all of that request's
keys, read in place from packed rows, against per-request SDPA in float32."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from lmkit_kernels.cpu.encoder_attention import (  # noqa: E402
    encoder_attention,
    encoder_attention_kernel,
    encoder_attention_unavailable_reason,
)
from lmkit_plugins.attention.cpu_backend import CpuAttention  # noqa: E402
from lmkit_plugins.attention.torch_ref import TorchAttention  # noqa: E402
from test_torch_attention import make_metadata  # noqa: E402

BF16, F32 = torch.bfloat16, torch.float32
TOL = {F32: 2e-6, BF16: 1e-2}  # bfloat16: the output's rounding (8 bits of mantissa)


@pytest.fixture
def kernel():
    if encoder_attention_kernel(F32) is None:
        pytest.skip(f"C encoder attention kernel not available: "
                    f"{encoder_attention_unavailable_reason()}")


def _fused_qkv(n, heads, kv_heads, d, dtype, seed=0):
    """q, k, v as the model passes them: head views of one fused projection's rows
    (plus 3 spare columns, so rows are not packed)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d + 3, generator=g).to(dtype)
    q = qkv[:, :heads * d].view(n, heads, d)
    k, v = (qkv[:, (heads + i * kv_heads) * d:(heads + (i + 1) * kv_heads) * d]
            .view(n, kv_heads, d) for i in range(2))
    return q, k, v


def _reference(q, k, v, lens, scale):
    """Per request, float32 SDPA over its own rows (query head h reads KV head h // g)."""
    group = q.shape[1] // k.shape[1]
    out, start = [], 0
    for n in lens:
        s = slice(start, start + n)
        qq, kk, vv = (x[s].float() for x in (q, k, v))
        kk, vv = (x.repeat_interleave(group, dim=1) for x in (kk, vv))
        out.append(torch.nn.functional.scaled_dot_product_attention(
            qq.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1),
            scale=scale).transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("heads,kv_heads,d", [(12, 12, 32), (4, 2, 64), (6, 1, 16)])
@pytest.mark.parametrize("lens", [[5, 30, 17, 1, 40, 16, 33], [1], [64, 65], [3] * 9])
def test_kernel_matches_per_request_sdpa(kernel, dtype, heads, kv_heads, d, lens):
    n = sum(lens)
    q, k, v = _fused_qkv(n, heads, kv_heads, d, dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    out = encoder_attention(q, k, v, cu, scale=d ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape and out.is_contiguous()
    ref = _reference(q, k, v, lens, d ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    if dtype == BF16:  # one rounding of a float32 result: as close as bfloat16 can be
        assert (out.float() - ref).abs().max() <= ref.abs().max() * 2 ** -8


def test_kernel_output_depends_on_neither_the_batch_nor_the_threads(kernel):
    q, k, v = _fused_qkv(50, 4, 4, 32, BF16)
    both = encoder_attention(q, k, v, torch.tensor([0, 20, 50]), scale=0.2)
    alone = encoder_attention(q[20:], k[20:], v[20:], torch.tensor([0, 30]), scale=0.2)
    assert torch.equal(both[20:], alone)
    q, k, v = _fused_qkv(300, 8, 8, 32, BF16)  # enough work for two threads
    cu = torch.tensor([0, 100, 300])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = encoder_attention(q, k, v, cu, scale=0.2)
        torch.set_num_threads(2)
        two = encoder_attention(q, k, v, cu, scale=0.2)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_kernel_refuses_inputs_it_cannot_read(kernel):
    q, k, v = _fused_qkv(8, 2, 2, 16, F32)
    cu = torch.tensor([0, 8])
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        encoder_attention(q.half(), k.half(), v.half(), cu, scale=1.0)
    with pytest.raises(ValueError, match="k must be a torch.float32 CPU tensor"):
        encoder_attention(q, k.to(BF16), v, cu, scale=1.0)
    with pytest.raises(ValueError, match="heads must be contiguous"):
        encoder_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, cu, scale=1.0)
    with pytest.raises(ValueError, match="rise from 0 to at most 8"):
        encoder_attention(q, k, v, torch.tensor([0, 9]), scale=1.0)
    with pytest.raises(ValueError, match="int64"):
        encoder_attention(q, k, v, cu.int(), scale=1.0)
    q3, k3, v3 = _fused_qkv(8, 2, 2, 24, F32)  # head size not a multiple of 16
    with pytest.raises(ValueError, match="multiple of 16"):
        encoder_attention(q3, k3, v3, cu, scale=1.0)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("lens", [[5, 3, 1], [9, 1, 4, 4, 7, 2, 3, 8, 5, 6, 2], [16, 16]])
def test_cpu_backend_encoder_steps_match_the_reference(kernel, dtype, lens):
    kw = dict(num_heads=4, num_kv_heads=2, head_size=16, scale=0.25, dtype=dtype,
              device=torch.device("cpu"), block_size=4, causal=False)
    cpu, ref = CpuAttention(**kw), TorchAttention(**kw)
    tables = [[1 + 10 * i + j for j in range(10)] for i in range(len(lens))]
    md = make_metadata([(0, n) for n in lens], 4, tables)
    cpu.plan(md)
    ref.plan(md)
    assert cpu._encoder is not None  # the kernel's step, not the reference's groups
    q, k, v = _fused_qkv(sum(lens), 4, 2, 16, dtype)
    cache = torch.zeros(cpu.kv_cache_shape(10 * len(lens) + 1), dtype=dtype)
    out = cpu.run(0, q, k, v, cache)
    expected = ref.run(0, q, k, v, cache.clone())
    torch.testing.assert_close(out.float(), expected.float(), atol=TOL[dtype] * 2,
                               rtol=TOL[dtype] * 2)
    # head views the kernel cannot read: the reference path, same result
    q2 = q.transpose(1, 2).contiguous().transpose(1, 2)
    torch.testing.assert_close(cpu.run(0, q2, k, v, cache).float(), expected.float(),
                               atol=TOL[dtype] * 2, rtol=TOL[dtype] * 2)

"""The fused layer kernels (RMSNorm with residual add, SiLU-and-multiply, q/k norm +
RoPE) against their torch references, in Triton's CPU interpreter at tiny shapes.

The interpreter is made to round bfloat16 to nearest like the GPU
(:mod:`lmkit_kernels.interpreter`). RoPE without a norm is compared bit for bit; where
a float32 sum is reduced in another order (norms, ``exp``) half precision is compared
within one unit in the last place, float32 near exactly. The compiled kernels run on
CUDA in tests/gpu (test_kernels_gpu.py, and whole models in test_engine_gpu.py);
tests/unit/test_kernels_hf_numerics.py checks the rounding against transformers.
"""

from __future__ import annotations

import pytest
from interpret_mode import require_triton_interpreter

require_triton_interpreter("CUDA is available: compiled kernels are tested in tests/gpu")
torch = pytest.importorskip("torch")

from lmkit_kernels.activation import silu_and_mul, silu_and_mul_ref  # noqa: E402
from lmkit_kernels.interpreter import bf16_round_to_nearest  # noqa: E402
from lmkit_kernels.norm import rms_norm, rms_norm_ref  # noqa: E402
from lmkit_kernels.rotary import rotary_qk_, rotary_qk_ref  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def gpu_rounding():
    """bfloat16 rounds to nearest even in the interpreter, as on the GPU."""
    with bf16_round_to_nearest() as patched:
        yield patched


def _close(actual, expected, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    else:  # one unit in the last place
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
        torch.testing.assert_close(actual.float(), expected.float(), atol=ulp, rtol=ulp)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, with_residual):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 80, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(80, generator=g)).to(dtype)
    res = torch.randn(7, 80, generator=g).to(dtype) if with_residual else None
    x_before = x.clone()
    out = rms_norm(x, w, 1e-5, res)
    ref = rms_norm_ref(x, w, 1e-5, res)
    if with_residual:
        _close(out[0], ref[0], dtype)
        _close(out[1], ref[1], dtype)
    else:
        _close(out, ref, dtype)
    assert torch.equal(x, x_before)  # inputs are not modified


def test_rms_norm_strided_rows():
    x = torch.randn(4, 64)
    view = x[:, :32]  # row stride 64, unit last stride
    w = torch.rand(32) + 0.5
    _close(rms_norm(view, w, 1e-6), rms_norm_ref(view, w, 1e-6), torch.float32)


def test_rms_norm_rejects_bad_weight():
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(torch.randn(2, 16), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="weight has dtype"):
        rms_norm(torch.randn(2, 16), torch.ones(16, dtype=torch.float64), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype):
    gate_up = torch.randn(5, 2 * 1100, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = silu_and_mul(gate_up)
    assert out.shape == (5, 1100)
    _close(out, silu_and_mul_ref(gate_up), dtype)


def test_silu_and_mul_rejects_odd_width():
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.randn(2, 7))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [32, 16])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotary_qk_matches_reference(dtype, rotary_dim, qk_norm, gpu_rounding):
    g = torch.Generator().manual_seed(2)
    heads, kv_heads, size, n = 6, 2, 32, 5
    qkv = torch.randn(n, (heads + 2 * kv_heads) * size, generator=g).to(dtype)
    pos = torch.arange(n, dtype=torch.float32)[:, None] * 0.37
    freqs = pos * torch.linspace(1.0, 0.01, rotary_dim // 2)[None, :]
    cos = torch.cat((freqs.cos(), freqs.cos()), -1)[:, None, :].to(dtype)
    sin = torch.cat((-freqs.sin(), freqs.sin()), -1)[:, None, :].to(dtype)
    norms = {}
    if qk_norm:
        norms = {"q_norm": (1 + 0.2 * torch.randn(size, generator=g)).to(dtype),
                 "k_norm": (1 + 0.2 * torch.randn(size, generator=g)).to(dtype)}
    kw = dict(num_heads=heads, num_kv_heads=kv_heads, head_size=size, eps=1e-6, **norms)
    expected = rotary_qk_ref(qkv, cos, sin, **kw)
    actual = qkv.clone()
    rotary_qk_(actual, cos, sin, **kw)
    if qk_norm or dtype == torch.float32:
        _close(actual, expected, dtype)
    elif gpu_rounding:  # no reduction: the same roundings give the same bits
        assert torch.equal(actual, expected)
    v_start = (heads + kv_heads) * size
    assert torch.equal(actual[:, v_start:], qkv[:, v_start:])  # value heads untouched


def test_rotary_qk_checks_arguments():
    qkv = torch.randn(3, (4 + 2 * 2) * 16)
    cos = torch.ones(3, 1, 16)
    with pytest.raises(ValueError, match="columns"):
        rotary_qk_(qkv, cos, cos, num_heads=4, num_kv_heads=1, head_size=16)
    with pytest.raises(ValueError, match="both q_norm and k_norm"):
        rotary_qk_(qkv, cos, cos, num_heads=4, num_kv_heads=2, head_size=16,
                   q_norm=torch.ones(16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_small_m_linear_matches_reference(dtype, rows):
    from lmkit_kernels.gemv import small_m_linear, small_m_linear_ref

    g = torch.Generator().manual_seed(4)
    x = torch.randn(rows, 200, generator=g).to(dtype)
    w = torch.randn(70, 200, generator=g).to(dtype)
    b = torch.randn(70, generator=g).to(dtype)
    for bias in (None, b):
        out = small_m_linear(x, w, bias, block_n=16, block_k=64)
        ref = small_m_linear_ref(x, w, bias)
        assert out.shape == (rows, 70)
        scale = ref.float().abs().max()
        assert (out.float() - ref.float()).abs().max() <= 1e-2 * scale


def test_small_m_linear_rejects_large_batches():
    from lmkit_kernels.gemv import small_m_linear

    with pytest.raises(ValueError, match="at most 16 rows"):
        small_m_linear(torch.randn(17, 8, dtype=torch.bfloat16),
                       torch.randn(4, 8, dtype=torch.bfloat16))

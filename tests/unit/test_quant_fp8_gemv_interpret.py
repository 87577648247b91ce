"""FP8 kernels in Triton's CPU interpreter: the weight-streaming GEMV with FP8 weights
and per-channel scales (:func:`lmkit_kernels.gemv.small_m_linear` with
``weight_scale``; the interpreter converts e4m3 loads like the GPU) against its torch
reference :func:`lmkit_kernels.fp8.fp8_linear_ref`, and its argument checks; the
per-token activation quantization kernel (:mod:`lmkit_kernels.fp8_quant`) bit for bit
against :func:`lmkit_kernels.fp8.quantize_per_token_ref` (with the interpreter's e4m3
stores rounded as the GPU rounds: :func:`lmkit_kernels.interpreter.fp8_round_to_nearest`)."""

from __future__ import annotations

import pytest
from interpret_mode import require_triton_interpreter

require_triton_interpreter()
torch = pytest.importorskip("torch")

from lmkit_kernels.fp8 import fp8_linear_ref, quantize_per_channel  # noqa: E402
from lmkit_kernels.gemv import small_m_linear  # noqa: E402
from lmkit_kernels.interpreter import fp8_round_to_nearest  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_fp8_gemv_matches_the_reference(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(70, 200, generator=g) * torch.logspace(-2, 0, 70)[:, None]
    q, scale = quantize_per_channel(w)
    x = torch.randn(rows, 200, generator=g).to(dtype)
    b = torch.randn(70, generator=g).to(dtype)
    for bias in (None, b):
        out = small_m_linear(x, q, bias, block_n=16, block_k=64, weight_scale=scale)
        ref = fp8_linear_ref(x, q, scale, bias)
        assert out.shape == (rows, 70) and out.dtype == dtype
        # float32 sums in another order, one rounding to the output dtype
        assert (out.float() - ref.float()).abs().max() <= 1e-2 * ref.float().abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("block_n", "block_k"), [(16, 64), (32, 128), (8, 256)])
def test_one_row_kernel_matches_the_reference(dtype, block_n, block_k):
    from lmkit_kernels.fp8_gemv import fp8_row_linear

    g = torch.Generator().manual_seed(block_n)
    w = torch.randn(70, 200, generator=g) * torch.logspace(-2, 0, 70)[:, None]
    q, scale = quantize_per_channel(w)  # 70 rows, K = 200: partial row and K blocks
    x = torch.randn(1, 200, generator=g).to(dtype)
    b = torch.randn(70, generator=g).to(dtype)
    for bias in (None, b):
        out = fp8_row_linear(x, q, scale, bias, block_n=block_n, block_k=block_k)
        ref = fp8_linear_ref(x, q, scale, bias)
        assert out.shape == (1, 70) and out.dtype == dtype
        assert (out.float() - ref.float()).abs().max() <= 1e-2 * ref.float().abs().max()
        tiled = small_m_linear(x, q, bias, block_n=16, block_k=64, weight_scale=scale)
        assert (out.float() - tiled.float()).abs().max() <= 1e-2 * ref.float().abs().max()


def test_one_row_kernel_refuses_what_it_cannot_run():
    from lmkit_kernels.fp8_gemv import fp8_row_linear

    q, scale = quantize_per_channel(torch.randn(32, 64))
    with pytest.raises(ValueError, match="takes one row, got 2; use small_m_linear"):
        fp8_row_linear(torch.randn(2, 64, dtype=torch.bfloat16), q, scale)
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="weight has dtype bfloat16"):
        fp8_row_linear(x, q.bfloat16(), scale)
    with pytest.raises(ValueError, match=r"weight_scale must have shape \[32\]"):
        fp8_row_linear(x, q, scale[:8])
    with pytest.raises(ValueError, match="block_k must be a power of two, got 100"):
        fp8_row_linear(x, q, scale, block_k=100)


def test_fp8_weights_need_their_scales():
    q, scale = quantize_per_channel(torch.randn(32, 64))
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="weight has dtype float8_e4m3fn; expected one of: "
                                         "bfloat16"):
        small_m_linear(x, q)
    with pytest.raises(ValueError, match=r"weight_scale must have shape \[32\]"):
        small_m_linear(x, q, weight_scale=scale[:16])
    with pytest.raises(ValueError, match="weight_scale has dtype bfloat16"):
        small_m_linear(x, q, weight_scale=scale.bfloat16())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k", [64, 200, 5000])  # one block, a partial one, several
def test_per_token_quantization_kernel_matches_the_reference(dtype, k):
    from lmkit_kernels.fp8 import E4M3_MAX, MIN_SCALE, quantize_per_token_ref
    from lmkit_kernels.fp8_quant import quantize_per_token_triton

    g = torch.Generator().manual_seed(k)
    x = (torch.randn(6, k, generator=g) * torch.tensor([1e-4, 1, 3, 100, 0, 7])[:, None])
    x = x.to(dtype)
    with fp8_round_to_nearest() as patched:  # the interpreter's own e4m3 rounding is off
        if not patched:
            pytest.skip("this Triton's interpreter has no conversion hook to patch")
        xq, scale = quantize_per_token_triton(x, max_value=E4M3_MAX, min_scale=MIN_SCALE)
    want_q, want_scale = quantize_per_token_ref(x)
    assert xq.dtype == torch.float8_e4m3fn and scale.shape == (6, 1)
    assert torch.equal(scale, want_scale)
    assert torch.equal(xq.float(), want_q.float())

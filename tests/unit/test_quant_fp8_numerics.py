"""FP8 numerics on the CPU: per-channel quantization (the scale is ``max|row| / 448``,
round-trip error within one e4m3 rounding), block and per-token quantization, the
references of the two products (weight-only for decode, W8A8 through ``_scaled_mm``
above), the method's ``fuse``/``dequantize``/``linear`` (the quantization conformance
suite on a dense checkpoint quantized at load), and the launchers' argument checks."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from lmkit.testing.quantization import check_quantization_method  # noqa: E402
from lmkit_kernels.fp8 import (  # noqa: E402
    E4M3_MAX,
    MIN_SCALE,
    dequantize_fp8,
    fp8_linear_ref,
    quantize_per_block,
    quantize_per_channel,
    quantize_per_token,
    scaled_mm_linear,
    scaled_mm_ref,
    scaled_mm_unsupported_reason,
)
from lmkit_plugins.quantization.fp8_checkpoint import Fp8Weight, quantized  # noqa: E402
from lmkit_plugins.quantization.fp8_cuda import Fp8Linear, Fp8Method  # noqa: E402


def _weight(n: int = 96, k: int = 160, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # rows of very different magnitudes: per-channel scales matter
    return torch.randn(n, k, generator=g) * torch.logspace(-5, 1, n)[:, None]


def _one_rounding(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Whether each value is within one e4m3 rounding: 2^-4 relative (3 mantissa bits),
    half the subnormal step (2^-10 of the row's scale) near zero."""
    return (got - want).abs() <= torch.maximum(want.abs() / 16, scale[:, None] / 1024) * 1.0001


def test_per_channel_scales_map_each_row_maximum_to_448():
    w = _weight()
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert torch.allclose(scale, w.abs().amax(dim=1) / E4M3_MAX)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((w.shape[0],), E4M3_MAX))
    assert _one_rounding(dequantize_fp8(q, scale), w, scale).all()


def test_per_channel_round_trip_error_is_small_for_every_row_size():
    w = _weight()
    q, scale = quantize_per_channel(w)
    error = (dequantize_fp8(q, scale) - w).norm(dim=1) / w.norm(dim=1)
    assert float(error.max()) < 0.04  # ~2-3% rms for Gaussian rows
    # one scale for all (e4m3 spans 2^-9..448): the smallest rows flush to zero
    qt, st = quantize_per_channel(w.reshape(1, -1))
    tensor_error = (dequantize_fp8(qt, st).view_as(w) - w).norm(dim=1) / w.norm(dim=1)
    assert float(tensor_error[0]) > 0.5


def test_zero_rows_quantize_to_zero():
    w = torch.zeros(4, 32)
    w[1] = 1.0
    q, scale = quantize_per_channel(w)
    assert scale[0] == torch.tensor(MIN_SCALE) and torch.equal(q.float()[0], torch.zeros(32))
    assert torch.equal(dequantize_fp8(q, scale), w)


def test_block_quantization_scales_each_block():
    w = _weight(70, 100)
    q, scale = quantize_per_block(w, (32, 64))
    assert scale.shape == (3, 2) and q.shape == w.shape
    grid = scale.repeat_interleave(32, 0)[:70].repeat_interleave(64, 1)[:, :100]
    assert torch.allclose(scale[2, 1], w[64:, 64:].abs().max() / E4M3_MAX)
    assert _one_rounding(q.float() * grid, w, grid.amax(dim=1)).all()


def test_per_token_activation_scales():
    x = torch.randn(5, 64) * torch.tensor([1e-3, 1, 10, 100, 0])[:, None]
    before = x.clone()
    xq, scale = quantize_per_token(x)
    assert torch.equal(x, before)  # the input is left alone (float32 included)
    assert scale.shape == (5, 1)
    assert torch.allclose(scale[:4, 0], x[:4].abs().amax(dim=1) / E4M3_MAX)
    assert torch.equal(xq.float()[4], torch.zeros(64))


def test_the_two_product_references():
    g = torch.Generator().manual_seed(1)
    w = _weight(48, 256)
    q, scale = quantize_per_channel(w)
    x = torch.randn(20, 256, generator=g).bfloat16()
    bias = torch.randn(48, generator=g).bfloat16()
    exact = x.float() @ dequantize_fp8(q, scale).T + bias.float()
    weight_only = fp8_linear_ref(x, q, scale, bias)
    w8a8 = scaled_mm_ref(x, q, scale, bias)
    top = exact.abs().max()
    assert weight_only.dtype == w8a8.dtype == torch.bfloat16
    assert (weight_only.float() - exact).abs().max() <= 0.01 * top  # bf16 output rounding
    assert (w8a8.float() - exact).abs().max() <= 0.05 * top  # + e4m3 activations


def test_fuse_concatenates_rows_and_scales():
    method = Fp8Method.__new__(Fp8Method)  # fuse and dequantize use no model facts
    a, b = (quantized(Fp8Weight(*quantize_per_channel(_weight(n, 64, s))))
            for n, s in ((32, 1), (16, 2)))
    fused = method.fuse([a, b])
    assert fused.shape == (48, 64) and fused.qtype == "F8_E4M3"
    assert torch.equal(method.dequantize(fused),
                       torch.cat([method.dequantize(a), method.dequantize(b)]))
    rows = torch.tensor([47, 0, 20])
    assert torch.equal(method.dequantize(fused, rows), method.dequantize(fused)[rows])
    other = quantized(Fp8Weight(*quantize_per_channel(_weight(8, 32))))
    assert method.fuse([a, other]) is None  # different widths


def test_cpu_linear_runs_the_references_by_row_count():
    q, scale = quantize_per_channel(_weight(32, 64))
    linear = Fp8Linear(Fp8Weight(q, scale), max_rows=16, block_k=512)
    assert not linear.on_cuda and linear.scaled_mm_unsupported is None
    x = torch.randn(40, 64).bfloat16()
    assert torch.equal(linear(x[:16], None), fp8_linear_ref(x[:16], q, scale))
    assert torch.equal(linear(x, None), scaled_mm_ref(x, q, scale))


@pytest.mark.slow  # every property on a tiny model: about 5 s here
def test_the_method_passes_the_quantization_conformance_suite():
    """On a dense tiny checkpoint quantized at load (the suite compares with the dense
    weights, so FP8 checkpoints are checked in test_quant_fp8_checkpoint.py)."""
    results = check_quantization_method(Fp8Method)
    # the folds are CUDA kernels: on the CPU linear_with_norm / linear_with_silu_mul give
    # no folded function, which the suite accepts
    assert set(results.values()) == {"passed"}


def test_scaled_mm_launcher_checks_its_arguments():
    q, scale = quantize_per_channel(_weight(32, 64))
    assert "runs on CUDA" in scaled_mm_unsupported_reason(q)
    with pytest.raises(ValueError, match="x has dtype float32; expected one of: float16"):
        scaled_mm_linear(torch.randn(4, 64), q, scale.view(1, -1))
    with pytest.raises(ValueError, match=r"scale_row must have shape \[1, 32\]"):
        scaled_mm_linear(torch.randn(4, 64).bfloat16(), q, scale.view(-1, 1))

"""``Linear.forward_gelu`` and ``Linear.forward_add`` (the encoder layer's projections
with the GELU or the residual add fused into oneDNN's matmul as a post-op on the CPU)
compute what the unfused ``F.gelu(forward(x))`` and ``forward(x) + other`` compute."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from lmkit_plugins.models.layers import Linear  # noqa: E402

CPU = torch.device("cpu")
# float32 is within matmul reordering of the unfused result; bfloat16 differs by the
# rounding of the unfused matmul's output that the post-op skips
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2}}


def _linear(dtype: torch.dtype, in_features: int = 96, out: int = 160) -> Linear:
    g = torch.Generator().manual_seed(0)
    layer = Linear(in_features, {"weight": out}, bias=True, dtype=dtype, device=CPU)
    layer.load_shard("weight", torch.randn(out, in_features, generator=g).to(dtype) / 8,
                     torch.randn(out, generator=g).to(dtype))
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 8, 33, 200])  # the row-GEMV kernel's sizes and above
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_forward_gelu_equals_gelu_of_forward(dtype, rows, approximate):
    layer = _linear(dtype)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = layer.forward_gelu(x, approximate)
    want = F.gelu(layer.forward(x).float(), approximate=approximate)
    assert got.shape == (rows, 160) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 8, 33, 200])
def test_forward_add_equals_forward_plus_residual(dtype, rows):
    layer = _linear(dtype)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    residual = torch.randn(rows, 160, generator=g).to(dtype)
    before = residual.clone()
    got = layer.forward_add(x, residual)
    want = layer.forward(x).float() + residual.float()
    assert got.shape == (rows, 160) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, **TOL[dtype])
    assert torch.equal(residual, before)  # the residual is read, not written to


def test_forward_add_of_a_padded_layer_falls_back_to_the_plain_add():
    # 512 output columns get a padded [in, 544] weight memory without the C kernel; the
    # post-op path only takes unpadded weights, the result is the same either way
    layer = _linear(torch.float32, out=512)
    x = torch.randn(64, 96)
    residual = torch.randn(64, 512)
    torch.testing.assert_close(layer.forward_add(x, residual), layer.forward(x) + residual)


def test_forward_add_of_a_strided_or_other_dtype_residual_equals_the_plain_add():
    layer = _linear(torch.float32)
    x = torch.randn(64, 96)
    wide = torch.randn(64, 320)
    for residual in (wide[:, ::2], torch.randn(64, 160, dtype=torch.float64)):
        torch.testing.assert_close(layer.forward_add(x, residual), layer.forward(x) + residual)

"""The quantized GEMV with its input transform folded in (``qgemv_fold``): the folded
residual add + RMSNorm gives the same bits as lmkit's RMSNorm kernel then the plain
quantized GEMV (with and without a residual, strided inputs, every batch size it takes),
the folded SiLU-and-multiply the same bits as torch's ``F.silu(gate) * up`` then the GEMV."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from lmkit_kernels.cpu.qgemv import (  # noqa: E402
    MAX_ROWS,
    QTYPES,
    bind_linear,
    pack_weight,
    qgemv_isa,
    random_blocks,
)
from lmkit_kernels.cpu.qgemv_fold import bind_norm_linear  # noqa: E402
from lmkit_kernels.cpu.rms_norm import rms_norm_kernel  # noqa: E402


@pytest.fixture(autouse=True)
def _kernels():
    if not qgemv_isa() or rms_norm_kernel() is None:
        pytest.skip("the C kernels do not build here")


@pytest.mark.parametrize("qname", sorted(QTYPES))
@pytest.mark.parametrize("m", [1, 3, 5, MAX_ROWS])
@pytest.mark.parametrize("with_residual", [False, True])
def test_folded_norm_is_bit_identical_to_norm_then_gemv(qname, m, with_residual):
    qtype, k, n = QTYPES[qname], 576, 150
    gen = torch.Generator().manual_seed(m)
    w = pack_weight(qtype, random_blocks(qtype, n, k, gen), k)
    x = torch.randn(m, k + 64, generator=gen)[:, :k] * 3  # rows further apart than k
    residual = torch.randn(m, k, generator=gen) if with_residual else None
    norm_w = torch.rand(k, generator=gen) + 0.5
    bias = torch.randn(n, generator=gen)
    normed = rms_norm_kernel()(x.contiguous(), residual, norm_w, 1e-5)
    if residual is not None:
        normed, summed = normed
    y, h = bind_norm_linear(w)(x, residual, norm_w, 1e-5, bias)
    assert torch.equal(y, bind_linear(w)(normed, bias))
    if residual is None:
        assert h is x
    else:
        assert torch.equal(h, summed) and torch.equal(h, x + residual)


@pytest.mark.parametrize("qname", sorted(QTYPES))
@pytest.mark.parametrize("m", [1, 3, MAX_ROWS])
def test_folded_silu_is_bit_identical_to_torch_silu_then_gemv(qname, m):
    from lmkit_kernels.cpu.qgemv_fold import bind_silu_linear

    qtype, k, n = QTYPES[qname], 1536, 100
    gen = torch.Generator().manual_seed(m)
    w = pack_weight(qtype, random_blocks(qtype, n, k, gen), k)
    fn = bind_silu_linear(w)
    if fn is None:
        pytest.skip("torch does not run its AVX-512 silu here (or no AVX-512 VNNI build)")
    gate_up = torch.randn(m, 2 * k + 32, generator=gen)[:, :2 * k] * 4  # strided rows
    gate_up[0, :8] = torch.tensor([-100.0, -88.0, -20.0, -1e-8, 0.0, 20.0, 88.0, 100.0])
    bias = torch.randn(n, generator=gen)
    act = torch.nn.functional.silu(gate_up[:, :k]) * gate_up[:, k:]
    assert torch.equal(fn(gate_up, bias), bind_linear(w)(act.contiguous(), bias))

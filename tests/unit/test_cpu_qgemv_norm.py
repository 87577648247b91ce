"""The quantized GEMV with the residual add + RMSNorm folded in (``qgemv_norm``): the
same bits as lmkit's RMSNorm kernel followed by the plain quantized GEMV, with and
without a residual, for strided inputs and every batch size it takes."""

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
from lmkit_kernels.cpu.qgemv_norm import bind_norm_linear  # noqa: E402
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

"""``Linear.forward_add_rms_norm`` / ``forward_silu_mul`` over a quantized weight: the
folded kernel for decode-sized inputs and the two separate steps for larger ones give
the same bits as norm-then-forward / silu-then-forward at every size."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from lmkit.api import QuantizedTensor  # noqa: E402
from lmkit_kernels.cpu.qgemv import (  # noqa: E402
    QTYPES,
    bind_linear,
    pack_weight,
    qgemv_isa,
    random_blocks,
)
from lmkit_kernels.cpu.qgemv_fold import bind_norm_linear, bind_silu_linear  # noqa: E402
from lmkit_plugins.models.layers import Linear, RMSNorm, silu_and_mul  # noqa: E402

pytestmark = pytest.mark.skipif(not qgemv_isa(), reason="the C quantized kernel does not build")


class _Method:
    """The parts of a quantization method a Linear uses, over lmkit's Q4_1 kernels."""

    supports_norm_linear = supports_silu_mul_linear = True
    fold_max_rows = 32

    def fuse(self, parts):
        return parts[0]

    def _packed(self, w):
        return pack_weight(QTYPES[w.qtype], w.data, w.shape[1])

    def linear(self, w):
        return bind_linear(self._packed(w))

    def linear_with_norm(self, w):
        p = self._packed(w)
        return bind_linear(p), bind_norm_linear(p)

    def linear_with_silu_mul(self, w):
        p = self._packed(w)
        return bind_linear(p), bind_silu_linear(p)


def _linear(k: int, n: int, fold: str) -> Linear:
    gen = torch.Generator().manual_seed(k)
    layer = Linear(k, {"weight": n}, bias=True, dtype=torch.float32,
                   device=torch.device("cpu"), quantization=_Method(), fold=fold)
    raw = random_blocks(QTYPES["Q4_1"], n, k, gen)
    layer.load_shard("weight", QuantizedTensor(raw, "Q4_1", (n, k)), torch.randn(n, generator=gen))
    return layer


@pytest.mark.parametrize("rows", [1, 5, 32, 40])
def test_norm_fold_matches_norm_then_forward(rows):
    layer = _linear(576, 96, "norm")
    assert layer._qnorm is not None
    norm = RMSNorm(576, 1e-5, dtype=torch.float32, device=torch.device("cpu"))
    norm.weight.data.uniform_(0.5, 1.5)
    x, residual = torch.randn(rows, 576), torch.randn(rows, 576)
    y, h = layer.forward_add_rms_norm(x, residual, norm)
    normed, summed = norm.forward(x, residual)
    assert torch.equal(h, summed) and torch.equal(y, layer.forward(normed))
    y, h = layer.forward_add_rms_norm(x, None, norm)
    assert h is x and torch.equal(y, layer.forward(norm.forward(x)))


@pytest.mark.parametrize("rows", [1, 5, 32, 40])
def test_silu_fold_matches_silu_then_forward(rows):
    layer = _linear(1536, 64, "silu_mul")
    gate_up = torch.randn(rows, 3072) * 3
    assert torch.equal(layer.forward_silu_mul(gate_up), layer.forward(silu_and_mul(gate_up)))


def test_only_the_requested_fold_is_built():
    assert _linear(576, 32, "silu_mul")._qnorm is None
    assert _linear(576, 32, "norm")._qsilu is None

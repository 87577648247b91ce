"""The C q-GEMV's k-quants (``Q4_K``, ``Q6_K``; ``qgemv_k.c``) against the ``gguf``
package's dequantization and a float64 matmul: random super-blocks (every quant, scale
and min byte random, so the ends of the integer ranges occur), extreme fp16 scales, odd
row counts, batches on both sides of the dequantize-tile switch, several threads, and
the AVX2 and AVX-512 VNNI builds agreeing. Activations are quantized per 256 to Q8_K as
in llama.cpp, so the exact reference applies the same rounding to ``x`` first."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
from lmkit_kernels.cpu.kquants import (  # noqa: E402
    KQTYPES,
    QK_K,
    quantize_k,
    random_kblocks,
    reference_dequantize_k,
)
from lmkit_kernels.cpu.qgemv import (  # noqa: E402
    MAX_ROWS,
    dequantize_packed,
    dequantize_rows,
    pack_weight,
    qgemv_isa,
    qgemv_linear,
    qgemv_unavailable_reason,
    qgemv_variants,
)

pytestmark = pytest.mark.skipif(not qgemv_isa(), reason=qgemv_unavailable_reason() or "-")
TYPES = sorted(KQTYPES.items())


def _gguf_dequant(name: str, raw: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[name]))


def _q8k(x: torch.Tensor) -> torch.Tensor:
    """``x`` after llama.cpp's Q8_K rounding, as the kernel computes it (float32 scale
    amax / 127, its float32 reciprocal, round half to even)."""
    b = x.reshape(x.shape[0], -1, QK_K)
    d = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return ((b * inv).round() * d).reshape(x.shape)


@pytest.mark.parametrize(("name", "qtype"), TYPES)
def test_reference_layout_is_the_gguf_packages(name, qtype):
    raw = random_kblocks(qtype, 9, 3 * QK_K, torch.Generator().manual_seed(qtype))
    assert torch.equal(reference_dequantize_k(qtype, raw, 3 * QK_K), _gguf_dequant(name, raw))
    assert torch.equal(dequantize_rows(qtype, raw, 3 * QK_K), _gguf_dequant(name, raw))


@pytest.mark.parametrize(("name", "qtype"), TYPES)
@pytest.mark.parametrize("n", [1, 17, 37])
@pytest.mark.parametrize("m", [1, 2, 5, MAX_ROWS])
def test_products_match_the_float64_reference(name, qtype, n, m):
    gen = torch.Generator().manual_seed(n * 100 + m)
    k = 2 * QK_K
    raw = random_kblocks(qtype, n, k, gen)
    w = _gguf_dequant(name, raw).double()
    x = torch.randn(m, k, generator=gen)
    x[0, :QK_K] = 0.0  # an all-zero super-block of x: scale 0
    want = _q8k(x).double() @ w.t()
    bias = torch.randn(n, generator=gen)
    for isa, fn in qgemv_variants().items():
        got = fn(x, pack_weight(qtype, raw, k), bias).double() - bias.double()
        scale = (_q8k(x).abs().double() @ w.abs().t()).clamp(min=1e-30)
        assert ((got - want).abs() / scale).max() < 1e-5, isa  # float32 sums only
        assert ((got - x.double() @ w.t()).abs() / scale).max() < 0.01, isa


@pytest.mark.parametrize(("name", "qtype"), TYPES)
@pytest.mark.parametrize("scale", [60.0, 1e-6])
def test_extreme_fp16_scales(name, qtype, scale):
    # about 60 * 63 * 15: near the fp16 range's top; 1e-6: subnormal fp16 scales
    gen = torch.Generator().manual_seed(7)
    raw = random_kblocks(qtype, 20, QK_K, gen, scale=scale)
    w = _gguf_dequant(name, raw).double()
    assert torch.isfinite(w).all()
    x = torch.randn(3, QK_K, generator=gen)
    want = _q8k(x).double() @ w.t()
    for isa, fn in qgemv_variants().items():
        got = fn(x, pack_weight(qtype, raw, QK_K), None).double()
        bound = _q8k(x).abs().double() @ w.abs().t()
        assert ((got - want).abs() <= 1e-5 * bound + 1e-30).all(), isa


@pytest.mark.parametrize(("name", "qtype"), TYPES)
def test_builds_agree_and_threads_do_not_change_results(name, qtype):
    gen = torch.Generator().manual_seed(3)
    k = 4 * QK_K
    raw = random_kblocks(qtype, 301, k, gen)  # 19 groups, the last one partial
    x = torch.randn(4, k, generator=gen)
    packed = pack_weight(qtype, raw, k)
    outs = {}
    for isa, fn in qgemv_variants().items():
        runs = []
        for threads in (1, 2, 3):
            old = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                runs.append(fn(x, packed, None))
            finally:
                torch.set_num_threads(old)
        assert all(torch.equal(runs[0], r) for r in runs[1:]), isa
        assert torch.equal(fn(x[2:3], packed, None), runs[0][2:3]), isa  # m does not matter
        outs[isa] = runs[0]
    ref = next(iter(outs.values()))
    for isa, out in outs.items():  # the builds sum in other orders: float32 rounding apart
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()),
                                   msg=isa)


@pytest.mark.parametrize(("name", "qtype"), TYPES)
def test_large_batches_take_exact_float32_tiles(name, qtype):
    gen = torch.Generator().manual_seed(5)
    raw = random_kblocks(qtype, 33, QK_K, gen)
    x = torch.randn(MAX_ROWS + 3, QK_K, generator=gen)
    w = _gguf_dequant(name, raw)
    torch.testing.assert_close(qgemv_linear(x, qtype, raw), x @ w.t())
    packed = pack_weight(qtype, raw, QK_K)
    assert torch.equal(dequantize_packed(packed, 16, 10), w[16:26])
    assert torch.equal(dequantize_rows(qtype, raw, QK_K, torch.tensor([32, 0, 5])), w[[32, 0, 5]])


@pytest.mark.parametrize(("name", "qtype"), TYPES)
def test_quantizer_writes_blocks_the_gguf_package_reads_back(name, qtype):
    w = torch.randn(6, 2 * QK_K, generator=torch.Generator().manual_seed(1))
    w[0, :16] = 0.0
    back = _gguf_dequant(name, quantize_k(qtype, w))
    rel = float((back - w).norm() / w.norm())
    assert rel < (0.1 if name == "Q4_K" else 0.03)  # measured 0.077 and 0.019


def test_bad_k_quant_weights_are_refused():
    q4k = KQTYPES["Q4_K"]
    raw = random_kblocks(q4k, 4, QK_K, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"k=288 is not a multiple of 256"):
        pack_weight(q4k, raw, 288)
    with pytest.raises(ValueError, match=r"uint8 \[n, 288\]"):
        pack_weight(q4k, raw, 2 * QK_K)  # rows of one super-block for k = 512
    with pytest.raises(ValueError, match=r"k=100 is not a multiple of 256"):
        quantize_k(q4k, torch.zeros(2, 100))

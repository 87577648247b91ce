"""The C quantized GEMV kernel (GGUF Q8_0 / Q4_0 / Q4_1 blocks) against torch references.

The reference dequantizes the blocks with torch (:func:`reference_dequantize`, written
from ggml's block layouts) and multiplies in float32. The kernel quantizes each row of
``x`` per block of 32 to int8 (``xd = max|x| / 127``), so each activation is off by at
most ``xd / 2`` and a block's product by at most ``sum |w| * xd / 2``: the tolerance
below is that bound summed over the blocks of a row (plus float rounding), computed for
each output from the data, not a loose constant.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from lmkit_kernels.cpu import qgemv  # noqa: E402
from lmkit_kernels.cpu.qgemv import (  # noqa: E402
    BLOCK_SIZE,
    ISAS,
    MAX_ROWS,
    QTYPES,
    dequantize_packed,
    dequantize_rows,
    pack_weight,
    qgemv_isa,
    qgemv_linear,
    qgemv_unavailable_reason,
    qgemv_variants,
    random_blocks,
    reference_dequantize,
)


@pytest.fixture(params=ISAS)
def variant(request):
    found = qgemv_variants()
    if request.param not in found:
        pytest.skip(f"this CPU does not run the {request.param} build "
                    f"({qgemv_unavailable_reason() or 'not supported'})")
    return found[request.param]


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-output bound of the activation-quantization error: for each block,
    (max|x_block| / 127 / 2) * sum |w_block|, summed over blocks; plus float slack."""
    m, k = x.shape
    xd = x.abs().reshape(m, k // BLOCK_SIZE, BLOCK_SIZE).amax(-1) / 127 / 2  # [m, nb]
    wsum = w.abs().reshape(w.shape[0], k // BLOCK_SIZE, BLOCK_SIZE).sum(-1)  # [n, nb]
    return xd @ wsum.t() * 1.01 + 1e-4 * (x.abs() @ w.abs().t()) + 1e-5


@pytest.mark.parametrize("qname", sorted(QTYPES))
@pytest.mark.parametrize("m,n,k", [(1, 1, 32), (1, 37, 96), (3, 21, 64), (5, 64, 576),
                                   (MAX_ROWS, 17, 160), (7, 130, 1536)])
def test_kernel_matches_torch_reference(variant, qname, m, n, k):
    qtype = QTYPES[qname]
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = random_blocks(qtype, n, k, gen)
    x = torch.randn(m, k, generator=gen) * 3
    wf = reference_dequantize(qtype, w, k)
    bias = torch.randn(n, generator=gen)
    out = variant(x, pack_weight(qtype, w, k), bias)
    ref = x @ wf.t() + bias
    assert ((out - ref).abs() <= _bound(x, wf)).all()


@pytest.mark.parametrize("qname", sorted(QTYPES))
def test_rows_do_not_depend_on_the_batch(variant, qname):
    qtype = QTYPES[qname]
    gen = torch.Generator().manual_seed(3)
    w = random_blocks(qtype, 45, 128, gen)
    x = torch.randn(9, 128, generator=gen)
    packed = pack_weight(qtype, w, 128)
    whole = variant(x, packed, None)
    for i in (0, 4, 8):
        assert torch.equal(variant(x[i:i + 1], packed, None)[0], whole[i])


@pytest.mark.parametrize("qname", sorted(QTYPES))
def test_large_batches_take_the_float32_tile_path(qname):
    if not qgemv_isa():
        pytest.skip(qgemv_unavailable_reason())
    qtype = QTYPES[qname]
    gen = torch.Generator().manual_seed(5)
    w = random_blocks(qtype, 50, 96, gen)
    x = torch.randn(MAX_ROWS + 3, 96, generator=gen)
    ref = x @ reference_dequantize(qtype, w, 96).t()
    # dequantize + float32 matmul: no activation quantization, float32 rounding only
    torch.testing.assert_close(qgemv_linear(x, qtype, w), ref, rtol=1e-5, atol=1e-4)


def test_tiles_cover_outputs_past_the_tile_size(monkeypatch):
    if not qgemv_isa():
        pytest.skip(qgemv_unavailable_reason())
    monkeypatch.setattr(qgemv, "DEQUANT_TILE_ROWS", 16)
    qtype = QTYPES["Q8_0"]
    gen = torch.Generator().manual_seed(6)
    w = random_blocks(qtype, 40, 64, gen)
    x = torch.randn(MAX_ROWS + 1, 64, generator=gen)
    b = torch.randn(40, generator=gen)
    ref = x @ reference_dequantize(qtype, w, 64).t() + b
    torch.testing.assert_close(qgemv_linear(x, qtype, w, b), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qname", sorted(QTYPES))
def test_dequantize_rows_matches_reference(qname):
    if not qgemv_isa():
        pytest.skip(qgemv_unavailable_reason())
    qtype = QTYPES[qname]
    gen = torch.Generator().manual_seed(7)
    w = random_blocks(qtype, 33, 64, gen)
    ref = reference_dequantize(qtype, w, 64)
    assert torch.equal(dequantize_rows(qtype, w, 64), ref)
    rows = torch.tensor([5, 0, 32, 5])
    assert torch.equal(dequantize_rows(qtype, w, 64, rows), ref[rows])


def test_reference_reads_known_blocks():
    # one Q4_1 block: d = 0.5, m = -1, nibbles 0..15 then 15..0 -> w = 0.5 * q - 1
    d_m = torch.tensor([0.5, -1.0], dtype=torch.float16).view(torch.uint8)
    lo, hi = torch.arange(16, dtype=torch.uint8), torch.arange(15, -1, -1, dtype=torch.uint8)
    block = torch.cat([d_m, lo | (hi << 4)]).reshape(1, 20)
    want = torch.cat([lo, hi]).float() * 0.5 - 1
    assert torch.equal(reference_dequantize(QTYPES["Q4_1"], block, 32)[0], want)


def test_checked_entry_refuses_bad_inputs():
    if not qgemv_isa():
        pytest.skip(qgemv_unavailable_reason())
    w = torch.zeros(4, 20, dtype=torch.uint8)
    with pytest.raises(ValueError, match="ggml type 7"):
        qgemv_linear(torch.zeros(1, 32), 7, w)
    with pytest.raises(ValueError, match="multiple of 32"):
        qgemv_linear(torch.zeros(1, 33), QTYPES["Q4_1"], w)
    with pytest.raises(ValueError, match=r"uint8 \[n, 20\]"):
        qgemv_linear(torch.zeros(1, 32), QTYPES["Q4_1"], torch.zeros(4, 18, dtype=torch.uint8))
    with pytest.raises(ValueError, match="float32"):
        qgemv_linear(torch.zeros(1, 32, dtype=torch.float64), QTYPES["Q4_1"], w)


@pytest.mark.parametrize("qname", sorted(QTYPES))
@pytest.mark.parametrize("m,n,k", [(1, 5, 32), (2, 16, 64), (4, 33, 96), (6, 47, 128),
                                   (9, 100, 224), (MAX_ROWS - 1, 31, 64)])
def test_packed_groups_and_row_passes_cover_odd_shapes(variant, qname, m, n, k):
    # n off the 16-row groups (a partial last group), m off the 4-row passes, x strided
    qtype = QTYPES[qname]
    gen = torch.Generator().manual_seed(11 * m + n + k)
    w = random_blocks(qtype, n, k, gen)
    x = (torch.randn(m, k + 32, generator=gen) * 2)[:, 16:16 + k]  # rows k + 32 floats apart
    wf = reference_dequantize(qtype, w, k)
    out = variant(x, pack_weight(qtype, w, k), None)
    assert out.shape == (m, n)
    assert ((out - x @ wf.t()).abs() <= _bound(x, wf)).all()


@pytest.mark.parametrize("qname", sorted(QTYPES))
def test_results_do_not_depend_on_the_thread_count(variant, qname):
    qtype = QTYPES[qname]
    gen = torch.Generator().manual_seed(12)
    w = pack_weight(qtype, random_blocks(qtype, 83, 160, gen), 160)
    x = torch.randn(6, 160, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = variant(x, w, None)
        torch.set_num_threads(2)
        two = variant(x, w, None)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize("qname", sorted(QTYPES))
def test_the_builds_agree_exactly(qname):
    # same int8 activations, exact integer block sums, the same float steps per row
    found = qgemv_variants()
    if len(found) < 2:
        pytest.skip("this CPU runs one build only")
    qtype = QTYPES[qname]
    gen = torch.Generator().manual_seed(13)
    w = pack_weight(qtype, random_blocks(qtype, 37, 192, gen), 192)
    x = torch.randn(5, 192, generator=gen)
    b = torch.randn(37, generator=gen)
    outs = [fn(x, w, b) for fn in found.values()]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("qname", sorted(QTYPES))
def test_dequantize_packed_matches_reference(qname):
    if not qgemv_isa():
        pytest.skip(qgemv_unavailable_reason())
    qtype = QTYPES[qname]
    gen = torch.Generator().manual_seed(14)
    w = random_blocks(qtype, 45, 96, gen)
    ref = reference_dequantize(qtype, w, 96)
    packed = pack_weight(qtype, w, 96)
    assert torch.equal(dequantize_packed(packed), ref)
    assert torch.equal(dequantize_packed(packed, 16, 16), ref[16:32])
    assert torch.equal(dequantize_packed(packed, 32, 100), ref[32:])  # clipped at n
    with pytest.raises(ValueError, match="multiple of 16"):
        dequantize_packed(packed, 8)


def test_pack_weight_refuses_bad_weights():
    if not qgemv_isa():
        pytest.skip(qgemv_unavailable_reason())
    with pytest.raises(ValueError, match="ggml type 7"):
        pack_weight(7, torch.zeros(4, 20, dtype=torch.uint8), 32)
    with pytest.raises(ValueError, match=r"uint8 \[n, 20\]"):
        pack_weight(QTYPES["Q4_1"], torch.zeros(4, 40, dtype=torch.uint8), 32)


def test_concurrent_callers_get_their_own_results(variant):
    # the helper pool serves one caller at a time; another caller runs alone meanwhile
    import threading

    qtype = QTYPES["Q4_1"]
    gen = torch.Generator().manual_seed(15)
    w = pack_weight(qtype, random_blocks(qtype, 300, 256, gen), 256)
    xs = [torch.randn(2, 256, generator=gen) for _ in range(4)]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = [variant(x, w, None) for x in xs]
        torch.set_num_threads(2)
        got: dict[int, list[torch.Tensor]] = {}

        def call(i: int) -> None:
            got[i] = [variant(xs[i], w, None) for _ in range(50)]

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(xs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        torch.set_num_threads(before)
    for i, outs in got.items():
        assert all(torch.equal(o, want[i]) for o in outs)


@pytest.mark.parametrize("qname", sorted(QTYPES))
def test_bound_linear_is_the_unbound_kernel_exactly(qname):
    # bind_linear (a model's hot path) against the best build's unbound function:
    # decode rows, a strided x, a bias, and a batch past MAX_ROWS (the tile path)
    if not qgemv_isa():
        pytest.skip(qgemv_unavailable_reason())
    qtype = QTYPES[qname]
    gen = torch.Generator().manual_seed(11)
    w = pack_weight(qtype, random_blocks(qtype, 40, 96, gen), 96)
    bound, unbound = qgemv.bind_linear(w), qgemv.unchecked_qgemv()
    bias = torch.randn(40, generator=gen)
    wide = torch.randn(MAX_ROWS + 3, 200, generator=gen)
    for x in (wide[:1, :96], wide[:5, :96], wide[:, 100:196], wide[:3, :192:2]):
        for b in (None, bias):
            assert torch.equal(bound(x, b), unbound(x, w, b))

"""The top-k / top-p threshold search of ``lmkit_kernels.sampling.sample`` in Triton's CPU
interpreter: spread over the ``[rows, chunks]`` grid, it must find exactly the smallest
kept order key (top-k: the k-th largest value's key, ties kept; top-p: the smallest key
whose strictly-greater kept mass is below ``p * total``) at every chunk count, and so
keep exactly :func:`top_k_top_p_mask_ref`'s tokens. Top-p values sit mid-way between
cumulative masses (a boundary within float rounding depends on the summation order,
which follows the chunk count). The interpreter's blocks are 256 wide."""

from __future__ import annotations

import pytest
from interpret_mode import require_triton_interpreter

require_triton_interpreter()
torch = pytest.importorskip("torch")

from lmkit_kernels import sampling  # noqa: E402
from lmkit_kernels.sampling import sample, sample_ref, top_k_top_p_mask_ref  # noqa: E402

CPU = torch.device("cpu")


def _keys(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 order keys, as the kernels compute them."""
    bits = x.view(torch.int32)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long()


def _scaled(logits, temperature):
    x = logits.float()
    if temperature is None:
        return x
    return x / torch.where(temperature <= 0, 1.0, temperature).unsqueeze(1)


def _lo_keys(logits, temperature=None, top_k=None, top_p=None):
    """The kernels' smallest kept key per row (greedy rows: unset)."""
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    noise = torch.ones(logits.shape, dtype=torch.float32)
    return sampling._launch(logits, temperature, top_k, top_p, noise, None, out)[0]


def _p_keeping(x_row: torch.Tensor, kept: torch.Tensor, groups: int) -> float:
    """A top-p that keeps the ``groups`` largest distinct values among ``kept`` (under
    both the kernel's and the reference's rules, ties included): half-way into the mass
    of the last token of the last kept group, computed in float64."""
    x = x_row[kept].double()
    values = x.unique(sorted=True).flip(0)
    e = (x - x.max()).exp()
    total = e.sum()
    kept_mass = e[x >= values[groups - 1]].sum()
    last = (values[groups - 1] - x.max()).exp()  # one token of the last kept group
    return float((kept_mass - last / 2) / total)


def _check_exact(logits, temperature, top_k, top_p, draw=True):
    """Kernel threshold keys == the reference's smallest kept key, row by row; with
    ``draw``, ``sample`` == ``sample_ref`` on shared noise too. Returns the keys."""
    x = _scaled(logits, temperature)
    lo = _lo_keys(logits, temperature, top_k, top_p)
    keep = top_k_top_p_mask_ref(x, top_k, top_p)
    keys = _keys(x)
    greedy = torch.zeros(x.shape[0], dtype=torch.bool) if temperature is None else temperature <= 0
    for r in range(x.shape[0]):
        if greedy[r]:
            continue
        want = int(keys[r][keep[r]].min())
        assert int(lo[r]) == want, f"row {r}: lo key {int(lo[r])}, reference {want}"
    if not draw:
        return lo
    noise = torch.empty(x.shape).exponential_(generator=torch.Generator().manual_seed(3))
    got = sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, noise=noise)
    assert torch.equal(got, sample_ref(logits, temperature, top_k, top_p, noise))
    return lo


def _rows(num_rows: int, vocab: int, seed: int, dtype=torch.float32, ties=False):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=gen) * 2
    if ties:
        logits = (logits * 4).round() / 4
    return logits.to(dtype), gen


# (rows, chunk-count target, vocab) -> 4, 2, 1, 12 and 6 chunks; no vocabulary is a
# multiple of 256
SHAPES = [(1, 4, 1000), (2, 4, 1000), (8, 4, 300), (1, 64, 3000), (3, 64, 1300)]


# every shape in float32; bfloat16 (only the load differs) on the quick shapes
CASES = [(s, dtype) for s in SHAPES for dtype in (torch.float32, torch.bfloat16)
         if dtype is torch.float32 or s[1] != 64]


@pytest.fixture(params=[pytest.param(c, id=f"{c[0][0]}x{c[0][2]}-target{c[0][1]}-"
                                     f"{str(c[1]).removeprefix('torch.')}",
                                     marks=[pytest.mark.slow] if c[0][1] == 64 else [])
                        for c in CASES])
def case(request, monkeypatch):
    """(rows, vocab, dtype), with the per-SM program target that gives the chunk count."""
    (num_rows, target, vocab), dtype = request.param
    monkeypatch.setattr(sampling, "_num_programs_target", lambda device: target)
    return num_rows, vocab, dtype


def test_shapes_cover_several_chunk_counts(monkeypatch):
    counts = set()
    for num_rows, target, vocab in SHAPES:
        monkeypatch.setattr(sampling, "_num_programs_target", lambda device, t=target: t)
        block, chunk, num_chunks = sampling.row_chunks(num_rows, vocab, CPU)
        assert block == 256 and chunk % block == 0 and (num_chunks - 1) * chunk < vocab
        counts.add(num_chunks)
    assert counts == {1, 2, 4, 6, 12}


def test_top_k_is_exact(case):
    num_rows, vocab, dtype = case
    logits, gen = _rows(num_rows, vocab, 10, dtype, ties=True)  # ties at the k-th value
    top_k = torch.randint(1, vocab, (num_rows,), generator=gen)
    ranked = logits[0].float().sort(descending=True).values
    tied = (ranked[1:] == ranked[:-1]).nonzero().flatten()  # i: the (i+1)-th == (i+2)-th
    top_k[0] = int(tied[tied >= 20][0]) + 1  # the k-th value is tied with the next
    if num_rows > 2:
        top_k[1], top_k[2] = 1, vocab - 1
    _check_exact(logits, None, top_k, None)
    kept = top_k_top_p_mask_ref(logits.float(), top_k, None).sum(dim=-1)
    assert kept[0] > top_k[0]  # the ties are kept


def test_top_p_is_exact(case):
    num_rows, vocab, dtype = case
    logits, gen = _rows(num_rows, vocab, 11, dtype)
    temperature = torch.rand(num_rows, generator=gen) + 0.5
    x = _scaled(logits, temperature)
    groups = torch.randint(1, 40, (num_rows,), generator=gen)
    top_p = torch.tensor([_p_keeping(x[r], torch.ones(vocab, dtype=torch.bool), int(groups[r]))
                          for r in range(num_rows)])
    _check_exact(logits, temperature, None, top_p)


def test_top_k_then_top_p_is_exact(case):
    num_rows, vocab, dtype = case
    logits, gen = _rows(num_rows, vocab, 12, dtype)
    x = logits.float()
    top_k = torch.randint(20, 120, (num_rows,), generator=gen)
    kept_k = top_k_top_p_mask_ref(x, top_k, None)
    top_p = torch.tensor([_p_keeping(x[r], kept_k[r], int(torch.randint(1, 15, (1,),
                                                                          generator=gen)))
                          for r in range(num_rows)])
    _check_exact(logits, None, top_k, top_p)


@pytest.mark.slow
def test_mixed_rows_in_one_batch(monkeypatch):
    """Greedy, filters off, top-k only, top-p only and both, in one call, at 1 and 3
    chunks."""
    logits, gen = _rows(10, 700, 13)
    x = logits.float()
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.0, 1.3, 0.0, 1.0, 0.9, 1.0, 2.0])
    top_k = torch.tensor([0, 5, 700, 30, 12, 0, -1, 3, 800, 64])
    xs = _scaled(logits, temperature)
    kept_k = top_k_top_p_mask_ref(xs, top_k, None)
    top_p = torch.ones(10)
    for r, groups in ((0, 9), (3, 4), (4, 2), (5, 3), (9, 20)):
        top_p[r] = _p_keeping(xs[r], kept_k[r], groups)
    top_p[6] = 1.5  # off
    for target in (4, 40):
        monkeypatch.setattr(sampling, "_num_programs_target", lambda device, t=target: t)
        _check_exact(logits, temperature, top_k, top_p)
    got = sample(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                 noise=torch.ones(10, 700))
    assert torch.equal(got[[1, 5]], x[[1, 5]].argmax(dim=-1))  # greedy rows


def test_top_p_near_one_and_tiny(monkeypatch):
    """p within 1e-3 of 1 (flat logits: the boundary deep in the tail) and p = 1e-7."""
    monkeypatch.setattr(sampling, "_num_programs_target", lambda device: 16)
    gen = torch.Generator().manual_seed(14)
    logits = torch.randn(4, 2000, generator=gen) * 0.3
    x = logits.float()
    everything = torch.ones(2000, dtype=torch.bool)
    top_p = torch.tensor([_p_keeping(x[0], everything, 1995), _p_keeping(x[1], everything, 1900),
                          1e-7, 1e-7])
    assert top_p[0] > 0.998 and top_p[1] > 0.95
    _check_exact(logits, None, None, top_p)
    assert int((_keys(x[2]) >= _lo_keys(logits, top_p=top_p)[2]).sum()) == 1


def test_top_p_zero_keeps_the_most_likely_token():
    """p <= 0 keeps the argmax (the reference's rule); the one-program search ran past
    the row maximum and kept nothing, so the race returned the chunk's first token."""
    logits, _ = _rows(3, 300, 15)
    top_p = torch.tensor([0.0, -1.0, 0.0])
    got = sample(logits, top_p=top_p, noise=torch.ones(3, 300))
    assert torch.equal(got, logits.argmax(dim=-1))


def test_top_k_of_rows_with_minus_infinity(monkeypatch):
    """Banned tokens (-inf) are keys like any other: k above the finite count keeps them."""
    monkeypatch.setattr(sampling, "_num_programs_target", lambda device: 8)
    logits, _ = _rows(2, 1000, 16)
    logits[:, 100:] = float("-inf")  # 100 finite tokens
    top_k = torch.tensor([50, 500])
    lo = _lo_keys(logits, top_k=top_k)
    keys = _keys(logits)
    assert int((keys[0] >= lo[0]).sum()) == 50
    assert int(lo[1]) == int(_keys(torch.tensor([float("-inf")]))[0])


def test_thresholds_on_consecutive_keys():
    """Every integer in the key range is a token's key, so the k-th largest (and the
    top-p boundary) falls on every position of the narrowed ranges, their ends included
    (3 passes narrow 300 keys to one)."""
    gen = torch.Generator().manual_seed(17)
    num_rows, vocab = 24, 300
    keys = torch.randperm(vocab, generator=gen) + 0x3F800000  # 1.0 and the floats after it
    logits = keys.int().view(torch.float32).expand(num_rows, vocab).contiguous()
    top_k = torch.linspace(1, vocab - 1, num_rows).round().long()
    _check_exact(logits, None, top_k, None, draw=False)
    # each token's mass is ~1: p = (m - 0.5) / vocab keeps the m largest
    lo = _check_exact(logits, None, None, (top_k.float() - 0.5) / vocab, draw=False)
    assert torch.equal((_keys(logits) >= lo[:, None]).sum(-1), top_k)

"""The compiled Triton sampling kernel on CUDA against its torch reference at a real
vocabulary (151936), its threshold search (8 passes of 16 thresholds over the
``[rows, chunks]`` grid) exactly at 256 rows, and its in-kernel noise against the
target distribution."""

from __future__ import annotations

import pytest
from gpu_only import require_cuda_and_triton

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
require_cuda_and_triton()

from lmkit_kernels import sampling  # noqa: E402
from lmkit_kernels.sampling import sample, sample_ref, top_k_top_p_mask_ref  # noqa: E402

CUDA = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_matches_reference(dtype):
    gen = torch.Generator(device=CUDA).manual_seed(0)
    rows, vocab = 64, 151936
    logits = (torch.randn(rows, vocab, device=CUDA, generator=gen) * 4).to(dtype)
    temperature = torch.rand(rows, device=CUDA, generator=gen) + 0.3
    temperature[::9] = 0.0  # some greedy rows
    top_k = torch.randint(-1, 200, (rows,), device=CUDA, generator=gen)
    top_k[::5] = vocab  # off
    top_p = torch.rand(rows, device=CUDA, generator=gen) * 0.9 + 0.1
    top_p[::4] = 1.0  # off
    noise = torch.empty(rows, vocab, device=CUDA).exponential_(generator=gen)
    got = sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, noise=noise)
    ref = sample_ref(logits, temperature, top_k, top_p, noise)
    # rows can differ only where float summation order moves a top-p boundary token
    assert (got == ref).float().mean().item() >= 0.95
    assert torch.equal(got[::9], logits[::9].float().argmax(dim=-1))


def test_sample_in_kernel_noise_follows_the_distribution():
    rows, vocab = 200_000, 6
    logits = torch.tensor([1.5, 1.0, 0.5, 0.0, -0.5, -1.0], device=CUDA).expand(rows, vocab)
    logits = logits.contiguous()
    seeds = torch.randint(0, 2 ** 62, (rows,), device=CUDA)
    freq = torch.bincount(sample(logits, seeds=seeds), minlength=vocab).float() / rows
    torch.testing.assert_close(freq, logits[0].softmax(-1), atol=5e-3, rtol=0)
    top = sample(logits, top_k=torch.full((rows,), 3, device=CUDA),
                 top_p=torch.full((rows,), 0.9, device=CUDA), seeds=seeds)
    kept = logits[0, :3].softmax(-1)  # top-3 masses 0.51, 0.31, 0.19: top-p 0.9 keeps all 3
    torch.testing.assert_close(torch.bincount(top, minlength=vocab).float()[:3] / rows, kept,
                               atol=5e-3, rtol=0)


def _keys(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 order keys, as the kernels compute them."""
    bits = x.view(torch.int32)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long()


def _p_near(x_row: torch.Tensor, kept: torch.Tensor, target: float) -> tuple[float, float]:
    """(p, margin): a top-p keeping the distinct values of ``kept`` whose mass first
    reaches ``target``, half-way into the last kept token's mass (float64), so float32
    summation order cannot move the boundary; margin is that half-mass over the total."""
    x = x_row[kept].double().sort(descending=True).values
    e = (x - x[0]).exp()
    values, counts = torch.unique_consecutive(x, return_counts=True)
    cum = e.cumsum(0)[counts.cumsum(0) - 1]  # the mass of the groups up to each one
    total = cum[-1]
    g = min(int(torch.searchsorted(cum / total, target)), len(values) - 1)
    half = (values[g] - x[0]).exp() / 2
    return float((cum[g] - half) / total), float(half / total)


@pytest.mark.parametrize("mode", ["top_k", "top_p", "both", "mixed"])
def test_threshold_search_is_exact_at_256_rows(mode):
    """The smallest kept key of every row equals the reference's, run after run."""
    rows, vocab = 256, 151936
    gen = torch.Generator(device=CUDA).manual_seed(1)
    logits = torch.randn(rows, vocab, device=CUDA, generator=gen) * 4
    temperature = top_k = top_p = None
    if mode != "top_p":
        top_k = torch.randint(1, 3000, (rows,), device=CUDA, generator=gen)
    if mode == "mixed":
        temperature = torch.ones(rows, device=CUDA)
        temperature[::7] = 0.0  # greedy
        top_k[::3] = 0  # off
    kept_k = top_k_top_p_mask_ref(logits, top_k, None)
    if mode != "top_k":
        targets = torch.rand(rows, generator=torch.Generator().manual_seed(2)) * 0.75 + 0.05
        pairs = [_p_near(logits[r], kept_k[r], float(targets[r])) for r in range(rows)]
        assert min(margin for _, margin in pairs) > 1e-5  # far from float32 rounding
        top_p = torch.tensor([p for p, _ in pairs], device=CUDA)
        if mode == "mixed":
            top_p[1::4] = 1.0  # off
    out = torch.empty(rows, dtype=torch.int64, device=CUDA)
    noise = torch.empty(rows, vocab, device=CUDA).exponential_(generator=gen)
    lo = sampling._launch(logits, temperature, top_k, top_p, noise, None, out)[0]
    keep = top_k_top_p_mask_ref(logits, top_k, top_p)
    want = torch.where(keep, _keys(logits), 2 ** 40).min(dim=-1).values
    sampled = torch.ones(rows, dtype=torch.bool, device=CUDA)
    if temperature is not None:
        sampled = temperature > 0
    assert torch.equal(lo[sampled], want[sampled])
    assert torch.equal(out, sample_ref(logits, temperature, top_k, top_p, noise))
    again = torch.empty_like(out)
    lo_again, _ = sampling._launch(logits, temperature, top_k, top_p, noise, None, again)
    assert torch.equal(lo_again[sampled], lo[sampled])
    assert torch.equal(again, out)


def test_a_new_batch_size_compiles_no_new_variant():
    """Chunk counts and sizes follow the batch size as runtime arguments: after the first
    call, other batch sizes reuse every compiled kernel (one variant per filter set)."""
    from lmkit_kernels import sampling_kernels as sk

    kernels = (sk.chunk_stats_kernel, sk.top_k_pass_kernel, sk.top_p_pass_kernel,
               sk.race_kernel, sk.pick_kernel)
    if not all(hasattr(k, "device_caches") for k in kernels):
        pytest.skip("this Triton keeps its compiled kernels elsewhere")

    def run(rows: int) -> None:
        full = lambda value: torch.full((rows,), value, device=CUDA)  # noqa: E731
        sample(torch.randn(rows, 151936, device=CUDA), temperature=full(0.8),
               top_k=full(50).long(), top_p=full(0.9))

    device = torch.cuda.current_device()
    run(1)
    compiled = [len(k.device_caches[device][0]) for k in kernels]
    for rows in (2, 7, 33, 130, 256):
        run(rows)
    assert [len(k.device_caches[device][0]) for k in kernels] == compiled


@pytest.mark.parametrize("scale", [0.9, 4.0])  # W1's flat rows (std 0.64 / T 0.7), peaked
def test_the_race_draws_what_the_search_draws_at_256_rows(scale):
    """Top-p by the race's checked winner against the threshold search, at 256 x 151,936
    with top-k, greedy rows and top-p off mixed in: the same tokens (a boundary within
    float rounding may differ, as against the reference), nearly every row settled."""
    gen = torch.Generator(device=CUDA).manual_seed(5)
    rows, vocab = 256, 151936
    logits = torch.randn(rows, vocab, device=CUDA, generator=gen) * scale
    temperature = torch.ones(rows, device=CUDA)
    temperature[::17] = 0.0
    top_k = torch.zeros(rows, dtype=torch.int64, device=CUDA)
    top_k[1::3] = 5000
    top_p = torch.full((rows,), 0.95, device=CUDA)
    top_p[2::5] = 0.5
    top_p[3::7] = 1.0
    seeds = torch.randint(0, 2 ** 62, (rows,), device=CUDA, generator=gen)
    draws = []
    for rounds in (0, sampling.RACE_ROUNDS):
        out = torch.empty(rows, dtype=torch.int64, device=CUDA)
        _, done = sampling._launch(logits, temperature, top_k, top_p, None, seeds, out,
                                   race_rounds=rounds)
        draws.append(out)
    assert (draws[0] == draws[1]).sum().item() >= rows - 1
    assert done.sum().item() >= 0.9 * rows

"""The Triton sampling kernel (``lmkit_kernels.sampling.sample``) in Triton's CPU
interpreter against its torch reference: shared noise, exact top-k/top-p thresholds,
seeded in-kernel noise. On CUDA the compiled kernel is tested by
tests/gpu/test_sampling_kernel_gpu.py. The ``triton`` sampling kernels
(``lmkit_plugins.sampling``) run it where bench/sampling.py measured it faster than the
core's sampler (tests/unit/test_triton_sampling_kernels.py)."""

from __future__ import annotations

import pytest
from interpret_mode import require_triton_interpreter

require_triton_interpreter()
torch = pytest.importorskip("torch")

from lmkit_kernels.sampling import sample, sample_ref, top_k_top_p_mask_ref  # noqa: E402


def test_sample_matches_reference_with_shared_noise():
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 8, 300
    logits = torch.randn(rows, vocab, generator=gen) * 3
    temperature = torch.tensor([1.0, 0.5, 0.0, 1.5, 1.0, 0.8, 2.0, 1.0])
    top_k = torch.tensor([0, 5, 7, 40, vocab, 1, 300, 12])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.7, 0.2, 1.0, 0.95, 0.6])
    noise = torch.empty(rows, vocab).exponential_(generator=gen)
    got = sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, noise=noise)
    assert torch.equal(got, sample_ref(logits, temperature, top_k, top_p, noise))
    assert got[2] == logits[2].argmax()  # temperature 0: greedy
    assert got[5] == logits[5].argmax()  # top-k 1
    # bfloat16 logits, no temperature, top-k only
    got = sample(logits.bfloat16(), top_k=top_k, noise=noise)
    assert torch.equal(got, sample_ref(logits.bfloat16(), None, top_k, None, noise))


@pytest.mark.parametrize("mode", ["top_k", "top_p", "both"])
def test_sample_threshold_is_exact(mode):
    """Force each token in turn to win the race if kept: the kernel must keep exactly
    the reference's top-k/top-p set (thresholds placed between cumulative masses)."""
    gen = torch.Generator().manual_seed(1)
    vocab = 16
    row = torch.randn(vocab, generator=gen) * 2
    probs = row.double().softmax(-1).sort(descending=True).values
    k = 9 if mode != "top_p" else 0
    kept_probs = probs[:k] / probs[:k].sum() if k else probs
    cum = kept_probs.cumsum(0)
    p = float((cum[4] + cum[5]) / 2) if mode != "top_k" else 1.0  # keep exactly 6
    logits = row.expand(vocab, vocab).contiguous()
    noise = torch.ones(vocab, vocab)
    noise[torch.arange(vocab), torch.arange(vocab)] = 1e-30  # row i: token i wins if kept
    top_k = torch.full((vocab,), k)
    top_p = torch.full((vocab,), p)
    got = sample(logits, top_k=top_k, top_p=top_p, noise=noise)
    keep = top_k_top_p_mask_ref(logits, top_k, top_p)[0]
    assert int(keep.sum()) == (6 if mode != "top_k" else 9)
    wins = got == torch.arange(vocab)
    assert torch.equal(wins, keep)


def test_sample_in_kernel_noise_is_seeded_and_follows_the_distribution():
    rows, vocab = 120, 4
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0]).expand(rows, vocab).contiguous()
    seeds = torch.arange(rows, dtype=torch.int64) * 7919 + 1
    first = sample(logits, seeds=seeds)
    assert torch.equal(first[:8], sample(logits[:8], seeds=seeds[:8]))  # same seed, same draw
    freq = torch.bincount(first, minlength=vocab).float() / rows
    expected = logits[0].softmax(-1)  # 0.64, 0.24, 0.09, 0.03
    assert torch.all((freq - expected).abs() < 0.15), (freq, expected)
    # top-k 2 never draws the two least likely tokens
    kept = sample(logits[:24], top_k=torch.full((24,), 2), seeds=seeds[:24] + 1)
    assert set(kept.tolist()) == {0, 1}

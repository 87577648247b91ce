"""Top-p by checking the race's winner (``lmkit_kernels.sampling_race``) in Triton's CPU
interpreter: every row draws the very token the threshold search then the race draws
(same noise), whether the race settles it or leaves it to the search, with top-k,
temperature, greedy rows and top-p off mixed in; and at ``p = 0.95`` over a flat
distribution (W1's case) the race settles nearly every row."""

from __future__ import annotations

import pytest
from interpret_mode import require_triton_interpreter

require_triton_interpreter()
torch = pytest.importorskip("torch")

from lmkit_kernels import sampling  # noqa: E402
from lmkit_kernels.sampling import sample, sample_ref, top_k_top_p_mask_ref  # noqa: E402


def _draw(logits, temperature, top_k, top_p, noise=None, seeds=None, rounds=0):
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    _, done = sampling._launch(logits, temperature, top_k, top_p, noise, seeds, out,
                               race_rounds=rounds)
    return out, done


def _batch(rows: int, vocab: int, seed: int, scale: float):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * scale
    temperature = torch.rand(rows, generator=gen) * 1.5 + 0.3
    temperature[::9] = 0.0  # greedy
    top_k = torch.randint(1, vocab, (rows,), generator=gen)
    top_k[::2] = 0  # off
    top_p = torch.rand(rows, generator=gen) * 0.98 + 0.01
    top_p[3::8] = 1.0  # off
    top_p[5::11] = 0.0  # the most likely token only
    noise = torch.empty(rows, vocab).exponential_(generator=gen)
    return logits, temperature, top_k, top_p, noise


@pytest.mark.parametrize("rounds,scale", [(1, 0.5), (3, 4.0)])  # flat rows, peaked rows
def test_race_draws_what_the_search_draws(rounds, scale):
    logits, temperature, top_k, top_p, noise = _batch(24, 400, 1, scale)
    want, no_race = _draw(logits, temperature, top_k, top_p, noise)
    assert no_race is None
    got, done = _draw(logits, temperature, top_k, top_p, noise, rounds=rounds)
    assert torch.equal(got, want)
    assert torch.equal(got, sample_ref(logits, temperature, top_k, top_p, noise))
    assert 0 < int(done.sum()) <= 24
    # in-kernel noise: the same Philox draws in the race's launches and the search's
    seeds = torch.arange(24, dtype=torch.int64) * 7919 + 5
    want, _ = _draw(logits, temperature, None, top_p, seeds=seeds)
    got, _ = _draw(logits, temperature, None, top_p, seeds=seeds, rounds=rounds)
    assert torch.equal(got, want)


def test_rows_the_race_leaves_open_fall_back_to_the_search():
    """A small p over a flat row rejects candidates for many rounds: with one round most
    rows stay open and the search draws them, still exactly."""
    logits, _, _, _, noise = _batch(24, 500, 2, 0.3)
    top_p = torch.full((24,), 0.02)
    want, _ = _draw(logits, None, None, top_p, noise)
    got, done = _draw(logits, None, None, top_p, noise, rounds=1)
    assert int(done.sum()) < 12  # most rows went to the search
    assert torch.equal(got, want)


def test_high_p_over_a_flat_row_settles_in_the_race():
    """W1's sampling (top-p 0.95, temperature 0.7, logits of std ~0.64): one check
    settles exactly the rows whose first winner (the race over every token) top-p keeps,
    about 95% of them; the default rounds settle every row here."""
    gen = torch.Generator().manual_seed(3)
    rows = 32
    logits = torch.randn(rows, 1000, generator=gen) * 0.64
    temperature, top_p = torch.full((rows,), 0.7), torch.full((rows,), 0.95)
    noise = torch.empty(rows, 1000).exponential_(generator=gen)
    x = logits / 0.7
    first = (x.softmax(-1) / noise).argmax(-1)
    inside = top_k_top_p_mask_ref(x, None, top_p)[torch.arange(rows), first]
    got, done = _draw(logits, temperature, None, top_p, noise, rounds=1)
    assert torch.equal(done.bool(), inside)
    assert 0 < rows - int(inside.sum()) <= 4
    assert torch.equal(got, sample_ref(logits, temperature, None, top_p, noise))
    _, done = _draw(logits, temperature, None, top_p, noise, rounds=sampling.RACE_ROUNDS)
    assert int(done.sum()) == rows


def test_sample_takes_the_race(monkeypatch):
    """``sample`` runs the race, with :data:`~lmkit_kernels.sampling_race.RACE_ROUNDS`."""
    rounds = []
    launch = sampling._launch

    def spy(*args, race_rounds=0):
        rounds.append(race_rounds)
        return launch(*args, race_rounds=race_rounds)

    monkeypatch.setattr(sampling, "_launch", spy)
    logits, temperature, top_k, top_p, noise = _batch(12, 300, 4, 2.0)
    got = sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, noise=noise)
    assert torch.equal(got, sample_ref(logits, temperature, top_k, top_p, noise))
    assert rounds == [sampling.RACE_ROUNDS] and sampling.RACE_ROUNDS >= 1


def test_race_on_bfloat16_logits_and_a_lone_row():
    """bfloat16 logits (read as float32 after the load, as the search reads them) and a
    batch of one row forced through the race."""
    logits, temperature, top_k, top_p, noise = _batch(12, 333, 5, 3.0)
    logits = logits.bfloat16()
    want, _ = _draw(logits, temperature, top_k, top_p, noise)
    got, _ = _draw(logits, temperature, top_k, top_p, noise, rounds=2)
    assert torch.equal(got, want)
    one = (logits[:1], torch.ones(1), None, torch.full((1,), 0.8), noise[:1])
    assert torch.equal(_draw(*one, rounds=1)[0], _draw(*one)[0])

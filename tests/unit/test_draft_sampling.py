"""``lmkit.sample.draft_sampling``: a sampled draft's distribution is the target's
filters (temperature, min-p, top-k, top-p) applied to the head's logits whenever the kept
set lies among the candidates, the draws follow it, greedy rows take the argmax, a draft
vocabulary maps to target ids (0 elsewhere), and seeded rows draw from their own
generator."""

from __future__ import annotations

import pytest
import torch
from lmkit.sample.draft_sampling import (
    DraftRowParams,
    candidates_to_dense,
    draw_draft_uniforms,
    sample_draft_tokens,
)
from lmkit.sample.filters import logits_to_probs

V = 64


def _rows(n, temperature, top_k=0, top_p=1.0, min_p=0.0, uniform=None):
    return DraftRowParams(torch.full((n,), temperature), torch.full((n,), top_k),
                          torch.full((n,), top_p), torch.full((n,), min_p),
                          torch.rand(n) if uniform is None else uniform)


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p", "num_candidates"), [
    (0.7, 0, 1.0, 0.0, V), (1.0, 5, 1.0, 0.0, 8), (1.3, 0, 0.8, 0.0, V),
    (0.9, 10, 0.7, 0.05, 16),
])
def test_distribution_is_the_targets_filters(temperature, top_k, top_p, min_p,
                                             num_candidates):
    torch.manual_seed(0)
    logits = torch.randn(1, V) * 2
    n = 100_000
    rows = _rows(n, temperature, top_k, top_p, min_p)
    ids, cand, q = sample_draft_tokens(logits.expand(n, V).contiguous(), None, rows,
                                       num_candidates=num_candidates)
    want = logits_to_probs(logits.clone(), torch.tensor([temperature]),
                           torch.tensor([top_k or V]), torch.tensor([top_p]),
                           torch.tensor([min_p]) if min_p else None, top_k)[0]
    assert torch.allclose(candidates_to_dense(cand[:1], q[:1], V)[0], want, atol=1e-6)
    counts = torch.bincount(ids, minlength=V).double()
    expected = want.double() * n
    seen = expected > 0
    assert counts[~seen].sum() == 0  # never a token the distribution excludes
    chi2 = float(((counts[seen] - expected[seen]) ** 2 / expected[seen]).sum())
    assert chi2 < int(seen.sum()) + 5 * (2 * int(seen.sum())) ** 0.5


def test_candidates_bound_the_distribution_and_greedy_rows_take_the_argmax():
    logits = torch.randn(3, V)
    rows = _rows(3, 1.0)
    rows.temperature[1] = 0.0  # a greedy row
    ids, cand, q = sample_draft_tokens(logits, None, rows, num_candidates=8)
    assert cand.shape == q.shape == (3, 8)
    # a kept set larger than the candidates: the target's distribution, truncated to them
    top = logits[0].softmax(dim=-1).topk(8)
    assert torch.allclose(q[0], top.values / top.values.sum(), atol=1e-6)
    assert torch.equal(cand[0], top.indices)
    assert int(ids[1]) == int(logits[1].argmax())
    assert all(int(ids[r]) in cand[r].tolist() for r in (0, 2))


def test_a_draft_vocabulary_maps_to_target_ids():
    target_ids = torch.tensor([3, 7, 8, 20, 41])  # draft id -> target id
    logits = torch.randn(4, 5)
    ids, cand, q = sample_draft_tokens(logits, target_ids, _rows(4, 1.0))
    dense = candidates_to_dense(cand, q, V)
    outside = torch.ones(V, dtype=torch.bool)
    outside[target_ids] = False
    assert dense[:, outside].abs().sum() == 0
    assert torch.allclose(dense[:, target_ids], logits.softmax(dim=-1), atol=1e-6)
    assert set(ids.tolist()) <= set(target_ids.tolist())


def test_seeded_rows_draw_from_their_generator():
    def gen(seed):
        return torch.Generator().manual_seed(seed)

    a = draw_draft_uniforms(3, 4, {1: gen(5)}, torch.device("cpu"))
    b = draw_draft_uniforms(2, 4, {0: gen(5)}, torch.device("cpu"))
    assert torch.equal(a[1], b[0]) and torch.equal(a[1], torch.rand(4, generator=gen(5)))
    assert bool(((a >= 0) & (a < 1)).all())


def test_traces_as_one_graph_without_host_reads():
    """A proxy, on the CPU, for CUDA-graph capture of the sampling: dynamo traces it whole
    (``fullgraph``: no ``.item()``, no data-dependent shapes), with the draft map too, and
    the traced function draws what the plain one draws."""
    traced = torch.compile(sample_draft_tokens, backend="eager", fullgraph=True, dynamic=False)
    logits = torch.randn(6, 40)
    rows = _rows(6, 0.8, top_k=10, top_p=0.9, min_p=0.01)
    rows.temperature[2] = 0.0
    target_ids = torch.randperm(V)[:40]
    for ids_map in (None, target_ids):
        got = traced(logits, ids_map, rows, 16)
        want = sample_draft_tokens(logits, ids_map, rows, 16)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))

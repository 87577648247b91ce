"""Speculative verification: greedy prefix acceptance, the bonus token, logprobs, seeds,
and a chi-square test that rejection sampling reproduces the target distribution with a
deliberately wrong draft distribution (and fails for biased verifiers)."""

from __future__ import annotations

import pytest
import torch
from lmkit.api.sampling_params import SamplingParams
from lmkit.sample import rejection
from lmkit.sample.metadata import SamplingMetadata
from lmkit.sample.sampler import Sampler, make_generator

V = 5  # vocabulary of the statistical tests
CPU = torch.device("cpu")


def metadata(params: list[SamplingParams], drafts: list[list[int]], outputs=None,
             generators=None) -> SamplingMetadata:
    """One row per position: request i repeated len(drafts[i]) + 1 times."""
    rows_p, rows_out, rows_gen = [], [], []
    for i, (p, d) in enumerate(zip(params, drafts, strict=True)):
        base = list(outputs[i]) if outputs else []
        for j in range(len(d) + 1):
            rows_p.append(p)
            rows_out.append(base + d[:j])
            rows_gen.append(generators[i] if generators else None)
    n = len(rows_p)
    vocab = 16 if not outputs else 32
    return SamplingMetadata.build(rows_p, [[0]] * n, rows_out, rows_gen, [None] * n, vocab, CPU)


def test_greedy_accepts_the_longest_prefix_then_the_target_token():
    greedy = SamplingParams(temperature=0.0)
    targets = [[3, 4, 5, 6], [7, 8], [9]]  # argmax at each row of each request
    drafts = [[3, 4, 1], [7], []]  # 2 accepted, then 5; all accepted + bonus 8; plain
    logits = torch.full((7, 16), -5.0)
    for row, tok in enumerate(t for ts in targets for t in ts):
        logits[row, tok] = 5.0
    out = Sampler().sample_requests(logits, metadata([greedy] * 3, drafts), drafts)
    assert out.token_ids == [[3, 4, 5], [7, 8], [9]]
    assert out.num_accepted == [2, 1, 0]


def test_a_step_without_drafts_is_the_plain_sampler():
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=3)]
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))
    gens = [None, make_generator(3, CPU)]
    out = Sampler().sample_requests(logits, metadata(params, [[], []], generators=gens), [[], []])
    plain = Sampler()(logits, metadata(params, [[], []],
                                       generators=[None, make_generator(3, CPU)]))
    assert out.token_ids == [[t] for t in plain.sampled_token_ids.tolist()]


def test_penalties_apply_at_every_draft_position():
    # greedy with a strong repetition penalty: the target at row j sees the drafts before j
    p = SamplingParams(temperature=0.0, repetition_penalty=10.0)
    logits = torch.zeros(3, 32)
    logits[:, 4] = 2.0  # token 4 is the argmax until it appears in the output
    logits[:, 5] = 1.0
    out = Sampler().sample_requests(logits, metadata([p], [[4, 4]], outputs=[[1]]), [[4, 4]])
    assert out.token_ids == [[4, 5]]  # draft 0 accepted; at row 1, 4 is penalised


def test_logprobs_are_those_of_the_emitted_tokens():
    p = SamplingParams(temperature=0.0, logprobs=2)
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    top = logits.argmax(-1).tolist()
    drafts = [[top[0], (top[1] + 1) % 16]]
    out = Sampler().sample_requests(logits, metadata([p], drafts), drafts)
    assert out.token_ids == [[top[0], top[1]]]
    ref = logits.log_softmax(-1)
    assert [lp.token_id for lp in out.logprobs[0]] == out.token_ids[0]
    for row, lp in enumerate(out.logprobs[0]):
        assert lp.logprob == pytest.approx(float(ref[row, lp.token_id]), abs=1e-5)
        assert lp.rank == 1 and len(lp.top) == 2


def test_seeded_requests_do_not_depend_on_the_batch():
    p = SamplingParams(temperature=1.0, seed=7)
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 16, generator=g)
    drafts = [[1, 2, 3]]
    alone = Sampler().sample_requests(logits, metadata([p], drafts, generators=[
        make_generator(7, CPU)]), drafts)
    other = torch.randn(3, 16, generator=g)
    batch_drafts = [[5, 6], [1, 2, 3]]
    together = Sampler().sample_requests(
        torch.cat([other, logits]),
        metadata([SamplingParams(temperature=1.0), p], batch_drafts,
                 generators=[None, make_generator(7, CPU)]), batch_drafts)
    assert together.token_ids[1] == alone.token_ids[0]


# ---------------------------------------------------------------- distribution tests

def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of ``counts`` against ``probs`` (cells expected < 5 are pooled)."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


def speculative_sequences(target: torch.Tensor, draft: torch.Tensor, num_trials: int,
                          length: int, k: int, with_draft_probs: bool, seed: int
                          ) -> torch.Tensor:
    """``num_trials`` sequences of ``length`` tokens from the Markov chain ``target``
    (start state 0), generated speculatively with drafts from the chain ``draft``."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    seqs = [[0] for _ in range(num_trials)]
    sampler = Sampler()
    params = SamplingParams(temperature=1.0)
    while True:
        todo = [i for i, s in enumerate(seqs) if len(s) <= length]
        if not todo:
            break
        drafts, qs, rows = [], [], []
        for i in todo:
            prev, d, q = seqs[i][-1], [], []
            for _ in range(k):
                q.append(draft[prev])
                prev = int(torch.multinomial(draft[prev], 1, generator=g))
                d.append(prev)
            drafts.append(d)
            qs.append(torch.stack(q))
            rows += [target[seqs[i][-1]]] + [target[t] for t in d]
        logits = torch.stack(rows).log()
        md = SamplingMetadata.build([params] * len(rows), [[0]] * len(rows),
                                    [[]] * len(rows), [None] * len(rows), [None] * len(rows),
                                    V, CPU)
        out = sampler.sample_requests(logits, md, drafts, qs if with_draft_probs else None)
        for i, toks in zip(todo, out.token_ids, strict=True):
            seqs[i].extend(toks)
    return torch.tensor([s[1:length + 1] for s in seqs])


def joint_counts_and_probs(seqs: torch.Tensor, target: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    index = seqs[:, 0] * V * V + seqs[:, 1] * V + seqs[:, 2]
    counts = torch.bincount(index, minlength=V ** 3).double()
    p = target.double()
    probs = (p[0][:, None, None] * p[:, :, None] * p[None, :, :]).reshape(-1)
    return counts, probs


def chains(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    target = torch.distributions.Dirichlet(torch.full((V,), 2.0)).sample((V,))
    # a deliberately wrong draft: sharply peaked on other tokens than the target
    draft = torch.rand(V, V, generator=g) ** 4
    draft = draft / draft.sum(-1, keepdim=True)
    return target.float(), draft.float()


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_speculative_samples_follow_the_target_distribution(with_draft_probs):
    torch.manual_seed(0)
    target, draft = chains()
    seqs = speculative_sequences(target, draft, 6000, 3, 3, with_draft_probs, seed=1)
    counts, probs = joint_counts_and_probs(seqs, target)
    assert chi_square_p_value(counts, probs) > 1e-3


def _biased_recovery(probs, draft_rows, draft_token_ids, q_rows=None, q=None):
    return probs.clone()  # the classic bug: resample from p instead of max(0, p - q)


def _biased_acceptance(probs, draft_rows, draft_token_ids, q_at_draft, uniform):
    return uniform < probs[draft_rows, draft_token_ids]  # ignores q(d)


@pytest.mark.parametrize(("name", "fn", "with_draft_probs"), [
    ("recovery_weights", _biased_recovery, True),
    ("recovery_weights", _biased_recovery, False),
    ("accept_probabilistic", _biased_acceptance, True),
])
def test_a_biased_verifier_fails_the_test(monkeypatch, name, fn, with_draft_probs):
    monkeypatch.setattr(rejection, name, fn)
    torch.manual_seed(0)
    target, draft = chains()
    seqs = speculative_sequences(target, draft, 6000, 3, 3, with_draft_probs, seed=1)
    counts, probs = joint_counts_and_probs(seqs, target)
    assert chi_square_p_value(counts, probs) < 1e-6

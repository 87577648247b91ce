"""The Triton rejection-sampling kernel in Triton's CPU interpreter against its torch
reference (exact, with shared noise), the reference against the core's verification,
the reference's output distribution, and the launcher's argument checks. On a machine
with CUDA the compiled kernel is tested by tests/gpu/test_rejection_kernel_gpu.py."""

from __future__ import annotations

import pytest
from interpret_mode import require_triton_interpreter

require_triton_interpreter("CUDA is available: the compiled kernel is tested in tests/gpu")
torch = pytest.importorskip("torch")

from lmkit.sample import rejection  # noqa: E402
from lmkit_kernels.rejection_sample import rejection_sample, rejection_sample_ref  # noqa: E402


def random_batch(num_drafts: list[int], vocab: int, greedy: list[bool], with_q: bool,
                 seed: int = 0, agree: float = 0.5) -> dict:
    """A verification batch; about ``agree`` of the drafts are the rows' argmax."""
    g = torch.Generator().manual_seed(seed)
    num_rows = sum(num_drafts) + len(num_drafts)
    probs = torch.softmax(torch.randn(num_rows, vocab, generator=g) * 2, dim=-1)
    drafts = []
    for i, k in enumerate(num_drafts):
        start = sum(num_drafts[:i]) + i
        for j in range(k):
            top = int(probs[start + j].argmax())
            coin = float(torch.rand(1, generator=g))
            drafts.append(top if coin < agree else int(torch.randint(vocab, (1,), generator=g)))
    q = torch.softmax(torch.randn(len(drafts), vocab, generator=g) * 2, dim=-1) if with_q \
        else None
    return dict(target_probs=probs, draft_token_ids=torch.tensor(drafts, dtype=torch.int64),
                cu_num_drafts=torch.tensor(num_drafts).cumsum(0),
                uniform=torch.rand(len(drafts), generator=g),
                noise=torch.empty(num_rows, vocab).exponential_(generator=g),
                max_num_drafts=max(num_drafts), is_greedy=torch.tensor(greedy),
                draft_probs=q)


@pytest.mark.parametrize(("vocab", "with_q"), [(37, False), (37, True), (5000, False)])
def test_kernel_matches_reference(vocab, with_q):
    batch = random_batch([3, 0, 4, 1, 2, 4], vocab, [False, True, True, False, False, False],
                         with_q, seed=vocab)
    out, num_acc = rejection_sample(**batch)
    ref_out, ref_acc = rejection_sample_ref(**batch)
    assert torch.equal(out, ref_out) and torch.equal(num_acc, ref_acc)
    assert 0 < int(num_acc.sum()) < 14  # some accepted, some rejected
    lengths = (out >= 0).sum(1)
    assert torch.equal(lengths, num_acc + 1)  # accepted drafts + one token, then padding
    everyone_random = dict(batch, is_greedy=None)
    assert torch.equal(rejection_sample(**everyone_random)[0],
                       rejection_sample_ref(**everyone_random)[0])


def test_reference_agrees_with_the_core():
    """Same acceptance decisions as :mod:`lmkit.sample.rejection`, same greedy
    tokens (random recovered tokens are drawn differently: race vs inverse CDF)."""
    num_drafts = [2, 3, 1, 4]
    greedy = [True, False, False, True]
    b = random_batch(num_drafts, 50, greedy, with_q=True, seed=3)
    out, num_acc = rejection_sample_ref(**b)
    starts = torch.tensor([0, 3, 7, 9])
    draft_rows = torch.cat([torch.arange(s, s + k) for s, k in zip(starts, num_drafts,
                                                                    strict=True)])
    draft_req = torch.repeat_interleave(torch.arange(4), torch.tensor(num_drafts))
    draft_pos = torch.cat([torch.arange(k) for k in num_drafts])
    q_at = b["draft_probs"].gather(1, b["draft_token_ids"][:, None]).squeeze(1)
    accepted = rejection.accept_probabilistic(b["target_probs"], draft_rows,
                                              b["draft_token_ids"], q_at, b["uniform"])
    argmax_ok = b["draft_token_ids"] == b["target_probs"][draft_rows].argmax(-1)
    accepted = torch.where(torch.tensor(greedy)[draft_req], argmax_ok, accepted)
    core_acc = rejection.count_accepted(accepted, draft_req, draft_pos, 4, 4)
    assert torch.equal(num_acc, core_acc)
    for i in (0, 3):  # greedy: every emitted token is the row's argmax
        n = int(num_acc[i]) + 1
        rows = torch.arange(starts[i], starts[i] + n)
        assert out[i, :n].tolist() == b["target_probs"][rows].argmax(-1).tolist()


def test_reference_first_token_follows_the_target():
    """Many one-request batches, 2 drafts from a wrong distribution: the first emitted
    token is distributed as the target's first row."""
    g = torch.Generator().manual_seed(5)
    vocab, n = 4, 4000
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.05, 0.15, 0.3, 0.5])
    counts = torch.zeros(vocab)
    for _ in range(n):
        d = torch.multinomial(q, 2, replacement=True, generator=g)
        out, _ = rejection_sample_ref(
            p.expand(3, vocab).contiguous(), d, torch.tensor([2]), torch.rand(2, generator=g),
            torch.empty(3, vocab).exponential_(generator=g), 2, None,
            q.expand(2, vocab).contiguous())
        counts[int(out[0, 0])] += 1
    expected = p * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.3, (counts, expected)  # p = 0.001 with 3 degrees of freedom


def test_launcher_rejects_bad_arguments():
    b = random_batch([2, 1], 11, [False, False], with_q=False)
    with pytest.raises(ValueError, match="one per draft plus one per request"):
        rejection_sample(**dict(b, cu_num_drafts=torch.tensor([1, 2, 3])))
    with pytest.raises(ValueError, match="uniform must have shape"):
        rejection_sample(**dict(b, uniform=torch.rand(2)))
    with pytest.raises(ValueError, match="target_probs has dtype float16"):
        rejection_sample(**dict(b, target_probs=b["target_probs"].half()))
    with pytest.raises(ValueError, match="draft_probs must have shape"):
        rejection_sample(**dict(b, draft_probs=torch.rand(3, 10)))

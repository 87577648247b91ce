"""train-eagle's step batches: one padded batch holds exactly each sequence's rows
(token after, features, the target's draft distribution), its padding is finite and
masked, and the loss over it is the loss over the sequences one list at a time."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from lmkit_plugins.spec.eagle_batches import StepBatcher
from lmkit_plugins.spec.eagle_trainable import distill_loss, padded_distill_loss


def _target(vocab=50, hidden=32):
    torch.manual_seed(1)
    embedding = torch.nn.Embedding(vocab, hidden)
    return SimpleNamespace(embed=lambda ids: embedding(ids).detach().float(),
                           embedding=embedding)


def _features(sequences, width=96, hidden=32):
    torch.manual_seed(2)
    return [(torch.randn(len(s), width, dtype=torch.bfloat16),
             torch.randn(len(s), hidden, dtype=torch.bfloat16)) for s in sequences]


def test_a_batch_holds_each_sequences_rows_and_finite_padding():
    target, draft_rows = _target(), torch.randn(20, 32)
    sequences = [[3, 4, 5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15]]
    features = _features(sequences)
    b = StepBatcher(target, draft_rows, "cpu")(sequences, features, [1, 0, 2])
    assert b.embeds.shape == (3, 4, 32) and b.want.shape == (3, 4, 20)
    assert b.lengths.tolist() == [4, 1, 2] and b.starts.tolist() == [1, 0, 2]
    embedding = target.embedding
    for row, (s, (taps, final)) in enumerate(zip(sequences, features, strict=True)):
        n = len(s) - 2
        # row p: token p + 1, features at p, the target's distribution at p + 1
        assert torch.equal(b.embeds[row, :n], embedding(torch.tensor(s[1:-1])).float())
        assert torch.equal(b.taps[row, :n], taps[:-2].float())
        torch.testing.assert_close(b.want[row, :n],
                                   torch.softmax(final[1:-1].float() @ draft_rows.T, -1))
        assert torch.equal(b.taps[row, n:], torch.zeros_like(b.taps[row, n:]))
    assert torch.isfinite(b.want).all() and torch.isfinite(b.embeds).all()


def test_the_padded_loss_is_the_loss_of_the_sequences(random_trainable_head):
    head = random_trainable_head
    torch.manual_seed(3)
    sizes = (7, 3, 5)
    embeds = [torch.randn(n, 32) for n in sizes]
    taps = [torch.randn(n, 96) for n in sizes]
    want = [torch.softmax(torch.randn(n, 50), -1) for n in sizes]
    pad = torch.nn.utils.rnn.pad_sequence
    # padding filled with large finite values: masked, it must not count
    filled = [pad(x, batch_first=True, padding_value=7.0) for x in (embeds, taps, want)]
    got = padded_distill_loss(head, *filled, torch.tensor(sizes), torch.tensor([2, 0, 1]),
                              3, 3)
    torch.testing.assert_close(got, distill_loss(head, embeds, taps, want, 3, 3, [2, 0, 1]))
    moved = padded_distill_loss(head, *filled, torch.tensor(sizes), torch.tensor([0, 0, 1]),
                                3, 3)
    assert not torch.allclose(moved, got)  # the first trained row is read

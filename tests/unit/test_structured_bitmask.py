"""Packed grammar bitmasks applied to logits: the vectorised torch version against a
token-by-token reference, and the reordering of scheduler rows to sampler rows."""

from __future__ import annotations

import pytest
import torch
from lmkit.sample.bitmask import (
    allocate_bitmask,
    apply_grammar_bitmask,
    apply_token_bitmask,
    apply_token_bitmask_reference,
    bitmask_words,
    logits_bitmask,
    unpack_bitmask,
)


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """Bool [rows, vocab] -> int32 [rows, ceil(vocab / 32)] (bit t % 32 of word t // 32)."""
    rows, vocab = allowed.shape
    words = bitmask_words(vocab)
    padded = torch.zeros(rows, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    packed = (padded.view(rows, words, 32) << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


@pytest.mark.parametrize("vocab", [32, 100, 49152 // 64])
def test_unpack_inverts_pack_including_the_sign_bit(vocab):
    g = torch.Generator().manual_seed(vocab)
    allowed = torch.rand(5, vocab, generator=g) < 0.3
    allowed[0, 31] = True  # bit 31: the int32 sign bit
    assert torch.equal(unpack_bitmask(pack(allowed), vocab), allowed)


@pytest.mark.parametrize("indices", [None, [0, 2], [3]])
@pytest.mark.parametrize("vocab", [64, 77])
def test_vectorised_apply_matches_the_reference(vocab, indices):
    g = torch.Generator().manual_seed(vocab + len(indices or []))
    logits = torch.randn(4, vocab, generator=g)
    bitmask = pack(torch.rand(4, vocab, generator=g) < 0.5)
    expected = logits.clone()
    apply_token_bitmask_reference(expected, bitmask, indices)
    apply_token_bitmask(logits, bitmask, indices)
    assert torch.equal(logits, expected)
    untouched = [r for r in range(4) if indices is not None and r not in indices]
    for r in untouched:
        assert torch.isfinite(logits[r]).all()


def test_tokens_past_the_bitmask_are_masked():
    logits = torch.zeros(1, 70)
    bitmask = torch.full((1, 2), -1, dtype=torch.int32)  # covers 64 tokens
    apply_token_bitmask(logits, bitmask)
    assert torch.isfinite(logits[0, :64]).all() and torch.isinf(logits[0, 64:]).all()


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="int32 bitmask"):
        apply_token_bitmask(torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="3 rows for 2 logits rows"):
        apply_token_bitmask(torch.zeros(2, 64), allocate_bitmask(3, 64))


def test_allocated_bitmask_allows_everything():
    mask = allocate_bitmask(3, 100)
    assert mask.shape == (3, 4) and mask.dtype == torch.int32
    assert unpack_bitmask(mask, 100).all()


def test_scheduler_rows_are_scattered_to_the_sampler_rows_with_drafts():
    # scheduler: "b" owns rows 0..2 (two drafts), "d" owns row 3
    vocab = 64
    allowed = torch.zeros(4, vocab, dtype=torch.bool)
    for row, token in enumerate([5, 6, 7, 9]):
        allowed[row, token] = True
    bitmask = pack(allowed)
    # sampler rows: a (1), b (3: two drafts), c (1), d (1)
    aligned, rows = logits_bitmask(bitmask, {"b": 0, "d": 3}, ["a", "b", "c", "d"], [1, 3, 1, 1])
    assert rows == [1, 2, 3, 5]
    assert torch.equal(aligned[1:4], bitmask[0:3]) and torch.equal(aligned[5], bitmask[3])
    assert (aligned[[0, 4]] == -1).all()
    logits = torch.zeros(6, vocab)
    apply_grammar_bitmask(logits, bitmask, {"b": 0, "d": 3}, ["a", "b", "c", "d"], [1, 3, 1, 1])
    assert [int(r.argmax()) for r in logits[[1, 2, 3, 5]]] == [5, 6, 7, 9]
    assert torch.isfinite(logits[[0, 4]]).all()
    assert logits_bitmask(bitmask, {"x": 0}, ["a"], [1]) is None


def test_rows_already_in_the_sampler_order_are_used_as_they_are():
    bitmask = allocate_bitmask(3, 64)
    aligned, rows = logits_bitmask(bitmask, {"a": 0, "b": 1, "c": 2}, ["a", "b", "c"], [1, 1, 1])
    assert aligned is bitmask and rows == [0, 1, 2]
    swapped, rows = logits_bitmask(bitmask, {"a": 1, "b": 0, "c": 2}, ["a", "b", "c"], [1, 1, 1])
    assert swapped is not bitmask and rows == [0, 1, 2]

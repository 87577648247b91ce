"""A draft head's passes queued before the step's greedy tokens are read
(:mod:`lmkit.worker.early_drafts`): after a step without drafts (a prompt's step, a
plain decode) the catch-up's last input is the token the step sampled, patched in on the
device. Every token and every draft must equal the usual order's
(``LMKIT_EARLY_DRAFTS=0``), which the dense reference checks too; without the patch
the drafts differ."""

from __future__ import annotations

import pytest
from dense_eagle import DenseEagle
from eagle_engine import BATCHINGS, PROMPTS, run_engine
from lmkit.worker import early_drafts


def count_early(monkeypatch) -> list[int]:
    """Count the steps that take the early path (their planned requests)."""
    taken: list[int] = []
    original = early_drafts.early_greedy_targets

    def counted(runner, hidden, order, plan, so):
        targets = original(runner, hidden, order, plan, so)
        if targets is not None:
            taken.append(len(plan))
        return targets

    monkeypatch.setattr("lmkit.worker.model_runner.early_greedy_targets", counted)
    return taken


@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
@pytest.mark.parametrize(("max_num_seqs", "num_blocks", "max_batched"), BATCHINGS)
def test_early_drafts_equal_the_usual_order(tiny, heads, monkeypatch, proposer,
                                            max_num_seqs, num_blocks, max_batched):
    settings = dict(max_num_seqs=max_num_seqs, num_blocks=num_blocks,
                    max_num_batched_tokens=max_batched)
    monkeypatch.setenv(early_drafts.ENV, "0")
    usual, usual_stats = run_engine(tiny, heads[proposer], monkeypatch, PROMPTS, proposer,
                                    **settings)
    monkeypatch.delenv(early_drafts.ENV)
    taken = count_early(monkeypatch)
    got, stats = run_engine(tiny, heads[proposer], monkeypatch, PROMPTS, proposer, **settings)
    assert sum(taken) >= len(PROMPTS)  # every prompt's step at least
    assert got == usual  # the same tokens (the keys) and the same drafts
    for key in ("spec_num_draft_tokens", "spec_num_accepted_tokens"):
        assert stats[key] == usual_stats[key], key
    reference = DenseEagle(tiny, heads[proposer])
    wrong = [k for k, drafts in got.items()
             if drafts != reference.drafts(list(k[1]), len(drafts))]
    assert not wrong, f"{len(wrong)} of {len(got)} drafts differ from the dense head"


def test_without_the_patch_the_drafts_differ(tiny, heads, monkeypatch):
    """The check above can fail: the catch-up reading the batch's stale slot instead of
    the sampled token drafts otherwise after every prompt."""
    monkeypatch.setenv(early_drafts.ENV, "0")
    usual, _ = run_engine(tiny, heads["eagle"], monkeypatch, PROMPTS, "eagle", max_num_seqs=1)
    monkeypatch.delenv(early_drafts.ENV)
    monkeypatch.setattr("lmkit.worker.draft_runner.sampled_patch", lambda *args: None)
    got, _ = run_engine(tiny, heads["eagle"], monkeypatch, PROMPTS, "eagle", max_num_seqs=1)
    assert got != usual


def test_the_switch_is_read_when_the_head_is_built(tiny, heads, monkeypatch):
    """``LMKIT_EARLY_DRAFTS`` counts as it was when the head's runner was built, not as it
    is at each step (``bench/engine_ab.py`` sets B's switches only while B is built)."""
    from lmkit.worker.draft_runner import DraftRunner

    init = DraftRunner.__init__

    def built_then_unset(self, *args, **kwargs):
        init(self, *args, **kwargs)
        monkeypatch.delenv(early_drafts.ENV)  # gone before the first step

    monkeypatch.setattr(DraftRunner, "__init__", built_then_unset)
    monkeypatch.setenv(early_drafts.ENV, "0")
    taken = count_early(monkeypatch)
    run_engine(tiny, heads["eagle"], monkeypatch, PROMPTS[:2], "eagle", max_num_seqs=1)
    assert taken == []

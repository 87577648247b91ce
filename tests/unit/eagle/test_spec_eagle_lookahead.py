"""Decode steps launched ahead (:mod:`lmkit.worker.gpu_lookahead`) beside a draft head,
on the CPU through the graph runners' padded path: with speculation off by batch size
(``disable_by_batch_size``), steps of larger batches are plain decode steps, launched
ahead like any other; taking one runs the head's catch-up over the features kept at
launch, so when the batch shrinks and speculation resumes, the head's drafts still
equal the dense reference (a hole in its KV cache would change them) and every token
equals the run without the lookahead."""

from __future__ import annotations

import pytest
from dense_eagle import DenseEagle
from eagle_engine import (
    PROMPTS,
    lookaheads_on_the_cpu,
    padded_replays,
    run_engine,
    spec_slots_reserved,
)
from lmkit import SamplingParams

# requests finish at different steps: 5 running (speculation off), then 2 (drafting)
MAX_TOKENS = [8, 12, 40, 16, 40]


def lookahead_on_the_cpu(monkeypatch) -> list:
    """Let the runner build its lookahead on the CPU; returns the lookaheads built."""
    from lmkit.worker.gpu_lookahead import DecodeLookahead

    return lookaheads_on_the_cpu(monkeypatch, DecodeLookahead)


@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
def test_steps_launched_ahead_keep_the_head_caught_up(tiny, heads, monkeypatch, proposer):
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in MAX_TOKENS]
    settings = dict(max_num_seqs=8, disable_by_batch_size=2)
    padded_replays(monkeypatch)
    without, _ = run_engine(tiny, heads[proposer], monkeypatch, PROMPTS, proposer, params,
                            **settings)
    made = lookahead_on_the_cpu(monkeypatch)
    got, stats = run_engine(tiny, heads[proposer], monkeypatch, PROMPTS, proposer, params,
                            **settings)
    assert len(made) == 1 and made[0].drafter is not None and made[0].min_batch == 2
    assert made[0].stats.used > 5  # large-batch steps taken from the lookahead
    assert stats["spec_num_steps_off"] > 5 and stats["spec_num_verifications"] > 5
    assert got == without  # same tokens (the keys) and the same drafts
    reference = DenseEagle(tiny, heads[proposer])
    wrong = [key for key, drafts in got.items()
             if drafts != reference.drafts(list(key[1]), len(drafts))]
    assert len(got) > 20 and not wrong, f"{len(wrong)} of {len(got)} drafts differ"


def test_no_lookahead_beside_a_head_that_always_drafts(tiny, heads, monkeypatch):
    """Without ``disable_by_batch_size`` every step verifies drafts: nothing to launch."""
    padded_replays(monkeypatch)
    made = lookahead_on_the_cpu(monkeypatch)
    run_engine(tiny, heads["eagle"], monkeypatch, PROMPTS[:2], "eagle", max_num_seqs=8)
    assert made == []


def _taken_catch_ups(monkeypatch) -> list[bool]:
    """Record, for each catch-up run when a launched step is taken (DecodeLookahead's
    ``_catch_up`` calling ``DraftRunner.propose``), whether it drafted."""
    import sys

    from lmkit.worker.draft_runner import DraftRunner

    calls: list[bool] = []
    propose = DraftRunner.propose

    def record(self, features, step, num_kept, drafting, *args, **kwargs):
        caller = sys._getframe(1).f_code
        if caller.co_name == "_catch_up" and caller.co_filename.endswith("gpu_lookahead.py"):
            calls.append(bool(drafting.any()))
        return propose(self, features, step, num_kept, drafting, *args, **kwargs)

    monkeypatch.setattr(DraftRunner, "propose", record)
    return calls


@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
def test_the_catch_up_is_queued_at_the_launch(tiny, heads, monkeypatch, proposer):
    """Steps launched ahead above the limit queue the head's catch-up at the launch
    (:mod:`lmkit.worker.launch_catch_up`): taking one runs no catch-up of its own unless
    its requests draft after it (the batch drained to the limit); tokens and drafts equal
    those with ``LMKIT_LAUNCH_CATCH_UP=0`` (every catch-up at the taking) and the dense
    reference."""
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in MAX_TOKENS]
    settings = dict(max_num_seqs=8, disable_by_batch_size=2)
    _, drafters = padded_replays(monkeypatch)
    made = lookahead_on_the_cpu(monkeypatch)
    taken = _taken_catch_ups(monkeypatch)
    monkeypatch.setenv("LMKIT_LAUNCH_CATCH_UP", "0")
    before, _ = run_engine(tiny, heads[proposer], monkeypatch, PROMPTS, proposer, params,
                           **settings)
    assert drafters[-1].num_launch_catch_ups == 0 and taken.count(False) > 5
    taken.clear()
    monkeypatch.delenv("LMKIT_LAUNCH_CATCH_UP")
    got, _ = run_engine(tiny, heads[proposer], monkeypatch, PROMPTS, proposer, params,
                        **settings)
    assert drafters[-1].num_launch_catch_ups >= made[-1].stats.used > 5
    assert taken.count(False) == 0 and taken.count(True) >= 1  # the drain: drafts resume
    assert got == before
    reference = DenseEagle(tiny, heads[proposer])
    assert all(d == reference.drafts(list(key[1]), len(d)) for key, d in got.items())


def test_a_catch_up_missing_at_the_launch_shows(tiny, heads, monkeypatch):
    """The check above can fail: with the launch's catch-up claimed but not run, the
    head's KV cache has holes and its drafts after the drain differ from the dense
    reference."""
    import lmkit.worker.launch_catch_up as launch_catch_up

    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in MAX_TOKENS]
    padded_replays(monkeypatch)
    lookahead_on_the_cpu(monkeypatch)
    monkeypatch.setattr(launch_catch_up, "catch_up_at_launch", lambda *args: True)
    got, _ = run_engine(tiny, heads["eagle3"], monkeypatch, PROMPTS, "eagle3", params,
                        max_num_seqs=8, disable_by_batch_size=2)
    reference = DenseEagle(tiny, heads["eagle3"])
    assert any(d != reference.drafts(list(key[1]), len(d)) for key, d in got.items())


TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [1, 0, 0]]


@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
def test_plain_steps_beside_draft_trees_launch_ahead(tiny, heads, monkeypatch, proposer):
    """With draft trees (``speculative.tree``) the steps of batches above the limit are
    plain decode steps and launch ahead too (tree steps run normally: no verification is
    launched ahead of a tree); the head's catch-up over them keeps its KV cache whole,
    so the trees drafted once the batch drains equal the dense reference, and every
    token and tree equals the run without the lookahead."""
    from lmkit.spec_decode.tree import DraftTree
    from lmkit.worker.spec_lookahead import SpecLookahead

    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in MAX_TOKENS]
    settings = dict(max_num_seqs=8, disable_by_batch_size=2, tree=TREE, k=len(TREE))
    padded_replays(monkeypatch)
    without, _ = run_engine(tiny, heads[proposer], monkeypatch, PROMPTS, proposer, params,
                            **settings)
    spec = lookaheads_on_the_cpu(monkeypatch, SpecLookahead)
    made = lookahead_on_the_cpu(monkeypatch)
    slots = spec_slots_reserved(monkeypatch)
    got, stats = run_engine(tiny, heads[proposer], monkeypatch, PROMPTS, proposer, params,
                            **settings)
    # no verification launched ahead, so none of its 2 (k + 1) slots reserved
    assert spec == [] and slots == [0]
    assert len(made) == 1 and made[0].min_batch == 2
    assert made[0].stats.used > 5  # large-batch steps taken from the lookahead
    assert stats["spec_num_steps_off"] > 5 and stats["spec_num_verifications"] > 5
    assert got == without  # same tokens (the keys) and the same trees
    tree = DraftTree.from_paths(TREE)
    reference = DenseEagle(tiny, heads[proposer])
    wrong = [key for key, drafts in got.items()
             if reference.tree_mismatches(list(key[1]), tree, drafts)]
    assert len(got) > 5 and not wrong, f"{len(wrong)} of {len(got)} trees differ"

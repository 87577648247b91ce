"""EAGLE / EAGLE-3 drafts against a dense reference (``dense_eagle.DenseEagle``)
through the graph runners' padded replays: verification, catch-up and draft passes, and
drafts taken inside the replay (the eager steps' checks and the chained passes are in
``test_spec_eagle_drafts.py``; two files so that the test workers share their time)."""

from __future__ import annotations

import pytest
from dense_eagle import DenseEagle
from eagle_engine import PROMPTS, padded_replays, run_engine


@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
@pytest.mark.parametrize("settings", [
    {"max_num_seqs": 8},  # whole prompts, then verification steps
    {"max_num_seqs": 2, "max_num_batched_tokens": 8},  # prompt chunks beside verification
], ids=["batch-8", "small-chunks"])
def test_drafts_equal_a_dense_reference_through_graph_replays(tiny, heads, monkeypatch,
                                                              proposer, settings):
    """Verification steps replayed through the decode graphs (flattened) hand the head
    the same features as eager steps (EAGLE-3's target-layer inputs come out of the
    graphs too); the head's catch-up passes after them replay padded, flattened passes
    (one row per kept position: prompt chunks of at most 1 + k tokens too) and its draft
    passes padded passes of their own: the drafts still equal the dense reference."""
    runners, drafters = padded_replays(monkeypatch)
    got, _ = run_engine(tiny, heads[proposer], monkeypatch, PROMPTS, proposer, **settings)
    assert runners and runners[0].num_flattened_replays > 5
    drafter = drafters[0]
    assert drafter.graphs is not None and drafter.graphs.num_passes > 20  # k - 1 passes
    catch_up = drafter.catch_up_graphs
    assert catch_up is not None and catch_up.width == 64 * (1 if proposer == "eagle" else 3)
    assert catch_up.num_passes > 20
    if "max_num_batched_tokens" in settings:
        assert drafter.num_flattened_catch_ups > 0
    assert drafter.num_eager_catch_ups > 0  # prompts catch up eagerly
    assert runners[0].aux_layers == (() if proposer == "eagle" else (0, 1, 1))
    reference = DenseEagle(tiny, heads[proposer])
    wrong = [key for key, drafts in got.items()
             if drafts != reference.drafts(list(key[1]), len(drafts))]
    assert len(got) > 20 and not wrong, f"{len(wrong)} of {len(got)} drafts differ"


@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
def test_short_steps_replay_flattened_for_target_and_head(tiny, heads, monkeypatch, proposer):
    """With short steps flattened (``executor.flat_step_max_tokens``), prompts run
    through the decode graphs too and the head catches up on them through its catch-up
    graphs: no eager catch-up at all, the drafts still equal the dense reference, and the
    greedy outputs (every token history the head drafted at) those of eager steps."""
    eager, _ = run_engine(tiny, heads[proposer], monkeypatch, PROMPTS, proposer, max_num_seqs=8)
    runners, drafters = padded_replays(monkeypatch, flat_tokens=64)
    got, _ = run_engine(tiny, heads[proposer], monkeypatch, PROMPTS, proposer, max_num_seqs=8)
    assert set(got) == set(eager)
    steps_with_prompts = runners[0].num_flattened_replays
    assert drafters[0].num_eager_catch_ups == 0 and drafters[0].num_flattened_catch_ups > 0
    assert runners[0].max_bs >= 64 and steps_with_prompts > 5
    reference = DenseEagle(tiny, heads[proposer])
    wrong = [key for key, drafts in got.items()
             if drafts != reference.drafts(list(key[1]), len(drafts))]
    assert len(got) > 20 and not wrong, f"{len(wrong)} of {len(got)} drafts differ"


@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
@pytest.mark.parametrize("mode", ["in-graph", "broken-feed", "eager-argmax"])
def test_draft_passes_take_their_drafts_in_the_replay(tiny, heads, monkeypatch, proposer,
                                                      mode):
    """The draft passes' graphs take each pass's greedy drafts themselves and feed them
    (and the head's output) to the next pass on the device, and the catch-up pass's
    graphs take the first drafts: every replayed pass takes its drafts inside the
    replay (the eager argmax runs only after eager catch-ups), and the drafts equal the
    dense reference. A feed that hands the next pass wrong ids is caught by that
    comparison; a head without ``supports_graph_drafts`` takes them eagerly after each
    replay, with the same drafts."""
    from lmkit.worker.draft_graphs import HeadPass
    from lmkit.worker.draft_runner import DraftRunner
    from lmkit_plugins.spec.eagle import EagleProposer
    from lmkit_plugins.spec.eagle3 import Eagle3Proposer

    cls = {"eagle": EagleProposer, "eagle3": Eagle3Proposer}[proposer]
    if mode == "eager-argmax":
        monkeypatch.setattr(cls, "supports_graph_drafts", False)
    calls = {"argmax": 0, "in_graph": 0, "drafting_steps": 0}
    draft_argmax, call, propose = cls.draft_argmax, HeadPass.__call__, DraftRunner.propose

    def counted_argmax(self, hidden):
        calls["argmax"] += 1
        return draft_argmax(self, hidden)

    def head_pass(self, input_ids, positions, ctx):
        hidden = call(self, input_ids, positions, ctx)
        if self.drafts:
            calls["in_graph"] += 1
            if mode == "broken-feed":  # hand the next pass the wrong ids
                self.feed_ids[:len(input_ids)].add_(1).remainder_(256)
        return hidden

    def counted_propose(self, *args, **kwargs):
        out = propose(self, *args, **kwargs)
        calls["drafting_steps"] += bool(out)
        return out

    monkeypatch.setattr(cls, "draft_argmax", counted_argmax)
    monkeypatch.setattr(HeadPass, "__call__", head_pass)
    monkeypatch.setattr(DraftRunner, "propose", counted_propose)
    _, drafters = padded_replays(monkeypatch)
    got, _ = run_engine(tiny, heads[proposer], monkeypatch, PROMPTS, proposer,
                         max_num_seqs=8)
    graphs, catch_up = drafters[0].graphs, drafters[0].catch_up_graphs
    assert graphs is not None and graphs.num_passes > 20
    assert catch_up is not None and catch_up.num_passes > 20
    reference = DenseEagle(tiny, heads[proposer])
    wrong = [key for key, drafts in got.items()
             if drafts != reference.drafts(list(key[1]), len(drafts))]
    if mode == "broken-feed":
        assert len(wrong) > len(got) // 2, "a broken feed went unnoticed"
        return
    assert len(got) > 20 and not wrong, f"{len(wrong)} of {len(got)} drafts differ"
    if mode == "in-graph":
        assert graphs.drafts_in_graph and catch_up.drafts_in_graph
        assert calls["in_graph"] == graphs.num_passes + catch_up.num_passes
        eager = calls["argmax"] - calls["in_graph"]  # first drafts after eager catch-ups
        assert 0 < eager <= drafters[0].num_eager_catch_ups < calls["drafting_steps"]
    else:
        assert not graphs.drafts_in_graph and calls["in_graph"] == 0
        assert calls["argmax"] == graphs.num_passes + calls["drafting_steps"]

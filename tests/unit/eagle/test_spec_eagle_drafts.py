"""EAGLE / EAGLE-3 drafts against a dense reference (``dense_eagle.DenseEagle``): they do
not depend on how the steps were cut (batching, chunked prefill, preemption: the head's
KV is caught up exactly), through the graph runners' padded replays too (verification,
catch-up and draft passes, drafts taken inside the replay), and no draft passes after
steps larger than ``disable_by_batch_size``."""

from __future__ import annotations

import pytest
from dense_eagle import DenseEagle
from eagle_engine import PROMPTS, padded_replays, run_engine
from lmkit import SamplingParams


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

    def counted_propose(self, *args):
        out = propose(self, *args)
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


@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
@pytest.mark.parametrize("settings", [
    {"max_num_seqs": 1},  # one request at a time, whole prompts
    {"max_num_seqs": 8, "max_num_batched_tokens": 16, "num_blocks": 20},  # chunked, preempted
], ids=["one-at-a-time", "chunked-preempted"])
def test_drafts_equal_a_dense_reference(tiny, heads, monkeypatch, settings, proposer):
    """Every draft the paged head made equals the head run densely (no KV cache, whole
    sequences) over the target's hidden states (EAGLE-3: its chosen layers' inputs): the
    head's KV was caught up exactly, whatever the batching, chunking, prefix-cache hits
    and preemptions."""
    got, stats = run_engine(tiny, heads[proposer], monkeypatch, PROMPTS, proposer,
                             **settings)
    if "num_blocks" in settings:
        assert stats["num_preemptions"] > 0
    assert len(got) > 20
    reference = DenseEagle(tiny, heads[proposer])
    wrong = {key: (drafts, reference.drafts(list(key[1]), len(drafts)))
             for key, drafts in got.items()}
    wrong = {key: pair for key, pair in wrong.items() if pair[0] != pair[1]}
    assert not wrong, f"{len(wrong)} of {len(got)} drafts differ, e.g. {next(iter(wrong.values()))}"


def test_no_draft_passes_after_large_steps(tiny, head, baseline, monkeypatch):
    """With speculative.disable_by_batch_size, a step that ran more requests than that
    skips the draft passes (the head still catches up: later drafts stay exact)."""
    from lmkit.worker.draft_runner import DraftRunner

    drafted = []
    propose = DraftRunner.propose

    def record(self, features, step, num_kept, drafting):
        drafted.append((step.num_reqs, bool(drafting.any())))
        return propose(self, features, step, num_kept, drafting)

    monkeypatch.setattr(DraftRunner, "propose", record)
    params = [SamplingParams(temperature=0.0, max_tokens=6 * (i + 1), ignore_eos=True)
              for i in range(len(PROMPTS))]  # fewer requests run as they finish
    got, _ = run_engine(tiny, head, monkeypatch, PROMPTS, params=params, max_num_seqs=8,
                         disable_by_batch_size=2)
    assert any(n > 2 for n, _ in drafted)
    assert all(not d for n, d in drafted if n > 2) and any(d for n, d in drafted if n <= 2)
    reference = DenseEagle(tiny, head)
    assert all(d == reference.drafts(list(key[1]), len(d)) for key, d in got.items())




@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
def test_chained_draft_passes_equal_one_replay_per_pass(tiny, heads, monkeypatch, proposer):
    """The ``k - 1`` greedy draft passes replay as one chained pass sequence (the
    positions, slots and ``seq_lens`` of passes after the first staged with the replay):
    the drafts equal the dense reference and those of one replay per pass
    (``LMKIT_DRAFT_CHAIN=0``), also for requests whose drafts stop early at the context
    limit (their later passes write nowhere)."""
    from lmkit.worker.draft_runner import DraftRunner

    chained = {"calls": 0, "short": 0}
    run = DraftRunner._chained_drafts

    def counted(self, graphs, ids, feat, last, num_drafts, *rest):
        chained["calls"] += 1
        chained["short"] += int((num_drafts < self.k).sum())
        return run(self, graphs, ids, feat, last, num_drafts, *rest)

    monkeypatch.setattr(DraftRunner, "_chained_drafts", counted)
    prompts = [*PROMPTS, "z" * 40]  # 40 + 32 tokens: runs into max_model_len 64
    got = {}
    for chain in ("1", "0"):
        monkeypatch.setenv("LMKIT_DRAFT_CHAIN", chain)
        _, drafters = padded_replays(monkeypatch)
        got[chain], _ = run_engine(tiny, heads[proposer], monkeypatch, prompts, proposer,
                                   max_num_seqs=8)
        graphs = drafters[0].graphs
        assert graphs is not None and graphs.chain == (2 if chain == "1" else 1)
        if chain == "1":
            assert chained["calls"] > 20 and chained["short"] > 0
            assert graphs.num_passes == 2 * chained["calls"]
            calls = chained["calls"]
    assert chained["calls"] == calls  # none with the chain off
    assert got["1"] == got["0"]
    reference = DenseEagle(tiny, heads[proposer])
    wrong = [key for key, drafts in got["1"].items()
             if drafts != reference.drafts(list(key[1]), len(drafts))]
    assert len(got["1"]) > 20 and not wrong, f"{len(wrong)} of {len(got['1'])} drafts differ"

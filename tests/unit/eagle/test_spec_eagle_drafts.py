"""EAGLE / EAGLE-3 drafts against a dense reference (``dense_eagle.DenseEagle``): they do
not depend on how the steps were cut (batching, chunked prefill, preemption: the head's
KV is caught up exactly), chained draft passes equal one replay per pass, and no draft
passes after steps larger than ``disable_by_batch_size``. (Through the graph runners'
padded replays: ``test_spec_eagle_drafts_replays.py``.)"""

from __future__ import annotations

import pytest
from dense_eagle import DenseEagle
from eagle_engine import PROMPTS, padded_replays, run_engine
from lmkit import SamplingParams


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

    def record(self, features, step, num_kept, drafting, **kwargs):
        drafted.append((step.num_reqs, bool(drafting.any())))
        return propose(self, features, step, num_kept, drafting, **kwargs)

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

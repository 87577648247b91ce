"""EAGLE / EAGLE-3 under tensor parallelism (``mp`` executor over gloo, two ranks):
every rank's runner hosts the whole head over the replicated hidden states and the
target's sharded embedding and LM head, so the drafts the engine takes (rank 0's) are
the ones one rank drafts, greedy and sampled, and so are the outputs."""

from __future__ import annotations

import pytest
from eagle_engine import PROMPTS, run_engine
from lmkit import SamplingParams

pytestmark = pytest.mark.slow  # worker processes


@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
def test_drafts_at_tp2_equal_one_rank(tiny, heads, monkeypatch, proposer):
    one, stats_one = run_engine(tiny, heads[proposer], monkeypatch, PROMPTS, proposer,
                                max_num_seqs=4)
    two, stats_two = run_engine(tiny, heads[proposer], monkeypatch, PROMPTS, proposer,
                                parallel={"tensor_parallel_size": 2}, max_num_seqs=4)
    assert (stats_one["executor"], stats_two["executor"]) == ("uniproc", "mp")
    assert len(one) > 20 and two == one
    for key in ("spec_num_draft_tokens", "spec_num_accepted_tokens"):
        assert stats_two[key] == stats_one[key], key


def test_sampled_drafts_at_tp2_equal_one_rank(tiny, heads, monkeypatch):
    """Drafts drawn from the head's distribution with the requests' seeded generators
    are the same on every rank, so rank 0's distributions verify the drafts the others
    wrote into their head caches too."""
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=24, ignore_eos=True)
              for i in range(len(PROMPTS))]
    one, stats_one = run_engine(tiny, heads["eagle3"], monkeypatch, PROMPTS, "eagle3",
                                params=params)
    two, stats_two = run_engine(tiny, heads["eagle3"], monkeypatch, PROMPTS, "eagle3",
                                params=params, parallel={"tensor_parallel_size": 2})
    assert stats_two["executor"] == "mp" and len(one) > 20 and two == one
    assert stats_two["spec_num_accepted_tokens"] == stats_one["spec_num_accepted_tokens"]

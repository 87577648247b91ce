"""``speculative.catch_up_when_off: false``: a request that runs in a step above
``disable_by_batch_size`` stops drafting for good and the draft head does no work for
it (no catch-up pass), in steps run normally and in decode steps launched ahead; outputs
stay those of plain decoding. Requests that never run above the limit draft as before."""

from __future__ import annotations

import pytest
from dense_eagle import DenseEagle
from eagle_engine import COMMON, GREEDY, PROMPTS, padded_replays, run_engine, tokens
from lmkit import LLM, SamplingParams
from test_spec_eagle_lookahead import lookahead_on_the_cpu

PARAMS = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
          for m in (8, 12, 30, 16, 30)]


def head_passes(drafter) -> int:
    """Passes the head ran: replayed catch-ups and drafts, and eager catch-ups."""
    graphs = [g for g in (drafter.graphs, drafter.catch_up_graphs) if g is not None]
    return drafter.num_eager_catch_ups + sum(g.num_passes for g in graphs)


@pytest.mark.parametrize("launched_ahead", [False, True])
def test_requests_above_the_limit_stop_drafting(tiny, heads, monkeypatch, launched_ahead):
    _, drafters = padded_replays(monkeypatch)
    if launched_ahead:
        made = lookahead_on_the_cpu(monkeypatch)
    settings = dict(max_num_seqs=8, disable_by_batch_size=2)
    seen, stats = run_engine(tiny, heads["eagle3"], monkeypatch, PROMPTS, "eagle3", PARAMS,
                             catch_up_when_off=False, **settings)
    # every request started in a step of 5: none drafts, even once the batch drains to 2
    assert seen == {} and stats["spec_num_draft_tokens"] == 0
    assert head_passes(drafters[-1]) == 0
    if launched_ahead:  # every step after the prefill and the first decode step runs
        # ahead, also once the batch drained to the limit (the head left all its requests;
        # before, steps at the limit ran normally: 15 of 30 were taken)
        assert made[-1].stats.used >= stats["num_steps"] - 2 > 20
    # the head catching up (the default): drafts once the batch is down to 2
    seen, stats = run_engine(tiny, heads["eagle3"], monkeypatch, PROMPTS, "eagle3", PARAMS,
                             **settings)
    assert stats["spec_num_draft_tokens"] > 0 and head_passes(drafters[-1]) > 0


def test_outputs_unchanged(tiny, heads):
    opts = dict(num_blocks=96, max_num_seqs=8, **COMMON)
    with LLM(str(tiny), **opts) as llm:
        plain = tokens(llm.generate(PROMPTS, PARAMS))
    with LLM(str(tiny), speculative="eagle3", speculative_model=str(heads["eagle3"]),
             num_speculative_tokens=3, **{"speculative.disable_by_batch_size": 2,
                                          "speculative.catch_up_when_off": False}, **opts) as llm:
        assert tokens(llm.generate(PROMPTS, PARAMS)) == plain
        assert llm.stats()["spec_num_draft_tokens"] == 0


def test_below_the_limit_nothing_changes(tiny, heads, monkeypatch):
    """Steps never above the limit: drafts as with catch-up on, equal to the dense
    reference."""
    padded_replays(monkeypatch)
    seen, _ = run_engine(tiny, heads["eagle3"], monkeypatch, PROMPTS[:2], "eagle3",
                         [GREEDY, GREEDY], max_num_seqs=8, disable_by_batch_size=2,
                         catch_up_when_off=False)
    reference = DenseEagle(tiny, heads["eagle3"])
    assert len(seen) > 10 and all(d == reference.drafts(list(key[1]), len(d))
                                  for key, d in seen.items())

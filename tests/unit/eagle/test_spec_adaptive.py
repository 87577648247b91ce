"""Adaptive speculation (``speculative.adaptive``) beside a draft head, in an in-process
engine on the CPU: where steps with drafts measure slower the switch turns drafting off
(the head still catches up, so its drafts equal the dense reference when drafting
resumes at the next probe), where they measure faster it keeps drafting; tokens never
change; and while drafting is off, decode steps are launched ahead (the lookahead)."""

from __future__ import annotations

import pytest
from dense_eagle import DenseEagle
from eagle_engine import PROMPTS, padded_replays, run_engine
from lmkit import SamplingParams
from lmkit.spec_decode import adaptive as adaptive_mod
from lmkit.spec_decode import manager as manager_mod
from test_spec_eagle_lookahead import lookahead_on_the_cpu

PARAMS = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True) for _ in PROMPTS]


def timed(monkeypatch, spec_s: float, plain_s: float) -> list:
    """A small switch (probes of 2 decode steps, holds of 4) that sees each step with
    drafts take ``spec_s`` and each one without ``plain_s``; returns the switches made."""
    made: list = []

    class Switch(adaptive_mod.AdaptiveSpeculation):
        def __init__(self):
            super().__init__(probe_steps=2, hold_steps=4)
            made.append(self)

        def record(self, speculated, tokens, seconds):
            super().record(speculated, tokens, spec_s if speculated else plain_s)

    monkeypatch.setattr(manager_mod, "AdaptiveSpeculation", Switch)
    return made


@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
def test_slower_drafting_is_turned_off_and_the_head_stays_caught_up(tiny, heads, monkeypatch,
                                                                     proposer):
    plain, _ = run_engine(tiny, heads[proposer], monkeypatch, PROMPTS, proposer, PARAMS,
                          max_num_seqs=8)
    made = timed(monkeypatch, spec_s=3.0, plain_s=1.0)
    got, stats = run_engine(tiny, heads[proposer], monkeypatch, PROMPTS, proposer, PARAMS,
                            max_num_seqs=8, adaptive=True)
    switch = made[0]
    assert switch.num_probes >= 3 and switch.rates[0] < switch.rates[1]
    assert stats["spec_adaptive_probes"] == switch.num_probes
    assert stats["spec_num_steps_off"] > 10  # held off between probes
    # the keys are the token sequences: the same tokens with and without the switch
    assert set(got) <= set(plain)
    reference = DenseEagle(tiny, heads[proposer])
    wrong = [key for key, drafts in got.items()
             if drafts != reference.drafts(list(key[1]), len(drafts))]
    assert len(got) > 10 and not wrong, f"{len(wrong)} of {len(got)} drafts differ"


def test_faster_drafting_is_kept(tiny, heads, monkeypatch):
    made = timed(monkeypatch, spec_s=1.0, plain_s=3.0)
    _, stats = run_engine(tiny, heads["eagle"], monkeypatch, PROMPTS, "eagle", PARAMS,
                          max_num_seqs=8, adaptive=True)
    switch = made[0]
    assert switch.num_probes >= 3 and switch.holding
    # off only for the plain half of each probe (2 steps, and the step deciding it)
    assert stats["spec_num_steps_off"] <= 4 * (switch.num_probes + 1)
    assert stats["spec_num_verifications"] > 3 * stats["spec_num_steps_off"]


def test_steps_are_launched_ahead_while_drafting_is_off(tiny, heads, monkeypatch):
    padded_replays(monkeypatch)
    without, _ = run_engine(tiny, heads["eagle3"], monkeypatch, PROMPTS, "eagle3", PARAMS,
                            max_num_seqs=8)
    timed(monkeypatch, spec_s=3.0, plain_s=1.0)
    looks = lookahead_on_the_cpu(monkeypatch)
    got, stats = run_engine(tiny, heads["eagle3"], monkeypatch, PROMPTS, "eagle3", PARAMS,
                            max_num_seqs=8, adaptive=True)
    assert len(looks) == 1 and looks[0].min_batch == 8  # only the switch turns it off
    assert looks[0].stats.used > 5 and stats["spec_num_steps_off"] > 5
    assert set(got) <= set(without)
    reference = DenseEagle(tiny, heads["eagle3"])
    wrong = [key for key, drafts in got.items()
             if drafts != reference.drafts(list(key[1]), len(drafts))]
    assert not wrong, f"{len(wrong)} of {len(got)} drafts differ"


def test_an_engine_side_proposer_is_not_asked_while_off(tiny, monkeypatch):
    """ngram proposes in the engine: while the switch holds drafting off it is not
    asked, and the tokens equal plain decoding's."""
    from eagle_engine import COMMON
    from lmkit import LLM

    prompts = ["abcabcabcabcabcabc", "0123401234012340123"]  # prompt lookup finds drafts
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    with LLM(str(tiny), **COMMON) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    made = timed(monkeypatch, spec_s=3.0, plain_s=1.0)
    with LLM(str(tiny), speculative="ngram", num_speculative_tokens=3,
             speculative_adaptive=True, **COMMON) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats = llm.engine.stats()
    assert got == plain
    assert made[0].num_probes >= 2 and not made[0].holding
    assert stats["spec_num_steps_off"] > stats["spec_num_verifications"] > 0

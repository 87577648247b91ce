"""Piecewise graphs (:mod:`lmkit.worker.piecewise_graphs`) beside a draft head, on the
CPU through their padded path (``use_graphs=False``: the same fixed buffers, stand-in
backend and padding as the captured graphs, run eagerly): prefill, mixed and
verification steps go through them, and the head reads the target's features from them
(EAGLE: the last hidden state; EAGLE-3: three layers' inputs, the runner's aux
outputs). Drafts and tokens must equal the run without them: a wrong or stale feature
row would change the head's KV cache and its drafts."""

from __future__ import annotations

import pytest
from eagle_engine import PROMPTS, run_engine


def piecewise_on_the_cpu(monkeypatch, max_tokens: int) -> list:
    """Let the runner take its steps of up to ``max_tokens`` tokens through the padded
    piecewise path on the CPU; returns the runners built."""
    import lmkit.worker.model_runner as model_runner
    from lmkit.worker.piecewise_graphs import PiecewiseGraphRunner

    made: list = []

    def capture(config, model, kv_caches, device, num_kv_groups, aux_layers=(), tp_size=1):
        made.append(PiecewiseGraphRunner(model, kv_caches, device, max_tokens,
                                         use_graphs=False, aux_layers=aux_layers))
        return made[-1]

    monkeypatch.setattr(model_runner, "maybe_capture_piecewise", capture)
    return made


@pytest.mark.parametrize("proposer", ["eagle", "eagle3"])
def test_head_features_through_piecewise_steps(tiny, heads, monkeypatch, proposer):
    without, _ = run_engine(tiny, heads[proposer], monkeypatch, PROMPTS, proposer,
                            max_num_seqs=8)
    made = piecewise_on_the_cpu(monkeypatch, 128)
    got, stats = run_engine(tiny, heads[proposer], monkeypatch, PROMPTS, proposer,
                            max_num_seqs=8)
    assert len(made) == 1
    assert len(made[0].aux_layers) == (3 if proposer == "eagle3" else 0)
    # the prefill step and the verification steps (no decode graphs on the CPU here)
    assert made[0].num_replays > 20 and stats["spec_num_verifications"] > 20
    # same tokens (the keys) and the same drafts as without them (which the other
    # modules here check against the dense reference)
    assert len(got) > 20 and got == without

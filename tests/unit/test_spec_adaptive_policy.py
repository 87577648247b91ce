"""The adaptive speculation switch on its own: probes with drafts, then without, holds
the faster mode, probes again; steps of the other mode during a switch are left out."""

from __future__ import annotations

import pytest
from lmkit.spec_decode.adaptive import AdaptiveSpeculation


def run(switch, steps, speculated, tokens, seconds):
    for _ in range(steps):
        switch.record(speculated, tokens, seconds)


def test_probe_then_hold_the_faster_mode_then_probe_again():
    switch = AdaptiveSpeculation(probe_steps=3, hold_steps=5)
    assert switch.drafting() and switch.phase == "probe_spec"
    run(switch, 3, True, 2, 0.004)  # 500 tokens/s with drafts
    assert not switch.drafting() and switch.phase == "probe_plain"
    switch.record(True, 2, 0.004)  # decided before the switch: not counted
    assert switch.windows[False].steps == 0
    run(switch, 3, False, 1, 0.001)  # 1,000 tokens/s without
    assert switch.phase == "hold" and not switch.drafting()
    assert switch.rates == pytest.approx((500.0, 1000.0)) and switch.num_probes == 1
    run(switch, 4, False, 1, 0.001)
    assert switch.phase == "hold"
    switch.record(False, 1, 0.001)  # the fifth held step: probe again
    assert switch.phase == "probe_spec" and switch.drafting()
    run(switch, 3, True, 4, 0.004)  # now 1,000 with drafts...
    run(switch, 3, False, 1, 0.002)  # ...and 500 without
    assert switch.phase == "hold" and switch.drafting() and switch.num_probes == 2
    assert switch.stats() == {"spec_adaptive_drafting": 1.0, "spec_adaptive_probes": 2.0,
                              "spec_adaptive_tokens_per_s_spec": pytest.approx(1000.0),
                              "spec_adaptive_tokens_per_s_plain": pytest.approx(500.0)}


def test_no_drafts_means_no_verdict():
    """Steps that verified no drafts (the proposer found none) never fill the drafting
    probe: the switch keeps drafting rather than judge on nothing."""
    switch = AdaptiveSpeculation(probe_steps=2, hold_steps=4)
    run(switch, 20, False, 1, 0.001)
    assert switch.phase == "probe_spec" and switch.drafting() and switch.num_probes == 0


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="probe_steps must be >= 1"):
        AdaptiveSpeculation(probe_steps=0)
    with pytest.raises(ValueError, match="hold_steps >= 0"):
        AdaptiveSpeculation(hold_steps=-1)

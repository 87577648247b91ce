"""Speculation that turns itself off where it loses (``speculative.adaptive``).

Whether drafting pays depends on the head's acceptance on the traffic at hand and on
what a verification step costs against a plain one -- on a small, host-bound target a
k=3 EAGLE-3 step cost 3.7 plain steps on an H200, so speculation lost at every batch
size. :class:`AdaptiveSpeculation` measures instead of guessing: it alternates short
probes -- ``probe_steps`` decode steps with drafts, then as many without -- and runs the
mode that produced more tokens per second for the next ``hold_steps`` decode steps,
then probes again, so a change of traffic (batch size, prompts) is followed. Only pure
decode steps count (no prompt tokens in them, every request one token plus its
drafts); their wall time is the time since the previous step ended.

Drafting is decided one step ahead (a step's drafts are verified in the next), so a
step that ran in the other mode right after a switch is left out of the probe.
Worst case, when one mode is far worse, the probes cost ``probe_steps`` of its steps
every ``hold_steps``; with the defaults and speculation at 0.45x, about 3%.
"""

from __future__ import annotations

from dataclasses import dataclass

#: decode steps measured in each mode per probe
PROBE_STEPS = 8
#: decode steps run in the better mode between two probes
HOLD_STEPS = 256


@dataclass
class _Window:
    """Tokens and seconds of the decode steps one probe measured in one mode."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        """Tokens per second (0 before any time is measured)."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class AdaptiveSpeculation:
    """The probe-and-hold switch (module docstring).

    Args:
        probe_steps: decode steps measured in each mode per probe.
        hold_steps: decode steps run in the better mode between probes.
    """

    def __init__(self, probe_steps: int = PROBE_STEPS, hold_steps: int = HOLD_STEPS) -> None:
        if probe_steps < 1 or hold_steps < 0:
            raise ValueError(f"probe_steps must be >= 1 and hold_steps >= 0, got "
                             f"{probe_steps} and {hold_steps}")
        self.probe_steps = probe_steps
        self.hold_steps = hold_steps
        self.phase = "probe_spec"  # then "probe_plain", then "hold", then again
        self.holding = True  # the mode held: drafting or not
        self.held = 0
        self.windows = {True: _Window(), False: _Window()}
        self.num_probes = 0  # probes finished
        self.rates = (0.0, 0.0)  # the last probe's (with drafts, without) tokens/s

    def drafting(self) -> bool:
        """Whether the steps now scheduled should be followed by drafts."""
        if self.phase == "probe_spec":
            return True
        if self.phase == "probe_plain":
            return False
        return self.holding

    def record(self, speculated: bool, tokens: int, seconds: float) -> None:
        """One pure decode step: whether it verified drafts, the tokens it produced and
        its wall time."""
        if self.phase == "hold":
            self.held += 1
            if self.held >= self.hold_steps:
                self.phase = "probe_spec"
                self.windows = {True: _Window(), False: _Window()}
            return
        want = self.phase == "probe_spec"
        if speculated != want:  # decided before the switch: not this probe's mode
            return
        window = self.windows[want]
        window.steps += 1
        window.tokens += tokens
        window.seconds += seconds
        if window.steps < self.probe_steps:
            return
        if want:
            self.phase = "probe_plain"
            return
        self.rates = (self.windows[True].rate, self.windows[False].rate)
        self.holding = self.rates[0] > self.rates[1]
        self.phase, self.held = "hold", 0
        self.num_probes += 1

    def stats(self) -> dict[str, float]:
        """``spec_adaptive_drafting`` (1/0), ``spec_adaptive_probes`` and the last probe's
        tokens per second with and without drafts."""
        return {"spec_adaptive_drafting": float(self.drafting()),
                "spec_adaptive_probes": float(self.num_probes),
                "spec_adaptive_tokens_per_s_spec": self.rates[0],
                "spec_adaptive_tokens_per_s_plain": self.rates[1]}

"""Step phases: how an engine feature plugs into the engine core's step.

A feature (structured output, speculative decoding, KV offload) is a :class:`StepPhase`
that overrides the points it needs; every point has a no-op default. The engine core
builds its list of phases once, at construction, and each step runs::

    phases.before_schedule()                     # e.g. grammars that became ready
    scheduler_output = scheduler.schedule()
    phases.after_schedule(scheduler_output)      # e.g. bitmasks, draft distributions
    runner_output = executor.execute(scheduler_output)
    outputs = scheduler.update_from_output(scheduler_output, runner_output)
    phases.after_model_output(...)               # e.g. advance grammars, propose drafts

Phases run in list order at every point. Requests enter through :meth:`add_request`
(after the scheduler queued them) and leave early through :meth:`abort_requests`;
finished requests are visible in ``outputs`` and, for those finished outside the
step, in ``scheduler_output.finished_req_ids`` of the next step.

A phase whose plugin (a proposer, a grammar) fails for some requests does not raise out
of the step: it stops serving them and hands them over through :meth:`StepPhase.
take_failed`; at the end of the step the engine core ends them with an error that names
the plugin, and aborts them in every phase.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmkit.api.outputs import EngineCoreOutput
    from lmkit.api.request import Request
    from lmkit.api.runner_output import ModelRunnerOutput
    from lmkit.api.scheduler_output import SchedulerOutput
    from lmkit.errors import InvalidRequestError


class StepPhase:
    """An engine feature's part in the step loop; override what the feature needs."""

    def add_request(self, request: Request) -> None:  # noqa: B027 - optional
        """A request the scheduler just queued. Raise
        :class:`~lmkit.errors.InvalidRequestError` to refuse it (the engine then takes
        it back out of the scheduler and every phase)."""

    def abort_requests(self, request_ids: Sequence[str]) -> None:  # noqa: B027 - optional
        """Requests aborted from outside the step (unknown ids must be ignored)."""

    def before_schedule(self) -> None:  # noqa: B027 - optional
        """Start of a step, before the scheduler plans it."""

    def after_schedule(self, scheduler_output: SchedulerOutput) -> None:  # noqa: B027
        """The step is planned and not yet executed: fill per-step inputs of the plan."""

    def after_model_output(self, scheduler_output: SchedulerOutput,  # noqa: B027
                           runner_output: ModelRunnerOutput,
                           outputs: list[EngineCoreOutput]) -> None:
        """The scheduler took the step's tokens; ``outputs`` may still be amended (a
        request this feature ends gets its ``finish_reason`` here)."""

    def take_rejected(self) -> list[tuple[str, InvalidRequestError]]:
        """``(request id, error)`` of requests refused since the last call, after
        :meth:`add_request` accepted them (they produce no output)."""
        return []

    def take_failed(self) -> dict[str, str]:
        """Requests this feature's plugin failed since the last call (it raised, or
        broke its contract), each with a message naming the plugin and what it did. The
        engine calls it at the end of every step and ends those requests with
        ``finish_reason="error"``; the phase must already have stopped serving them."""
        return {}

    def stats(self) -> dict[str, Any]:
        """Counters this feature adds to ``EngineCore.stats()``."""
        return {}

    def shutdown(self) -> None:  # noqa: B027 - optional
        """The engine is shutting down (before the executor stops); must not raise."""


class StepPhases:
    """The engine's phases, run in order at each point (itself a :class:`StepPhase`).

    Each step point (:meth:`before_schedule`, :meth:`after_schedule`,
    :meth:`after_model_output`) runs only the phases whose class overrides it, worked
    out once here: a phase that acts only when requests arrive (the pooling checks)
    costs the step nothing. Request entry/exit, refusals, stats and shutdown reach
    every phase.
    """

    def __init__(self, phases: Iterable[StepPhase]) -> None:
        self.phases: tuple[StepPhase, ...] = tuple(phases)
        # per step point, only the phases that override it: a phase that acts only when
        # requests arrive (pooling checks) costs the step nothing
        self._before = self._overriding("before_schedule")
        self._after_schedule = self._overriding("after_schedule")
        self._after_output = self._overriding("after_model_output")
        self._failing = self._overriding("take_failed")

    def _overriding(self, point: str) -> tuple[StepPhase, ...]:
        base = getattr(StepPhase, point)
        return tuple(p for p in self.phases if getattr(type(p), point, base) is not base)

    def add_request(self, request: Request) -> None:
        """Every phase's :meth:`StepPhase.add_request`, in order."""
        for phase in self.phases:
            phase.add_request(request)

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        """Every phase's :meth:`StepPhase.abort_requests`."""
        for phase in self.phases:
            phase.abort_requests(request_ids)

    def before_schedule(self) -> None:
        """Every phase's :meth:`StepPhase.before_schedule`."""
        for phase in self._before:
            phase.before_schedule()

    def after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        """Every phase's :meth:`StepPhase.after_schedule`."""
        for phase in self._after_schedule:
            phase.after_schedule(scheduler_output)

    def after_model_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput,
                           outputs: list[EngineCoreOutput]) -> None:
        """Every phase's :meth:`StepPhase.after_model_output`."""
        for phase in self._after_output:
            phase.after_model_output(scheduler_output, runner_output, outputs)

    def take_rejected(self) -> list[tuple[str, InvalidRequestError]]:
        """Every phase's refusals since the last call."""
        return [rejected for phase in self.phases for rejected in phase.take_rejected()]

    def take_failed(self) -> dict[str, str]:
        """Every phase's failed requests since the last call (the first reason given
        for a request wins)."""
        failed: dict[str, str] = {}
        for phase in self._failing:
            for rid, message in phase.take_failed().items():
                failed.setdefault(rid, message)
        return failed

    def stats(self) -> dict[str, Any]:
        """Every phase's counters, merged."""
        merged: dict[str, Any] = {}
        for phase in self.phases:
            merged.update(phase.stats())
        return merged

    def shutdown(self) -> None:
        """Every phase's :meth:`StepPhase.shutdown`."""
        for phase in self.phases:
            phase.shutdown()

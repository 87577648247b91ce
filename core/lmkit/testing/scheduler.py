"""Conformance suite for schedulers (:class:`lmkit.api.Scheduler`).

The scheduler under test is driven with a deterministic fake model runner
(:mod:`lmkit.testing.fake_runner`) that computes tokens through the block tables it is
given, so any bookkeeping mistake changes a token. Every step of every property
checks: the token budget (``max_num_batched_tokens``), ``max_num_seqs``, consistent
counts, no finished request scheduled, and that a real runner could execute the
output. Properties:

* ``every request finishes``: mixed prompts (some sharing cached prefixes) produce
  exactly the tokens each produces alone, with the right finish reason; the runner is
  told of every finished request; no KV block stays in use;
* ``budget and max_num_seqs``: a tight budget, few sequences, and chunked prefill off
  (no prompt may then be split);
* ``stop conditions``: EOS, ``stop_token_ids`` and ``max_tokens``;
* ``no starvation under a long-prompt flood``: the oldest request (the longest prompt)
  finishes while two new prompts arrive every step, more than the budget can serve;
* ``preemption and resumption``: a KV pool too small for the batch forces preemption;
  preempted requests resume with every token right;
* ``aborts free blocks``: aborting waiting and running requests (and unknown ids)
  frees their blocks: afterwards a request needing the whole pool runs;
* ``waiting for grammar``: a request in status ``WAITING_FOR_GRAMMAR`` is never
  scheduled (later arrivals are) until it is set ``WAITING``; then it runs right, and
  a request aborted while waiting for its grammar leaves nothing behind (built with
  ``SchedulerContext(num_lookahead_slots=1)``).

Schedulers are built as the engine builds them:
``cls(config, num_blocks=..., options=..., context=SchedulerContext(...))``.

Use :func:`check_scheduler`, or subclass :class:`SchedulerConformance` and define a
``scheduler`` fixture returning the spec (or class). Schedulers that never preempt by
design set ``requires_preemption = False`` on the subclass.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from typing import Any

from lmkit.testing.failure import (
    CONSTRUCTOR_PROPERTY,
    NotApplicable,
    Target,
    resolve_target,
    run_checks,
    skip_if_not_applicable,
)
from lmkit.testing.fake_runner import VOCAB
from lmkit.testing.scheduler_drive import SUITE, Drive, Setup


def _prompts(rng: random.Random, n: int, lo: int, hi: int) -> list[list[int]]:
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def every_request_finishes(t: Target) -> None:
    rng = random.Random(0)
    shared = [rng.randrange(VOCAB) for _ in range(12)]  # three blocks of 4
    d = Drive(t, "every request finishes", Setup(max_num_batched_tokens=32, max_num_seqs=4),
              "10 requests, prompts 1-40 tokens (4 sharing a 12-token prefix), max_tokens 1-9")
    for i, prompt in enumerate(_prompts(rng, 6, 1, 40)):
        d.add(f"r{i}", prompt, max_tokens=rng.randint(1, 9))
    for i in range(4):
        d.add(f"s{i}", shared + [i] * (i + 1), max_tokens=5)
    d.run()


def budget_and_max_num_seqs(t: Target) -> None:
    rng = random.Random(1)
    for setup in (Setup(max_num_batched_tokens=8, max_num_seqs=3),
                  Setup(max_num_batched_tokens=48, max_num_seqs=2, chunked=False,
                        max_model_len=48)):
        d = Drive(t, "budget and max_num_seqs", setup,
                  "12 requests, prompts 2-30 tokens, max_tokens 1-6, two arriving per step")
        pending = [(f"r{i}", p, rng.randint(1, 6)) for i, p in enumerate(_prompts(rng, 12, 2, 30))]

        def feed(drive: Drive, queue: list[Any] = pending) -> None:
            for rid, prompt, max_tokens in queue[:2]:
                drive.add(rid, prompt, max_tokens)
            del queue[:2]

        feed(d)
        d.run(on_step=feed)


def stop_conditions(t: Target) -> None:
    from lmkit.testing.fake_runner import reference_output

    d = Drive(t, "stop conditions", Setup(), "EOS after 3 tokens, a stop token after 2, "
              "max_tokens 5, and max_model_len 24 reached by a 20-token prompt")
    p_eos, p_stop, p_len = [5, 6, 7], [8, 9], [10, 11, 12, 13]
    d.add("eos", p_eos, max_tokens=10, eos=reference_output(p_eos, 10)[2])
    d.add("stop", p_stop, max_tokens=10, stop_token_ids=(reference_output(p_stop, 10)[1],))
    d.add("length", p_len, max_tokens=5)
    d.run()
    d2 = Drive(t, "stop conditions", Setup(max_model_len=24), "a 20-token prompt, "
               "max_tokens 50, max_model_len 24")
    d2.add("ctx", list(range(20)), max_tokens=50)
    d2.run()


def no_starvation_under_flood(t: Target) -> None:
    rng = random.Random(2)
    flood_steps = 60
    setup = Setup(max_num_batched_tokens=24, max_num_seqs=4, num_blocks=1024)
    d = Drive(t, "no starvation under a long-prompt flood", setup,
              f"one 40-token request, then two prompts of 6-30 tokens arriving every step for "
              f"{flood_steps} steps (more than the budget serves)")
    d.add("oldest", [rng.randrange(VOCAB) for _ in range(40)], max_tokens=4)
    counter = iter(range(10**6))

    def flood(drive: Drive) -> None:
        if drive.num_steps < flood_steps:
            for prompt in _prompts(rng, 2, 6, 30):
                drive.add(f"f{next(counter)}", prompt, max_tokens=3)

    flood(d)
    d.run(max_steps=2000, on_step=flood)
    step = d.finished_step["oldest"]
    if step >= flood_steps:
        raise d.fail(f"the oldest request finished only at step {step}, after the flood "
                     f"stopped at step {flood_steps}: newer requests kept overtaking it")


def preemption_and_resumption(t: Target, requires_preemption: bool = True) -> None:
    rng = random.Random(3)
    setup = Setup(num_blocks=13, max_num_batched_tokens=64, max_num_seqs=8)
    d = Drive(t, "preemption and resumption", setup,
              "5 requests of 8-10 prompt tokens and 12 output tokens in a pool of 12 usable "
              "blocks (about 6 each needed)")
    for i, prompt in enumerate(_prompts(rng, 5, 8, 10)):
        d.add(f"r{i}", prompt, max_tokens=12)
    d.run()
    if requires_preemption and not d.preempted:
        raise d.fail("no request was ever preempted (SchedulerOutput.preempted_req_ids "
                     "stayed empty) although the pool cannot hold the batch; if the scheduler "
                     "avoids preemption by design, set requires_preemption = False")


def aborts_free_blocks(t: Target) -> None:
    from lmkit.api.request import RequestStatus

    rng = random.Random(4)
    setup = Setup(num_blocks=33, max_num_batched_tokens=32, max_num_seqs=3)
    d = Drive(t, "aborts free blocks", setup,
              "6 requests; after 3 steps two running and one waiting request are aborted, "
              "plus an unknown id; then a request needing the whole pool")
    for i, prompt in enumerate(_prompts(rng, 6, 10, 20)):
        d.add(f"r{i}", prompt, max_tokens=20)
    for _ in range(3):
        d.step()
    running = [rid for rid in d.runner.states if rid not in d.finished]
    waiting = [rid for rid in d.expected if rid not in d.runner.states and rid not in d.finished]
    victims = running[:2] + waiting[:1]
    d.abort(victims + ["no-such-request"])
    d.sched.finish_requests(victims[:1], RequestStatus.FINISHED_ABORTED)  # twice: ignored
    d.step()
    told = d.runner.states.keys() & set(victims)
    if told:
        raise d.fail(f"aborted request(s) {sorted(told)} were not listed in the next "
                     "SchedulerOutput.finished_req_ids, so the runner keeps their state")
    d.run()
    usable = setup.num_blocks - 1
    big = [rng.randrange(VOCAB) for _ in range(usable * setup.block_size - 4)]
    d.add("whole-pool", big, max_tokens=3)
    d.run()


def waiting_for_grammar(t: Target) -> None:
    from lmkit.api.request import RequestStatus

    rng = random.Random(5)
    setup = Setup(num_blocks=64, max_num_batched_tokens=32, max_num_seqs=4,
                  num_lookahead_slots=1)
    d = Drive(t, "waiting for grammar", setup,
              "4 requests; r0 and r2 wait for their grammar for 6 steps, r2 is then aborted")
    requests = [d.add(f"r{i}", prompt, max_tokens=6)
                for i, prompt in enumerate(_prompts(rng, 4, 4, 12))]
    for i in (0, 2):
        requests[i].status = RequestStatus.WAITING_FOR_GRAMMAR
    scheduled: set[str] = set()
    for _ in range(6):
        d.step()
        scheduled |= set(d.runner.states) | set(d.finished)
    early = sorted(scheduled & {"r0", "r2"})
    if early:
        raise d.fail(f"request(s) {early} in status WAITING_FOR_GRAMMAR were scheduled")
    if "r1" not in scheduled:
        raise d.fail("requests behind one waiting for its grammar were not scheduled: "
                     "skip it (it keeps its place), do not stop admitting at it")
    requests[0].status = RequestStatus.WAITING
    d.abort(["r2"])
    d.run()


CHECKS: dict[str, Callable[..., None]] = {
    "every request finishes": every_request_finishes,
    "budget and max_num_seqs": budget_and_max_num_seqs,
    "stop conditions": stop_conditions,
    "no starvation under a long-prompt flood": no_starvation_under_flood,
    "preemption and resumption": preemption_and_resumption,
    "aborts free blocks": aborts_free_blocks,
    "waiting for grammar": waiting_for_grammar,
}


def constructor_signature(t: Target) -> None:
    """The scheduler is built as ``cls(config, num_blocks=N, options=opts)``."""
    setup = Setup()
    t.build(SUITE, "scheduler", CONSTRUCTOR_PROPERTY, setup.describe(), setup.config(),
            num_blocks=setup.num_blocks, options=t.options)


def _checks(t: Target, requires_preemption: bool) -> dict[str, Callable[[], None]]:
    out: dict[str, Callable[[], None]] = {CONSTRUCTOR_PROPERTY: lambda: constructor_signature(t)}
    out.update({name: (lambda f=f: f(t)) for name, f in CHECKS.items()})
    out["preemption and resumption"] = lambda: preemption_and_resumption(t, requires_preemption)
    return out


def check_scheduler(scheduler: Any, options: Any = None, only: Iterable[str] | None = None,
                    requires_preemption: bool = True) -> dict[str, str]:
    """Run every scheduler property against ``scheduler`` (a Spec, Registration or
    Scheduler subclass built as ``cls(config, num_blocks=..., options=...,
    context=...)``).

    :raises ConformanceFailure: naming the first failing property, the workload, the
        scheduler settings and the step.
    """
    t = resolve_target(scheduler, options)
    return run_checks(_checks(t, requires_preemption), set(only) if only is not None else None)


class SchedulerConformance:
    """pytest base class: one test per scheduler property. Define a ``scheduler``
    fixture returning the spec or class (or ``(spec, options)``)."""

    requires_preemption = True

    def _check(self, scheduler: Any, prop: str) -> None:
        t = resolve_target(scheduler)
        skip_if_not_applicable(_checks(t, self.requires_preemption)[prop])

    def test_constructor_signature(self, scheduler: Any) -> None:
        self._check(scheduler, CONSTRUCTOR_PROPERTY)

    def test_every_request_finishes(self, scheduler: Any) -> None:
        self._check(scheduler, "every request finishes")

    def test_budget_and_max_num_seqs(self, scheduler: Any) -> None:
        self._check(scheduler, "budget and max_num_seqs")

    def test_stop_conditions(self, scheduler: Any) -> None:
        self._check(scheduler, "stop conditions")

    def test_no_starvation_under_flood(self, scheduler: Any) -> None:
        self._check(scheduler, "no starvation under a long-prompt flood")

    def test_preemption_and_resumption(self, scheduler: Any) -> None:
        self._check(scheduler, "preemption and resumption")

    def test_aborts_free_blocks(self, scheduler: Any) -> None:
        self._check(scheduler, "aborts free blocks")

    def test_waiting_for_grammar(self, scheduler: Any) -> None:
        self._check(scheduler, "waiting for grammar")


__all__ = ["CHECKS", "NotApplicable", "SchedulerConformance", "check_scheduler"]

"""Driving a scheduler with the fake runner while checking every step's output."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from lmkit.api.request import Request, RequestStatus
from lmkit.api.sampling_params import SamplingParams
from lmkit.api.scheduler import SchedulerContext
from lmkit.config.schema import LMKitConfig
from lmkit.testing.failure import Target
from lmkit.testing.fake_runner import FakeRunner, RunnerViolation, reference_output

SUITE = "scheduler"


@dataclass
class Setup:
    """A scheduler configuration of the suite (block size in tokens, pool in blocks)."""

    block_size: int = 4
    num_blocks: int = 256
    max_num_batched_tokens: int = 32
    max_num_seqs: int = 4
    chunked: bool = True
    prefix_caching: bool = True
    max_model_len: int = 256
    num_lookahead_slots: int = 0  # SchedulerContext.num_lookahead_slots

    def config(self) -> LMKitConfig:
        """The engine configuration the scheduler is built with."""
        return LMKitConfig.model_validate({
            "model": {"max_model_len": self.max_model_len},
            "cache": {"block_size": self.block_size,
                      "enable_prefix_caching": self.prefix_caching},
            "scheduler": {"max_num_batched_tokens": self.max_num_batched_tokens,
                          "max_num_seqs": self.max_num_seqs,
                          "enable_chunked_prefill": self.chunked},
        })

    def describe(self) -> str:
        return (f"block_size {self.block_size}, {self.num_blocks} KV blocks, "
                f"max_num_batched_tokens {self.max_num_batched_tokens}, max_num_seqs "
                f"{self.max_num_seqs}, chunked prefill {'on' if self.chunked else 'off'}, "
                f"prefix caching {'on' if self.prefix_caching else 'off'}, "
                f"{self.num_lookahead_slots} lookahead slots")


@dataclass
class Expected:
    tokens: list[int]
    reason: str


@dataclass
class Drive:
    """One scheduler instance, the fake runner, and what every request must produce."""

    target: Target
    prop: str
    setup: Setup
    workload: str
    sched: Any = None
    runner: FakeRunner = field(init=False)
    expected: dict[str, Expected] = field(default_factory=dict)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finished: dict[str, str] = field(default_factory=dict)  # rid -> finish reason
    finished_step: dict[str, int] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)
    preempted: set[str] = field(default_factory=set)
    num_steps: int = 0
    _clock: Any = field(default_factory=lambda: itertools.count(1))

    def __post_init__(self) -> None:
        where = f"{self.workload}; {self.setup.describe()}"
        # the engine's call: cls(config, num_blocks=..., options=..., context=...)
        context = SchedulerContext(num_lookahead_slots=self.setup.num_lookahead_slots)
        self.sched = self.target.build(SUITE, "scheduler", self.prop, where,
                                       self.setup.config(), num_blocks=self.setup.num_blocks,
                                       options=self.target.options, context=context)
        self.runner = FakeRunner(self.setup.num_blocks, self.setup.block_size)

    def fail(self, detail: str) -> AssertionError:
        """A failure of this drive's property, naming the setup, workload and step."""
        where = f"{self.workload}; {self.setup.describe()}; at step {self.num_steps}"
        return self.target.fail(SUITE, self.prop, where, detail)

    def add(self, rid: str, prompt: list[int], max_tokens: int, eos: int | None = None,
            stop_token_ids: tuple[int, ...] = ()) -> Request:
        """Submit a greedy request and record what it must produce alone."""
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                stop_token_ids=list(stop_token_ids))
        request = Request(rid, prompt, params, eos_token_id=eos,
                          arrival_time=float(next(self._clock)))
        ref = reference_output(prompt, max_tokens, eos, self.setup.max_model_len)
        for i, tok in enumerate(ref):
            if tok in stop_token_ids:
                ref = ref[: i + 1]
                break
        stopped = bool(ref) and (ref[-1] == eos or ref[-1] in stop_token_ids)
        self.expected[rid] = Expected(ref, "stop" if stopped else "length")
        self.sched.add_request(request)
        return request

    def abort(self, rids: list[str]) -> None:
        """Abort requests from outside the step loop."""
        self.sched.finish_requests(rids, RequestStatus.FINISHED_ABORTED)
        self.aborted.update(r for r in rids if r in self.expected and r not in self.finished)

    def step(self) -> None:
        """One schedule -> execute -> update, checking the step's invariants."""
        self.num_steps += 1
        s, so = self.setup, self.sched.schedule()
        counts = so.num_scheduled_tokens
        total = sum(counts.values())
        if so.total_num_scheduled_tokens != total:
            raise self.fail(f"total_num_scheduled_tokens is {so.total_num_scheduled_tokens} "
                            f"but num_scheduled_tokens add up to {total}")
        if total > s.max_num_batched_tokens:
            raise self.fail(f"scheduled {total} tokens, over max_num_batched_tokens "
                            f"{s.max_num_batched_tokens}: {dict(counts)}")
        if len(counts) > s.max_num_seqs:
            raise self.fail(f"scheduled {len(counts)} requests in one step, over max_num_seqs "
                            f"{s.max_num_seqs}: {sorted(counts)}")
        done = sorted(set(counts) & (set(self.finished) | self.aborted))
        if done:
            raise self.fail(f"scheduled finished or aborted request(s) {done}")
        self.preempted |= so.preempted_req_ids
        if not s.chunked:
            for nd in so.scheduled_new_reqs:
                n = counts[nd.req_id]
                whole = len(nd.prompt_token_ids) + len(nd.output_token_ids) - nd.num_computed_tokens
                if n < whole:
                    raise self.fail(f"with chunked prefill off, request {nd.req_id!r} got a "
                                    f"{n}-token chunk of its {whole} uncomputed tokens")
        try:
            result = self.runner.execute(so)
        except RunnerViolation as e:
            raise self.fail(f"the scheduler output cannot be executed: {e}") from e
        for out in self.sched.update_from_output(so, result):
            rid = out.request_id
            if rid in self.finished:
                raise self.fail(f"request {rid!r} produced output after it finished")
            self.outputs.setdefault(rid, []).extend(out.new_token_ids)
            if out.finished:
                self.finished[rid] = out.finish_reason or ""
                self.finished_step[rid] = self.num_steps

    def run(self, max_steps: int = 2000, on_step: Any = None) -> None:
        """Step until no request is unfinished; then check every request's tokens,
        that the runner was told of every finished request, and the KV usage."""
        while self.sched.has_unfinished_requests():
            if self.num_steps >= max_steps:
                left = sorted(set(self.expected) - set(self.finished) - self.aborted)
                raise self.fail(f"requests {left[:8]} did not finish within {max_steps} "
                                "steps (starvation or a livelock)")
            self.step()
            if on_step is not None:
                on_step(self)
        self.check_results()

    def check_results(self) -> None:
        """Tokens and finish reasons of every request equal what it produces alone."""
        for rid, exp in self.expected.items():
            if rid in self.aborted:
                continue
            got, reason = self.outputs.get(rid, []), self.finished.get(rid)
            if reason is None:
                raise self.fail(f"request {rid!r} never finished (has_unfinished_requests() "
                                "returned False while it was still unfinished)")
            if got != exp.tokens or reason != exp.reason:
                raise self.fail(
                    f"request {rid!r} produced {got} ({reason}); run alone it produces "
                    f"{exp.tokens} ({exp.reason}): a wrong block table, prefix-cache hit, "
                    "resumption or stop check")
        self.step()  # an idle step tells the runner about the last finished requests
        if self.runner.states:
            raise self.fail(f"the runner still holds state for {sorted(self.runner.states)}: "
                            "finished or aborted requests must be listed once in a later "
                            "SchedulerOutput.finished_req_ids")
        usage = self.sched.get_stats().get("kv_cache_usage")
        if usage not in (None, 0, 0.0):
            raise self.fail(f"get_stats()['kv_cache_usage'] is {usage} with no request left: "
                            "blocks were not freed")

"""Conformance suite for executors (:class:`lmkit.api.Executor`).

The executor under test and the built-in ``uniproc`` executor load the same tiny
random model (:func:`lmkit.testing.tiny_model.make_tiny_model`, or a directory you
pass). A real :class:`~lmkit.api.PagedScheduler` plans steps for a batch of greedy and
seeded-sampling requests in a KV pool small enough to force preemption; every step's
:class:`~lmkit.api.SchedulerOutput` goes to both executors. Properties:

* ``model info``: :meth:`start` reports what ``uniproc`` reports (bytes per KV block,
  device, dtype; the first of N tensor-parallel ranks reports its share of the bytes per
  KV block: 1/N, or one KV group more when the KV heads do not divide by N);
* ``tokens equal uniproc``: every step's request ids and sampled tokens are identical
  (through chunked prefill, prefix-cache hits, preemption and finished requests);
* ``offload methods``: with no offload tier configured, ``offload_lookup`` answers
  ``(0, 0)``, ``offload_stats`` ``{}`` and ``close_offload`` returns;
* ``shutdown twice``: ``shutdown()`` may be called twice.

Every property first builds the executor as the engine does, ``cls(config, stack,
options=..., host=..., facts=...)``; a class that does not accept that signature fails
with property ``constructor signature``.

Use :func:`check_executor`, or subclass :class:`ExecutorConformance` and define an
``executor`` fixture returning the spec or class (and optionally set ``model_dir``).
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lmkit.testing.failure import Target, resolve_target, run_checks, skip_if_not_applicable

SUITE = "executor"
NUM_BLOCKS = 24
BLOCK_SIZE = 4
WORKLOAD = ("6 requests (4 greedy, 2 seeded sampling at temperature 0.8), prompts 3-30 "
            f"tokens, 12-24 output tokens; block_size {BLOCK_SIZE}, {NUM_BLOCKS} KV blocks, "
            "max_num_batched_tokens 24")


def _config(model_dir: Path, executor: str, parallel: dict[str, Any] | None = None) -> Any:
    from lmkit.config.schema import LMKitConfig

    return LMKitConfig.model_validate({
        "parallel": parallel or {},
        "model": {"model": str(model_dir), "dtype": "float32", "max_model_len": 128},
        "cache": {"block_size": BLOCK_SIZE, "num_blocks": NUM_BLOCKS},
        "scheduler": {"max_num_batched_tokens": 24, "max_num_seqs": 4},
        "attention": {"backend": "torch"},
        "executor": {"backend": executor, "device": "cpu"},
    })


class _Pair:
    """The executor under test and ``uniproc``, started on the same model."""

    def __init__(self, t: Target, model_dir: Path, parallel: dict[str, Any] | None = None
                 ) -> None:
        from lmkit.api.model import kv_heads_of_rank
        from lmkit.loading.model_facts import load_model_facts
        from lmkit.plugin_host.manager import PluginHost
        from lmkit.plugin_host.resolve import resolve_stack

        self.t = t
        self.num_ranks = int((parallel or {}).get("tensor_parallel_size", 1))
        host = PluginHost.load(env={"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"})
        self.config = _config(model_dir, "uniproc")
        self.stack = resolve_stack(self.config, host)
        facts = load_model_facts(model_dir, host, self.config.model.max_model_len)
        # the first of N tensor-parallel ranks holds its share of the KV heads (1/N when
        # they divide, else one group more): that share of a block's bytes
        kv = facts.num_key_value_heads or 1
        self.first_rank_kv_share = (len(kv_heads_of_rank(kv, 0, self.num_ranks)), kv)
        uniproc = host.registry.get("executor", "uniproc").spec
        self.reference = uniproc.load()(self.config, self.stack,
                                        options=uniproc.validate_options({}), host=host,
                                        facts=facts)
        config, stack = self.config, self.stack
        if parallel:  # the candidate splits the model; uniproc runs it whole
            config = _config(model_dir, t.spec.name if t.spec is not None else "auto", parallel)
            stack = resolve_stack(config, host)
        # built as the engine builds it: cls(config, stack, options=, host=, facts=)
        self.candidate = t.build(SUITE, "executor", "model info", WORKLOAD, config, stack,
                                 options=t.options, host=host, facts=facts)
        self.ref_info = self.reference.start()
        try:
            self.info = self.candidate.start()
        except Exception as e:
            self.reference.shutdown()
            raise t.fail(SUITE, "model info", WORKLOAD,
                         f"start() raised {type(e).__name__}: {e}") from e

    def close(self) -> None:
        self.reference.shutdown()
        self.candidate.shutdown()


def _with_pair(t: Target, model_dir: Path | None, body: Any,
               parallel: dict[str, Any] | None = None) -> None:
    with tempfile.TemporaryDirectory(prefix="lmkit-executor-conformance-") as tmp:
        if model_dir is None:
            from lmkit.testing.tiny_model import make_tiny_model

            model_dir = make_tiny_model(Path(tmp) / "tiny")
        pair = _Pair(t, Path(model_dir), parallel)
        try:
            body(pair)
        finally:
            pair.close()


def _model_info(pair: _Pair) -> None:
    from dataclasses import asdict

    fields = ("kv_bytes_per_block", "device", "dtype", "kv_window")
    info, ref_info = asdict(pair.info), asdict(pair.ref_info)
    for name in fields:
        got, want = info[name], ref_info[name]
        if name == "kv_bytes_per_block":  # the first rank's
            held, kv = pair.first_rank_kv_share
            want = want * held // kv
        if got != want:
            raise pair.t.fail(SUITE, "model info", WORKLOAD,
                              f"start() reported {name}={got!r}; uniproc reports {want!r}")


def _tokens(pair: _Pair) -> None:
    from lmkit.api.request import Request
    from lmkit.api.sampling_params import SamplingParams
    from lmkit.scheduler.paged import PagedScheduler

    t = pair.t
    pair.reference.initialize_kv_cache(NUM_BLOCKS)
    pair.candidate.initialize_kv_cache(NUM_BLOCKS)
    sched = PagedScheduler(pair.config, num_blocks=NUM_BLOCKS)
    prompts = [[(7 * i + j) % 250 for j in range(3 + 5 * i)] for i in range(6)]
    prompts[3] = prompts[2][:12] + [1, 2, 3]  # shares cached blocks with request 2
    for i, prompt in enumerate(prompts):
        sampled = i >= 4
        params = SamplingParams(temperature=0.8 if sampled else 0.0, seed=i if sampled else None,
                                max_tokens=12 + 2 * i, ignore_eos=True)
        sched.add_request(Request(f"r{i}", prompt, params, arrival_time=float(i)))
    step = 0
    while sched.has_unfinished_requests():
        step += 1
        so = sched.schedule()
        try:
            got = pair.candidate.execute(copy.deepcopy(so))
        except Exception as e:
            raise t.fail(SUITE, "tokens equal uniproc", f"{WORKLOAD}; step {step}",
                         f"execute() raised {type(e).__name__}: {e}") from e
        want = pair.reference.execute(so)
        if (list(got.req_ids), [list(x) for x in got.sampled_token_ids]) != (
                list(want.req_ids), [list(x) for x in want.sampled_token_ids]):
            raise t.fail(SUITE, "tokens equal uniproc",
                         f"{WORKLOAD}; step {step} (scheduled {dict(so.num_scheduled_tokens)}, "
                         f"preempted {sorted(so.preempted_req_ids)})",
                         f"sampled {dict(zip(got.req_ids, got.sampled_token_ids, strict=False))}"
                         f"; uniproc sampled "
                         f"{dict(zip(want.req_ids, want.sampled_token_ids, strict=False))}")
        sched.update_from_output(so, want)
        if step > 500:
            raise t.fail(SUITE, "tokens equal uniproc", WORKLOAD, "the workload did not finish")


def _offload_methods(pair: _Pair) -> None:
    pair.candidate.initialize_kv_cache(NUM_BLOCKS)
    what = "offload_lookup([b'x' * 32]); offload_stats(); close_offload() without a tier"
    try:
        got = (pair.candidate.offload_lookup([b"x" * 32]), pair.candidate.offload_stats())
        pair.candidate.close_offload()
    except Exception as e:
        raise pair.t.fail(SUITE, "offload methods", what,
                          f"raised {type(e).__name__}: {e}") from e
    if got != ((0, 0), {}):
        raise pair.t.fail(SUITE, "offload methods", what,
                          f"returned {got!r}; expected ((0, 0), {{}}) with offload off")


def _shutdown_twice(pair: _Pair) -> None:
    pair.candidate.shutdown()
    try:
        pair.candidate.shutdown()
    except Exception as e:
        raise pair.t.fail(SUITE, "shutdown twice", "shutdown(); shutdown()",
                          f"the second shutdown() raised {type(e).__name__}: {e}") from e


PROPERTIES = {"model info": _model_info, "tokens equal uniproc": _tokens,
              "offload methods": _offload_methods, "shutdown twice": _shutdown_twice}


def check_executor(executor: Any, options: Any = None, model_dir: str | Path | None = None,
                   only: Iterable[str] | None = None,
                   parallel: dict[str, Any] | None = None) -> dict[str, str]:
    """Run every executor property against ``executor`` (a Spec, Registration or
    Executor subclass built as ``cls(config, stack, options=..., host=..., facts=...)``),
    on ``model_dir`` or a fresh tiny random model. One model load serves all properties.

    ``parallel``: the candidate's ``parallel`` config section (e.g.
    ``{"tensor_parallel_size": 2}``), compared with ``uniproc`` running the whole model.

    :raises ConformanceFailure: naming the first failing property and the step.
    """
    t = resolve_target(executor, options)
    wanted = set(only) if only is not None else set(PROPERTIES)
    results: dict[str, str] = {}

    def body(pair: _Pair) -> None:
        checks = {name: (lambda f=f: f(pair)) for name, f in PROPERTIES.items()}
        results.update(run_checks(checks, wanted))

    _with_pair(t, Path(model_dir) if model_dir else None, body, parallel)
    return results


class ExecutorConformance:
    """pytest base class: one test per executor property. Define an ``executor``
    fixture returning the spec or class; set ``model_dir`` (a path) to load another
    model than a fresh tiny random Llama."""

    model_dir: str | Path | None = None

    def _check(self, executor: Any, prop: str) -> None:
        t = resolve_target(executor)
        model_dir = Path(self.model_dir) if self.model_dir else None
        skip_if_not_applicable(lambda: _with_pair(t, model_dir, PROPERTIES[prop]))

    def test_model_info(self, executor: Any) -> None:
        self._check(executor, "model info")

    def test_tokens_equal_uniproc(self, executor: Any) -> None:
        self._check(executor, "tokens equal uniproc")

    def test_offload_methods(self, executor: Any) -> None:
        self._check(executor, "offload methods")

    def test_shutdown_twice(self, executor: Any) -> None:
        self._check(executor, "shutdown twice")

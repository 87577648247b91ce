"""The engine core's step phases (lmkit.engine.phases) and the read-only EngineView
that lifecycle hooks receive, on the tiny random model (this module is also loaded as a
plugin: its lifecycle hooks record what they are given)."""

from __future__ import annotations

import pytest
from lmkit import LLM, SamplingParams
from lmkit.api import EngineView, hookimpl
from lmkit.engine.phases import StepPhase, StepPhases
from lmkit.errors import InvalidRequestError
from lmkit.spec_decode.manager import ProposerManager
from lmkit.structured.manager import StructuredOutputManager
from lmkit.testing.tiny_model import make_tiny_model

LMKIT_PLUGIN_API = ">=1.0,<2"  # this module is loaded as a plugin (-p)
SEEN: list[tuple[str, object]] = []


@hookimpl
def engine_started(engine):
    SEEN.append(("started", engine))


@hookimpl(wrapper=True)
def engine_step(engine):
    SEEN.append(("step", engine))
    outputs = yield
    return outputs


@hookimpl
def engine_stopped(engine):
    SEEN.append(("stopped", engine))


class Recorder(StepPhase):
    def __init__(self, log: list, name: str = "phase") -> None:
        self.log, self.name = log, name

    def add_request(self, request):
        self.log.append((self.name, "add", request.request_id))

    def abort_requests(self, request_ids):
        self.log.append((self.name, "abort", tuple(request_ids)))

    def before_schedule(self):
        self.log.append((self.name, "before_schedule"))

    def after_schedule(self, scheduler_output):
        self.log.append((self.name, "after_schedule", scheduler_output.total_num_scheduled_tokens))

    def after_model_output(self, scheduler_output, runner_output, outputs):
        self.log.append((self.name, "after_model_output", len(outputs)))

    def stats(self):
        return {f"{self.name}_stat": 1}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-phases"))


COMMON = dict(device="cpu", dtype="float32", max_model_len=128, num_blocks=64, block_size=4)


def test_phases_run_in_list_order_at_every_point():
    log: list = []
    phases = StepPhases([Recorder(log, "a"), StepPhase(), Recorder(log, "b")])
    phases.before_schedule()
    phases.abort_requests(["x"])
    assert log == [("a", "before_schedule"), ("b", "before_schedule"),
                   ("a", "abort", ("x",)), ("b", "abort", ("x",))]
    assert phases.stats() == {"a_stat": 1, "b_stat": 1}
    assert phases.take_rejected() == []
    phases.shutdown()  # the defaults do nothing


def test_the_step_runs_phases_around_schedule_execute_update(tiny):
    log: list = []
    with LLM(str(tiny), speculative="ngram", num_speculative_tokens=2, **COMMON) as llm:
        engine = llm.engine
        kinds = [type(p) for p in engine.phases.phases]
        assert StructuredOutputManager in kinds and ProposerManager in kinds
        # grammars advance before the proposer drafts; drafts are cut after it
        assert kinds.index(StructuredOutputManager) < kinds.index(ProposerManager) < len(kinds) - 1
        engine.phases = StepPhases([Recorder(log), *engine.phases.phases])
        schedule, execute, update = (engine.scheduler.schedule, engine.executor.execute,
                                     engine.scheduler.update_from_output)
        engine.scheduler.schedule = lambda: (log.append("schedule"), schedule())[1]
        engine.executor.execute = lambda so: (log.append("execute"), execute(so))[1]
        engine.scheduler.update_from_output = lambda so, ro: (log.append("update"),
                                                              update(so, ro))[1]
        out = llm.generate(["abcabc"], SamplingParams(temperature=0.0, max_tokens=3,
                                                      ignore_eos=True))[0]
        assert len(out.outputs[0].token_ids) == 3
        assert llm.stats()["phase_stat"] == 1
    assert log[0][1] == "add"
    steps = log[1:]
    assert len(steps) % 6 == 0 and len(steps) >= 12
    for i in range(0, len(steps), 6):
        names = [e if isinstance(e, str) else e[1] for e in steps[i:i + 6]]
        assert names == ["before_schedule", "schedule", "after_schedule", "execute", "update",
                         "after_model_output"]
    assert steps[2][2] == 6  # the first step: the whole prompt


class Refuses(StepPhase):
    def add_request(self, request):
        raise InvalidRequestError("refused by a test phase", param="prompt")


def test_a_request_a_phase_refuses_leaves_no_trace(tiny):
    with LLM(str(tiny), **COMMON) as llm:
        engine = llm.engine
        log: list = []
        engine.phases = StepPhases([Recorder(log), Refuses(), *engine.phases.phases])
        with pytest.raises(InvalidRequestError, match="refused by a test phase"):
            llm.generate(["abc"], SamplingParams(max_tokens=2))
        assert not engine.has_unfinished_requests()
        (added,) = [e[2] for e in log if e[1] == "add"]
        assert [e[2] for e in log if e[1] == "abort"] == [(added,)]  # taken back everywhere
        engine.phases = StepPhases([p for p in engine.phases.phases
                                    if not isinstance(p, (Refuses, Recorder))])
        assert llm.generate(["abc"], SamplingParams(max_tokens=2, ignore_eos=True))[0]


def test_lifecycle_hooks_get_one_read_only_engine_view(tiny):
    SEEN.clear()
    with LLM(str(tiny), plugins=[__name__], **COMMON) as llm:
        llm.generate(["abc"], SamplingParams(max_tokens=2, ignore_eos=True))
    kinds = [k for k, _ in SEEN]
    assert kinds[0] == "started" and kinds[-1] == "stopped" and "step" in kinds
    views = {id(v) for _, v in SEEN}
    assert len(views) == 1  # one view for the engine's life
    view = SEEN[0][1]
    assert isinstance(view, EngineView)
    assert view.facts.architecture == "LlamaForCausalLM" and view.num_blocks == 64
    assert view.config.model.max_model_len == 128 and view.stack.get("scheduler").name == "fcfs"
    assert view.stats()["num_steps"] >= 2
    for name in ("stack", "config", "num_blocks", "scheduler", "_stats"):
        with pytest.raises(AttributeError, match="EngineView is read-only"):
            setattr(view, name, None)
    assert not hasattr(view, "scheduler") and not hasattr(view, "executor")
    view.config.model.max_model_len = 1  # a copy: the engine keeps its own
    assert llm.engine.config.model.max_model_len == 128

"""Third-party plugins that misbehave at run time, through ``LLM.generate`` on the tiny
random model: a proposer, a structured-output backend and a scheduler that raise or
return what their contracts forbid. A proposer's or a grammar's fault fails the requests
concerned with an error naming the plugin, and the engine serves the next ones; a
scheduler's stops the engine with an error naming it (never a hang, a wrong output or a
bare traceback from deep inside the engine)."""

from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np
import pytest
import torch
from lmkit import LLM, SamplingParams
from lmkit.api import Caps, Grammar, Needs, Proposal, Spec, SpecProposer, hookimpl
from lmkit.api.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from lmkit.api.structured_output import StructuredOutputBackend
from lmkit.engine.plan_check import PlanCheck
from lmkit.errors import EngineDeadError, InvalidRequestError
from lmkit.testing.tiny_model import make_tiny_model
from lmkit_plugins.schedulers.fcfs import FCFSScheduler

LMKIT_PLUGIN_API = ">=1.0,<2"  # this module is loaded as a plugin (-p)
COMMON = dict(device="cpu", dtype="float32", max_model_len=96, progress=False,
              plugins=[__name__])
GREEDY = dict(temperature=0.0, ignore_eos=True, max_tokens=6)
PROMPTS = ["hello", "world"]
MODE: dict[str, Any] = {}  # what each plugin below does wrong: "proposer", "grammar", ...
PROPOSER = "speculative proposer 'faulty-drafts' (plugin test_plugin_runtime_faults)"
BACKEND = "structured-output backend 'faulty-grammar' (plugin test_plugin_runtime_faults)"
SCHEDULER = "scheduler 'faulty-sched' (plugin test_plugin_runtime_faults)"

# ------------------------------------------------------------------------------ plugins


class FaultyDrafts(SpecProposer):
    """Drafts what ``MODE["proposer"]`` returns for the batch (nothing by default)."""

    def __init__(self, config: Any, options: Any = None) -> None:
        pass

    def propose(self, batch: Any) -> Any:
        reply = MODE.get("proposer")
        if reply == "raise":
            raise ValueError("no drafts today")
        return reply(batch) if callable(reply) else Proposal([[]] * len(batch.req_ids))


class ChoiceGrammar(Grammar):
    """Byte-level matching of one of several strings (token id = byte); a constraint
    whose choices include ``"faulty"`` misbehaves as ``MODE["grammar"]`` says."""

    def __init__(self, choices: list[bytes], eos: int) -> None:
        self.choices, self.eos = choices, eos
        self.tokens: list[int] = []
        self.faulty = b"faulty" in choices

    def _fault(self, where: str) -> bool:
        return self.faulty and MODE.get("grammar") == where

    def allowed(self) -> set[int]:
        if self.is_terminated():
            return {self.eos}
        p = bytes(self.tokens)
        out = {c[len(p)] for c in self.choices if c.startswith(p) and len(c) > len(p)}
        return out | ({self.eos} if p in self.choices else set())

    def accept_tokens(self, token_ids: list[int]) -> bool:
        if self._fault("accept_raises") and self.tokens:
            raise RuntimeError("matcher state lost")
        if self._fault("accept_returns_none"):
            return None  # type: ignore[return-value]  # the bug under test
        saved = list(self.tokens)
        for tok in token_ids:
            if tok not in self.allowed():
                self.tokens = saved
                return False
            self.tokens.append(tok)
        return True

    def rollback(self, num_tokens: int) -> None:
        del self.tokens[len(self.tokens) - num_tokens:]

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._fault("fill_raises") and self.tokens:
            raise RuntimeError("bitmask unavailable")
        if self._fault("fill_wrong_shape"):
            bitmask[row] = torch.zeros(3, dtype=torch.int32)  # raises: [ceil(vocab/32)]
            return
        bitmask[row] = 0
        for tok in self.allowed():
            word, bit = divmod(tok, 32)
            value = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << bit)
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value

    def is_terminated(self) -> bool:
        return bool(self.tokens) and self.tokens[-1] == self.eos


class ChoiceBackend(StructuredOutputBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, options: Any = None) -> None:
        self.eos = tokenizer.eos_token_id

    def compile(self, kind: str, spec: Any) -> Any:
        if MODE.get("grammar") == "compile_returns_none":
            return None
        return ChoiceGrammar([c.encode() for c in spec], self.eos)

    def fill_bitmasks(self, grammars: Any, bitmask: torch.Tensor, rows: Any) -> None:
        if MODE.get("grammar") == "batch_fill_raises":
            raise RuntimeError("thread pool gone")
        super().fill_bitmasks(grammars, bitmask, rows)


class FaultyScheduler(FCFSScheduler):
    """FCFS; ``MODE["scheduler"](plan)`` spoils each plan, or ``"update"`` raises."""

    def schedule(self) -> Any:
        plan = super().schedule()
        spoil = MODE.get("scheduler")
        return spoil(plan) if callable(spoil) and plan.num_scheduled_tokens else plan

    def update_from_output(self, scheduler_output: Any, runner_output: Any) -> Any:
        if MODE.get("scheduler") == "update":
            raise RuntimeError("lost the running queue")
        return super().update_from_output(scheduler_output, runner_output)


@hookimpl
def register_spec_proposers(register: Any) -> None:
    register(Spec(name="faulty-drafts", target=lambda: FaultyDrafts,
                  stack_needs={"attention": Needs({"multi_token_query"})}))


@hookimpl
def register_structured_output_backends(register: Any) -> None:
    register(Spec(name="faulty-grammar", target=lambda: ChoiceBackend, caps=Caps({"choice"})))


@hookimpl
def register_schedulers(register: Any) -> None:
    register(Spec(name="faulty-sched", target=lambda: FaultyScheduler))


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(autouse=True)
def _no_fault() -> Any:
    yield
    MODE.clear()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-faults")))


@pytest.fixture(scope="module")
def plain(tiny: str) -> list[str]:  # what speculation must not change
    with LLM(tiny, **{**COMMON, "plugins": []}) as llm:
        return [c.text for c in _completions(llm, SamplingParams(**GREEDY))]


@pytest.fixture(scope="module")
def spec_llm(tiny: str) -> Any:
    with LLM(tiny, speculative="faulty-drafts", num_speculative_tokens=2, **COMMON) as llm:
        yield llm


@pytest.fixture(scope="module")
def grammar_llm(tiny: str) -> Any:
    with LLM(tiny, structured_output="faulty-grammar", speculative="faulty-drafts",
             num_speculative_tokens=3, **COMMON) as llm:
        yield llm


def _completions(llm: Any, params: Any) -> list[Any]:
    return [o.outputs[0] for o in llm.generate(PROMPTS, params)]


def _drafts(drafts: Any, for_hello: Any = None) -> Any:
    """A proposer reply: ``drafts`` for every request, or ``for_hello`` for the one
    whose prompt is ``"hello"`` when given (token id = byte)."""
    def reply(batch: Any) -> Proposal:
        return Proposal([for_hello if for_hello is not None and bytes(t[:5]) == b"hello"
                         else drafts for t in batch.token_ids])
    return reply


# ------------------------------------------------------------------------------ proposer


@pytest.mark.parametrize(("reply", "message"), [
    ("raise", f"{PROPOSER} raised ValueError in FaultyDrafts.propose (test_plugin_runtime_"
              "faults.py:"),
    (lambda b: None, f"{PROPOSER} returned NoneType, not lmkit.api.Proposal"),
    (lambda b: [[1]] * len(b.req_ids), f"{PROPOSER} returned list, not lmkit.api.Proposal"),
    (lambda b: Proposal({r: [1] for r in b.req_ids}),  # type: ignore[arg-type]
     f"{PROPOSER} returned Proposal.draft_token_ids as dict; it must be a list with one "
     "entry per request"),
    (lambda b: Proposal([[1]] * (len(b.req_ids) + 1)),
     f"{PROPOSER} returned 3 draft lists for 2 requests"),
    (_drafts([999]), "drafted token id 999, outside the model's vocabulary [0, 320)"),
    (_drafts([-1]), "drafted token id -1, outside the model's vocabulary [0, 320)"),
    (_drafts([1.0]), "drafted 1.0 (float); draft token ids must be integers"),
    (_drafts(["a"]), "drafted 'a' (str); draft token ids must be integers"),
])
def test_a_proposer_fault_fails_its_requests_and_the_engine_goes_on(
        spec_llm: Any, plain: list[str], reply: Any, message: str) -> None:
    MODE["proposer"] = reply
    for c in _completions(spec_llm, SamplingParams(**GREEDY)):
        assert c.finish_reason == "error" and message in c.stop_reason
        assert c.stop_reason.startswith(PROPOSER) and c.error is None  # not the request's
    assert not spec_llm.engine.has_unfinished_requests()
    MODE.clear()
    assert [c.text for c in _completions(spec_llm, SamplingParams(**GREEDY))] == plain


def test_one_requests_bad_drafts_fail_that_request_alone(spec_llm: Any, plain: list[str]):
    MODE["proposer"] = _drafts([], for_hello=[999])
    first, second = _completions(spec_llm, SamplingParams(**GREEDY))
    assert first.finish_reason == "error" and "drafted token id 999" in first.stop_reason
    assert (second.text, second.finish_reason) == (plain[1], "length")


def test_integer_like_drafts_are_taken_and_extra_drafts_cut_with_one_warning(
        spec_llm: Any, plain: list[str], caplog: pytest.LogCaptureFixture) -> None:
    MODE["proposer"] = _drafts([np.int64(1), torch.tensor(2)], for_hello=[1, 2, 3, 4, 5])
    with caplog.at_level(logging.WARNING, logger="lmkit.spec_decode.manager"):
        texts = [c.text for c in _completions(spec_llm, SamplingParams(**GREEDY))]
    assert texts == plain
    warnings = [r.getMessage() for r in caplog.records if "more than" in r.getMessage()]
    assert warnings == [f"{PROPOSER} drafted 5 tokens for a request, more than "
                        "num_speculative_tokens = 2; the ones past 2 are dropped"]  # once


@pytest.mark.parametrize(("probs", "message"), [
    # rejection sampling accepted every draft the distribution gave no mass: every output
    # was the drafts themselves
    (torch.zeros(2, 320), "drafted token id 1 at draft position 0 with draft probability "
                          "0.0; draft_probs must give each draft the positive probability"),
    (torch.full((2, 400), 1 / 400), "gave draft_probs of shape (2, 400) for 2 drafts; "
                                    "expected [2, vocab <= 320]"),
    (torch.ones(2, 320, dtype=torch.int64), "gave draft_probs Tensor of shape (2, 320), "
                                            "dtype torch.int64; expected a float tensor"),
])
def test_draft_distributions_that_cannot_be_right_fail_the_request(
        spec_llm: Any, probs: torch.Tensor, message: str) -> None:
    MODE["proposer"] = lambda b: Proposal([[1, 2]] * len(b.req_ids), [probs] * len(b.req_ids))
    params = SamplingParams(**{**GREEDY, "temperature": 1.0}, seed=0)
    for c in _completions(spec_llm, params):
        assert c.finish_reason == "error" and message in c.stop_reason


# ------------------------------------------------------------------------------ grammars

GOOD = SamplingParams(max_tokens=8, temperature=0, structured_outputs={"choice": ["abcd"]})
FAULTY = SamplingParams(max_tokens=8, temperature=0,
                        structured_outputs={"choice": ["abcd", "faulty"]})


@pytest.mark.parametrize(("fault", "message"), [
    ("accept_raises", f"{BACKEND} raised RuntimeError in ChoiceGrammar.accept_tokens "
                      "(test_plugin_runtime_faults.py:"),
    # was: "the model produced tokens [97] that the constraint does not allow" (engine's)
    ("accept_returns_none", f"{BACKEND} broke its contract while advancing over the step's "
                            "tokens: ChoiceGrammar.accept_tokens returned None; it must "
                            "return True (accepted) or False"),
    ("fill_raises", f"{BACKEND} raised RuntimeError in ChoiceGrammar.fill_bitmask"),
    ("fill_wrong_shape", f"{BACKEND} raised RuntimeError in ChoiceGrammar.fill_bitmask"),
])
@pytest.mark.parametrize("drafting", [False, True])
def test_a_grammar_fault_fails_its_request_and_the_others_go_on(
        grammar_llm: Any, fault: str, message: str, drafting: bool) -> None:
    MODE["grammar"] = fault
    MODE["proposer"] = _drafts([98, 99, 100] if drafting else [])  # "bcd"
    faulty, good, unconstrained = (o.outputs[0] for o in grammar_llm.generate(
        ["x", "y", "z"], [FAULTY, GOOD, SamplingParams(**GREEDY)]))
    assert (faulty.finish_reason, faulty.error) == ("error", None)  # not the request's fault
    assert message in faulty.stop_reason
    assert (good.text, good.finish_reason, unconstrained.finish_reason) == (
        "abcd", "stop", "length")
    assert not grammar_llm.engine.has_unfinished_requests()
    MODE.clear()
    assert grammar_llm.generate("x", FAULTY)[0].outputs[0].text in ("abcd", "faulty")


def test_a_backend_whose_batch_fill_raises_falls_back_to_each_grammar(
        grammar_llm: Any, caplog: pytest.LogCaptureFixture) -> None:
    MODE["grammar"] = "batch_fill_raises"
    with caplog.at_level(logging.ERROR, logger="lmkit.structured.rows"):
        outs = grammar_llm.generate(["x", "y"], GOOD)
    assert [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs] == [("abcd", "stop")] * 2
    assert f"{BACKEND} raised RuntimeError in ChoiceBackend.fill_bitmasks" in caplog.text


def test_a_backend_that_compiles_into_none_refuses_the_request(grammar_llm: Any) -> None:
    grammar_llm.generate("x", GOOD)  # compiled and cached: the next request gets a new
    MODE["grammar"] = "compile_returns_none"  # grammar from the cached compilation
    with pytest.raises(InvalidRequestError, match=re.escape(
            f'{BACKEND} compiled the choice ["abcd"] constraint into NoneType, not a '
            "lmkit.api.Grammar (compile / new_grammar must return one): a bug in the backend")):
        grammar_llm.generate("x", GOOD)
    MODE.clear()
    assert grammar_llm.generate("x", GOOD)[0].outputs[0].text == "abcd"


# ------------------------------------------------------------------------------ scheduler


def _plus(plan: SchedulerOutput, extra: int) -> SchedulerOutput:
    plan.num_scheduled_tokens[next(iter(plan.num_scheduled_tokens))] += extra
    plan.total_num_scheduled_tokens += extra
    return plan


def _ghost(plan: SchedulerOutput, cached: bool) -> SchedulerOutput:
    """``plan`` plus a request nobody added, listed as cached or not at all."""
    plan.num_scheduled_tokens["ghost"] = 1
    plan.total_num_scheduled_tokens += 1
    if cached:
        c = plan.scheduled_cached_reqs
        c.req_ids, c.new_block_ids, c.num_computed_tokens = ["ghost"], [[]], [3]
    return plan


def _raise(plan: SchedulerOutput) -> SchedulerOutput:
    raise KeyError("lost the waiting queue")


@pytest.mark.parametrize(("spoil", "message"), [
    # each was a bare KeyError / IndexError / AttributeError from the model runner or a
    # feature, and the engine took further requests with its state broken
    (_raise, f"{SCHEDULER} raised KeyError in FaultyScheduler.schedule"),
    (lambda p: None, f"{SCHEDULER} schedule() returned NoneType, not "
                     "lmkit.api.SchedulerOutput"),
    (lambda p: _plus(p, 1000), f"{SCHEDULER} scheduled request '0' up to position 1005, "
                               "past model.max_model_len = 96"),
    (lambda p: _ghost(p, cached=True), f"{SCHEDULER} scheduled request 'ghost' in "
                                       "scheduled_cached_reqs, but the model runner holds "
                                       "no state for it"),
    (lambda p: _ghost(p, cached=False), f"{SCHEDULER} scheduled 1 tokens for request "
                                        "'ghost' but listed it in neither"),
    (lambda p: setattr(p, "total_num_scheduled_tokens", 99) or p,
     f"{SCHEDULER} planned total_num_scheduled_tokens = 99, but num_scheduled_tokens adds "
     "up to 10"),
    ("update", f"{SCHEDULER} raised RuntimeError in FaultyScheduler.update_from_output"),
])
def test_a_scheduler_fault_stops_the_engine_with_an_error_naming_it(
        tiny: str, spoil: Any, message: str) -> None:
    with LLM(tiny, scheduler="faulty-sched", **COMMON) as llm:
        MODE["scheduler"] = spoil
        with pytest.raises(EngineDeadError) as exc:
            llm.generate(PROMPTS, SamplingParams(**GREEDY))
        assert str(exc.value).startswith(message)
        assert "The engine stopped" in str(exc.value)
        MODE.clear()  # fixed too late: the engine stays dead, and says why
        with pytest.raises(EngineDeadError, match="^" + re.escape(message)):
            llm.generate(PROMPTS, SamplingParams(**GREEDY))
        assert not llm.engine.has_unfinished_requests()


def _new(rid: str, num_prompt: int = 4) -> NewRequestData:  # a request's first step
    return NewRequestData(rid, list(range(num_prompt)), [], SamplingParams(), [1], 0)


def test_plan_check_rules_and_the_runners_view_of_requests() -> None:
    check = PlanCheck("scheduler 'x'", max_num_batched_tokens=8, max_num_seqs=2,
                      max_model_len=16)
    assert check.check(SchedulerOutput([_new("a")], num_scheduled_tokens={"a": 4},
                                       total_num_scheduled_tokens=4)) is None
    decode = SchedulerOutput(scheduled_cached_reqs=CachedRequestData(["a"], [[]], [4]),
                             num_scheduled_tokens={"a": 3}, total_num_scheduled_tokens=3,
                             scheduled_spec_decode_tokens={"a": [5, 6, 7]})
    assert check.check(decode) == ("scheduled 3 draft tokens for request 'a' with 3 "
                                   "scheduled tokens; a request's drafts come with its last "
                                   "token, so it needs 1 + its drafts scheduled tokens")
    decode.scheduled_spec_decode_tokens["a"] = [5, 6]
    assert check.check(decode) is None
    assert check.check(SchedulerOutput([_new("b"), _new("c"), _new("d")],
                                       num_scheduled_tokens=dict.fromkeys("bcd", 1),
                                       total_num_scheduled_tokens=3)) == (
        "scheduled 3 requests in one step, more than scheduler.max_num_seqs = 2")
    assert "more than scheduler.max_num_batched_tokens = 8" in check.check(SchedulerOutput(
        [_new("b", 9)], num_scheduled_tokens={"b": 9}, total_num_scheduled_tokens=9))
    assert "each count in num_scheduled_tokens must be an int >= 1" in check.check(
        SchedulerOutput([_new("b")], num_scheduled_tokens={"b": 0}))
    assert "listed request 'b' twice" in check.check(SchedulerOutput(
        [_new("b"), _new("b")], num_scheduled_tokens={"b": 1}, total_num_scheduled_tokens=1))
    # finished (or preempted) requests leave the runner: scheduling them as cached is wrong
    gone = SchedulerOutput(scheduled_cached_reqs=CachedRequestData(["a"], [[]], [6]),
                           num_scheduled_tokens={"a": 1}, total_num_scheduled_tokens=1,
                           finished_req_ids={"a"})
    assert "scheduled request 'a' in scheduled_cached_reqs" in check.check(gone)
    gone.finished_req_ids = set()
    assert check.check(gone) is None

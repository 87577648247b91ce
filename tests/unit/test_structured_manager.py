"""The structured-output manager with the xgrammar backend over the byte tokenizer (one
token per byte, EOS 256): requests wait for their grammar (WAITING_FOR_GRAMMAR) and are
made ready once compiled, bitmask rows with drafts, advancing,
termination, refusals (invalid, unsupported, too slow), caching and deduplication."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from lmkit.api.outputs import EngineCoreOutput
from lmkit.api.request import Request, RequestStatus
from lmkit.api.sampling_params import SamplingParams
from lmkit.api.scheduler_output import SchedulerOutput
from lmkit.errors import InvalidRequestError
from lmkit.sample.bitmask import unpack_bitmask
from lmkit.structured.manager import StructuredOutputManager
from lmkit.testing.tiny_model import make_byte_tokenizer

pytest.importorskip("xgrammar")
from lmkit_plugins.structured import SPEC  # noqa: E402
from lmkit_plugins.structured.xgrammar_backend import XGrammarBackend  # noqa: E402

EOS = 256
VOCAB = 320
TOKENIZER = make_byte_tokenizer()


class CountingBackend(XGrammarBackend):
    """Counts compilations; a constraint mentioning ``slow`` compiles until released."""

    release = threading.Event()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_compiled = 0

    def compile_shared(self, kind, spec):
        self.num_compiled += 1
        if "slow" in str(spec):
            self.release.wait(10)
        return super().compile_shared(kind, spec)


class FakeScheduler:
    """Records what the manager asks of the scheduler (and, in ``added``, the requests
    :func:`admit_all` saw made ready)."""

    def __init__(self):
        self.added: list[Request] = []
        self.finished: list[tuple[str, RequestStatus]] = []

    def finish_requests(self, request_ids, status):
        self.finished.append((request_ids, status))


def make_manager(features=SPEC.caps.features, **kwargs) -> StructuredOutputManager:
    kwargs.setdefault("compile_timeout_s", 10.0)
    return StructuredOutputManager(FakeScheduler(), lambda: CountingBackend(TOKENIZER, VOCAB),
                                   "xgrammar", features, VOCAB, **kwargs)


def request(rid: str, use_spec_decode: bool = True, **constraint) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(structured_outputs=constraint,
                                                  use_spec_decode=use_spec_decode),
                   eos_token_id=EOS)


def admit_all(manager, scheduler, timeout=10.0):
    deadline = time.monotonic() + timeout
    admitted = []
    while manager.has_pending() and time.monotonic() < deadline:
        admitted += manager.admit(idle=True)
    assert all(r.status == RequestStatus.WAITING for r in admitted)
    scheduler.added += admitted


def allowed(bitmask, row) -> set[int]:
    return set(unpack_bitmask(bitmask[row:row + 1], VOCAB)[0].nonzero().flatten().tolist())


def ids(text: str) -> list[int]:
    return list(text.encode())


def test_requests_reach_the_scheduler_only_with_a_compiled_grammar():
    manager = make_manager()
    scheduler = manager.scheduler
    req = request("a", regex="ab")
    manager.add_request(req)
    assert manager.has_pending() and not req.structured_output.is_ready
    assert req.status == RequestStatus.WAITING_FOR_GRAMMAR
    admit_all(manager, scheduler)
    assert scheduler.added == [req] and req.structured_output.is_ready
    assert manager.stats()["num_constrained_requests"] == 1


def test_bitmask_rows_follow_the_drafts_and_leave_the_grammar_as_it_was():
    manager = make_manager()
    scheduler = manager.scheduler
    manager.add_request(request("a", regex="abc"))
    manager.add_request(request("b", choice=["yes", "no"]))
    admit_all(manager, scheduler)
    so = SchedulerOutput(num_scheduled_tokens={"u": 1, "a": 4, "b": 1},
                         scheduled_spec_decode_tokens={"a": ids("abx")})
    manager.fill_bitmask(so)
    assert so.structured_output_request_ids == {"a": 0, "b": 4}
    bm = so.grammar_bitmask
    assert bm.shape == (5, 10) and bm.dtype == torch.int32
    assert [allowed(bm, r) for r in range(3)] == [{ord("a")}, {ord("b")}, {ord("c")}]
    assert len(allowed(bm, 3)) == VOCAB  # after the refused draft "x": left open
    assert allowed(bm, 4) == {ord("y"), ord("n")}
    so2 = SchedulerOutput(num_scheduled_tokens={"a": 1})
    manager.fill_bitmask(so2)
    assert allowed(so2.grammar_bitmask, 0) == {ord("a")}  # drafts were rolled back
    assert manager.num_valid_draft_tokens("a", ids("abx")) == 2
    assert manager.num_valid_draft_tokens("unconstrained", ids("xyz")) == 3


def test_drafts_are_cut_to_what_the_grammar_allows():
    manager = make_manager()
    scheduler = manager.scheduler
    manager.add_request(request("a", regex="abc"))
    manager.add_request(request("b", regex="abc", use_spec_decode=False))
    admit_all(manager, scheduler)
    # grammars compile on a pool: the admission order is whichever finished first
    a, b = sorted(scheduler.added, key=lambda r: r.request_id)
    a.spec_token_ids, b.spec_token_ids = ids("abxc"), ids("x")
    assert manager.trim_draft_tokens() == 2
    assert a.spec_token_ids == ids("ab") and b.spec_token_ids == ids("x")  # b opted out
    assert manager.stats()["grammar_drafts_trimmed"] == 2


def test_grammars_advance_and_a_terminated_grammar_ends_its_request():
    manager = make_manager()
    scheduler = manager.scheduler
    manager.add_request(request("a", regex="ab"))
    manager.add_request(request("b", regex="ab"))
    admit_all(manager, scheduler)
    outs = [EngineCoreOutput("a", ids("a")), EngineCoreOutput("b", ids("ab"))]
    manager.advance(outs)
    so = SchedulerOutput(num_scheduled_tokens={"a": 1, "b": 1})
    manager.fill_bitmask(so)
    assert allowed(so.grammar_bitmask, 0) == {ord("b")}
    assert allowed(so.grammar_bitmask, 1) == {EOS}
    # b: EOS accepted but the scheduler did not stop it (ignore_eos): the grammar ends it
    out_b = EngineCoreOutput("b", [EOS])
    # a: stopped by the scheduler on EOS as usual
    out_a = EngineCoreOutput("a", [ord("b"), EOS], finish_reason="stop")
    manager.advance([out_a, out_b])
    assert out_b.finish_reason == "stop" and out_a.finish_reason == "stop"
    assert scheduler.finished == [("b", RequestStatus.FINISHED_STOPPED)]
    assert manager.stats()["num_constrained_requests"] == 0


def test_a_token_the_grammar_refuses_ends_the_request_with_an_error():
    manager = make_manager()
    scheduler = manager.scheduler
    manager.add_request(request("a", regex="ab"))
    admit_all(manager, scheduler)
    out = EngineCoreOutput("a", ids("z"))
    manager.advance([out])
    assert out.finish_reason == "error" and "does not allow" in out.stop_reason
    assert scheduler.finished == [("a", RequestStatus.FINISHED_ERROR)]


def test_invalid_constraints_are_rejected_without_reaching_the_scheduler():
    manager = make_manager()
    scheduler = manager.scheduler
    manager.add_request(request("bad-regex", regex="a(b"))
    manager.add_request(request("bad-type", json={"type": "no-such-type"}))
    manager.add_request(request("unique", json={"type": "array", "uniqueItems": True}))
    manager.add_request(request("good", choice=["x"]))
    admit_all(manager, scheduler)
    assert [r.request_id for r in scheduler.added] == ["good"]
    rejected = dict(manager.take_rejected())
    assert "parenthesis is not closed" in str(rejected["bad-regex"])
    assert 'Unsupported type "no-such-type"' in str(rejected["bad-type"])
    assert "does not support the JSON schema keyword 'uniqueItems' (at #)" in str(
        rejected["unique"])
    assert all(e.param == "structured_outputs" for e in rejected.values())
    # refused requests leave the scheduler they waited in
    assert scheduler.finished == [(rid, RequestStatus.FINISHED_ERROR) for rid in rejected]
    assert manager.take_rejected() == []


def test_an_unsupported_kind_names_the_backend_and_the_feature():
    manager = make_manager(features={"json_schema"})
    with pytest.raises(InvalidRequestError, match="'xgrammar' structured-output backend "
                       "does not support regex constraints"):
        manager.add_request(request("a", regex="x"))


def test_a_slow_compilation_is_refused_while_others_proceed():
    CountingBackend.release.clear()
    manager = make_manager(compile_timeout_s=0.2)
    scheduler = manager.scheduler
    manager.add_request(request("slow", choice=["slow"]))
    manager.add_request(request("fast", choice=["fast"]))
    start = time.monotonic()
    admit_all(manager, scheduler)
    assert time.monotonic() - start < 5
    assert [r.request_id for r in scheduler.added] == ["fast"]
    (rid, error), = manager.take_rejected()
    assert rid == "slow" and error.code == "constraint_compile_timeout"
    assert "compile_timeout_s = 0.2s" in str(error)
    assert manager.stats()["grammar_compile_threads_abandoned"] == 1
    CountingBackend.release.set()  # the abandoned compilation ends; its result is cached
    deadline = time.monotonic() + 5
    while manager.compiler.pool.num_abandoned and time.monotonic() < deadline:
        time.sleep(0.01)
    assert any(k.startswith("choice:") and "slow" in k for k in manager.compiler.cache._entries)


def test_requests_stuck_behind_runaway_compilations_are_refused_as_busy():
    CountingBackend.release.clear()
    manager = make_manager(compile_timeout_s=0.1, num_compile_threads=1, queue_timeout_s=0.3)
    manager.compiler.pool.max_abandoned = 0  # no replacement thread: the queue stalls
    scheduler = manager.scheduler
    manager.add_request(request("slow", choice=["slow"]))
    manager.add_request(request("queued", choice=["fast"]))
    admit_all(manager, scheduler)
    rejected = dict(manager.take_rejected())
    assert rejected["slow"].code == "constraint_compile_timeout"
    assert rejected["queued"].code == "constraint_compile_busy"
    assert "waited 0.3s for a compile thread" in str(rejected["queued"])
    CountingBackend.release.set()


def test_identical_constraints_compile_once_and_unique_ones_stay_bounded():
    manager = make_manager(cache_size=8)
    scheduler = manager.scheduler
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    for i in range(6):
        manager.add_request(request(f"same-{i}", json=schema))
    admit_all(manager, scheduler)
    backend = manager.compiler.backend()
    assert backend.num_compiled == 1 and len(scheduler.added) == 6
    for i in range(40):
        manager.add_request(request(f"unique-{i}", regex=f"x{i}"))
    admit_all(manager, scheduler)
    assert len(manager.compiler.cache) <= 8 and manager.compiler.cache.evictions >= 33
    assert backend.num_compiled == 41


def test_aborted_requests_are_forgotten():
    manager = make_manager()
    scheduler = manager.scheduler
    manager.add_request(request("a", regex="ab"))
    manager.add_request(request("b", regex="ab"))
    manager.abort_requests(["a"])
    admit_all(manager, scheduler)
    assert [r.request_id for r in scheduler.added] == ["b"]
    manager.abort_requests(["b", "unknown"])
    so = SchedulerOutput(num_scheduled_tokens={"b": 1})
    manager.fill_bitmask(so)
    assert so.grammar_bitmask is None and not so.structured_output_request_ids


def test_a_backend_that_cannot_start_refuses_each_request():
    def broken():
        raise ValueError("no tokenizer.json")

    manager = StructuredOutputManager(FakeScheduler(), broken, "xgrammar", {"regex"}, VOCAB)
    scheduler = manager.scheduler
    manager.add_request(request("a", regex="x"))
    admit_all(manager, scheduler)
    (rid, error), = manager.take_rejected()
    assert "could not start: ValueError: no tokenizer.json" in str(error)


def test_constraints_with_no_finite_match_are_refused_not_failed_mid_generation():
    manager, scheduler = make_manager(), FakeScheduler()
    manager.add_request(request("left-rec", grammar='root ::= root "a"'))
    manager.add_request(request("empty-class", regex="[^\\s\\S]"))
    manager.add_request(request("right-rec", grammar='root ::= "a" root | "b"'))
    admit_all(manager, scheduler)
    assert [r.request_id for r in scheduler.added] == ["right-rec"]
    rejected = dict(manager.take_rejected())
    assert set(rejected) == {"left-rec", "empty-class"}
    for error in rejected.values():
        assert "accepts no output" in str(error) and error.code == "invalid_constraint"

"""Rows where a request's own token rules leave nothing to sample.

``allowed_token_ids`` all forbidden by ``min_tokens`` (EOS, stop_token_ids) or by
``bad_words`` leave every logit ``-inf``; the sampler used to draw a garbage token
there (greedy: id 0) and the request went on silently. Now: what admission can decide
is refused up front (400 ``no_allowed_token``); the rest is found by the sampler (a
flag read in the same copy as the tokens), carried per request in
``ModelRunnerOutput.no_allowed_token``, and the scheduler ends the request with
``finish_reason`` "error" and a ``RequestFaultError``, drafts included.
"""

from __future__ import annotations

import pytest
import torch
from lmkit.api.request import RequestStatus
from lmkit.api.runner_output import ModelRunnerOutput
from lmkit.api.sampling_params import SamplingParams
from lmkit.errors import InvalidRequestError, RequestFaultError
from lmkit.frontend.processor import InputProcessor
from lmkit.sample.drafts import first_no_token, verify_greedy
from lmkit.sample.metadata import SamplingMetadata
from lmkit.sample.sampler import Sampler
from lmkit.scheduler.paged import PagedScheduler
from lmkit.spec_decode.rows import DraftExtendedTokens
from lmkit.testing.tiny_model import make_byte_tokenizer, make_tiny_model
from lmkit.worker.step_codec import (
    RunnerOutputWire,
    runner_output_from_wire,
    runner_output_to_wire,
)
from test_scheduler_fakes import make_config, make_request

CPU = torch.device("cpu")
V = 8
EOS = 7
A, B = 3, 4  # two ordinary tokens
EVERY_PAIR = [[A, A], [A, B], [B, A], [B, B]]  # after A or B, both are bad words


def build(params, outputs=None) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(params, [[0]] * n, outputs or [[]] * n, [None] * n,
                                  [EOS] * n, V, CPU)


def rising_logits(rows: int) -> torch.Tensor:
    # argmax V - 1, for random rows too (the next is e^-100 less likely)
    return torch.arange(V, dtype=torch.float32).repeat(rows, 1) * 100


# -- the sampler's flag -----------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_with_nothing_allowed_is_flagged_and_others_are_not(temperature):
    params = [SamplingParams(temperature=temperature, allowed_token_ids=[EOS], min_tokens=2),
              SamplingParams(temperature=temperature, allowed_token_ids=[A]),
              SamplingParams(temperature=temperature)]
    md = build(params)
    assert md.may_allow_no_token
    out = Sampler()(rising_logits(3), md)
    assert out.no_allowed_token.tolist() == [True, False, False]
    verified = Sampler().sample_requests(rising_logits(3), md, [[], [], []])
    assert verified.no_allowed_token == {0: 0}  # (was: garbage, nothing said)
    assert verified.token_ids[1:] == [[A], [EOS]]


def test_no_check_without_a_mask_that_can_leave_nothing():
    md = build([SamplingParams(temperature=0.0, logit_bias={1: -100.0}),
                SamplingParams(temperature=1.0, repetition_penalty=1.5)])
    assert md.needs_logit_adjustment and not md.may_allow_no_token
    out = Sampler()(rising_logits(2), md)
    assert out.no_allowed_token is None
    assert Sampler().sample_requests(rising_logits(2), md, [[], []]).no_allowed_token == {}


def test_a_grammar_row_whose_garbage_the_grammar_would_accept_is_flagged():
    # the bitmask (applied before the sampler) allows only token 0; allowed_token_ids
    # only A: nothing left, and greedy draws 0, a token the grammar accepts
    logits = rising_logits(1)
    logits[0, 1:] = float("-inf")
    verified = Sampler().sample_requests(
        logits, build([SamplingParams(temperature=0.0, allowed_token_ids=[A])]), [[]])
    assert verified.token_ids == [[0]] and verified.no_allowed_token == {0: 0}


def draft_rows(p: SamplingParams, drafts: list[int]) -> SamplingMetadata:
    outputs = [DraftExtendedTokens([], drafts, j) for j in range(len(drafts) + 1)]
    return build([p] * (len(drafts) + 1), outputs)


def test_greedy_drafts_end_at_the_first_emitted_row_with_nothing_allowed():
    # allowed A, B; after either, both are bad words: row 1 has nothing allowed
    p = SamplingParams(temperature=0.0, allowed_token_ids=[A, B], bad_words_token_ids=EVERY_PAIR)
    logits = rising_logits(3)
    logits[:, A] = 5000.0  # row 0 picks A
    verified = Sampler().sample_requests(logits, draft_rows(p, [A, 5]), [[A, 5]])
    assert verified.num_accepted == [1] and verified.no_allowed_token == {0: 1}
    # a rejected draft before it: the masked row is never output, nothing to report
    verified = Sampler().sample_requests(logits, draft_rows(p, [B, 5]), [[B, 5]])
    assert verified.token_ids == [[A]] and verified.no_allowed_token == {}


def test_random_drafts_end_at_the_first_emitted_row_with_nothing_allowed():
    # only A allowed, then A is a bad word: row 0 accepts draft A (probability 1)
    p = SamplingParams(temperature=1.0, seed=1, allowed_token_ids=[A],
                       bad_words_token_ids=[[A, A]])
    verified = Sampler().sample_requests(rising_logits(3), draft_rows(p, [A, A]), [[A, A]])
    assert verified.token_ids[0][0] == A and verified.no_allowed_token == {0: 1}
    # with logprobs (not the greedy fast path) too
    p = SamplingParams(temperature=0.0, logprobs=1, allowed_token_ids=[A],
                       bad_words_token_ids=[[A, A]])
    verified = Sampler().sample_requests(rising_logits(3), draft_rows(p, [A, A]), [[A, A]])
    assert verified.no_allowed_token == {0: 1}


def test_verify_greedy_reports_masked_rows_only_when_asked():
    logits = rising_logits(3)
    logits[2] = float("-inf")  # request 1's row
    assert verify_greedy(logits, [[V - 1], []], check_no_token=True).no_allowed_token == {
        1: 0}
    assert verify_greedy(logits, [[V - 1], []]).no_allowed_token == {}
    # rows 1 and 6 follow a rejected draft of their request: not output, not reported
    assert first_no_token([1, 4, 6], [0, 3, 5], [0, 1, 0]) == {1: 1}


# -- the runner output, over the wire ---------------------------------------------------

def test_the_flag_crosses_the_wire():
    out = ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[[5, 0], [1]],
                            no_allowed_token={"a": 1})
    wire = runner_output_to_wire(out)
    import msgspec

    back = runner_output_from_wire(msgspec.msgpack.decode(msgspec.msgpack.encode(wire),
                                                          type=RunnerOutputWire))
    assert back.no_allowed_token == {"a": 1} and back == out


# -- the scheduler ------------------------------------------------------------------------

def scheduled(*requests, spec: bool = False):
    """A scheduler past the requests' prefill, each with output ``[A]``."""
    cfg = make_config(block_size=4, spec_backend="ngram" if spec else "none", num_spec=3)
    sched = PagedScheduler(cfg, num_blocks=64)
    for req in requests:
        sched.add_request(req)
    so = sched.schedule()
    ids = [r.request_id for r in requests]
    sched.update_from_output(so, ModelRunnerOutput(req_ids=ids,
                                                   sampled_token_ids=[[A] for _ in ids]))
    return sched


def test_the_scheduler_ends_the_flagged_request_and_keeps_the_others():
    bad = make_request("bad", [1, 2, 3], eos=EOS, max_tokens=8, allowed_token_ids=[A, B],
                       bad_words_token_ids=EVERY_PAIR)
    good = make_request("good", [1, 2, 3], eos=EOS, max_tokens=8)
    sched = scheduled(bad, good)
    so = sched.schedule()
    outs = {o.request_id: o for o in sched.update_from_output(so, ModelRunnerOutput(
        req_ids=["bad", "good"], sampled_token_ids=[[0], [9]], no_allowed_token={"bad": 0}))}
    o = outs["bad"]
    assert o.new_token_ids == [] and bad.output_token_ids == [A]  # no garbage appended
    assert (o.finish_reason, o.error_code, o.error_param) == (
        "error", "no_allowed_token", "bad_words")
    assert o.stop_reason.startswith(
        f"bad_words forbid every token allowed_token_ids [{A}, {B}] allow after 1 output token")
    fault = o.request_fault()
    assert isinstance(fault, RequestFaultError) and str(fault) == o.stop_reason
    assert bad.status == RequestStatus.FINISHED_ERROR and "bad" not in sched.requests
    assert outs["good"].new_token_ids == [9] and outs["good"].finish_reason is None
    assert good.output_token_ids == [A, 9]
    assert sched.running == [good]
    assert "bad" in sched.schedule().finished_req_ids  # the runner drops its state


@pytest.mark.parametrize(("params", "param", "says"), [
    (dict(allowed_token_ids=[EOS], min_tokens=5), "min_tokens",
     f"min_tokens = 5 is more than allowed_token_ids [{EOS}] allow: after 1 output token"),
    (dict(allowed_token_ids=[EOS, A], min_tokens=5, bad_words_token_ids=[[A]]), "min_tokens",
     "min_tokens = 5 and bad_words together forbid every token"),
    (dict(allowed_token_ids=[9], stop_token_ids=[9], min_tokens=3), "min_tokens",
     "min_tokens = 3 is more than allowed_token_ids [9]"),
    (dict(logits_processors=["mask_all"]), "logits_processors",
     "the logits processors ['mask_all'] forbade every token"),
    (dict(), None, "every logit was -inf after 1 output token"),  # an engine fault
])
def test_the_message_names_the_parameter(params, param, says):
    req = make_request("r", [1, 2, 3], eos=EOS, max_tokens=8, **params)
    sched = scheduled(req)
    so = sched.schedule()
    (o,) = sched.update_from_output(so, ModelRunnerOutput(
        req_ids=["r"], sampled_token_ids=[[0]], no_allowed_token={"r": 0}))
    assert o.finish_reason == "error" and o.error_param == param and says in o.stop_reason
    assert o.error_code == (None if param is None else "no_allowed_token")


def test_a_grammar_that_fails_while_explaining_leaves_the_scheduler_healthy():
    from types import SimpleNamespace

    class BrokenGrammar:
        def accept_tokens(self, token_ids):
            raise RuntimeError("plugin bug")

        def is_terminated(self):
            return False

    req = make_request("r", [1, 2, 3], eos=EOS, max_tokens=8, allowed_token_ids=[EOS],
                       min_tokens=5)
    sched = scheduled(req)
    req.structured_output = SimpleNamespace(
        grammar=BrokenGrammar(), constraint=SimpleNamespace(describe=lambda: "regex"))
    so = sched.schedule()
    so.grammar_bitmask = torch.zeros(1, 1, dtype=torch.int32)
    (o,) = sched.update_from_output(so, ModelRunnerOutput(
        req_ids=["r"], sampled_token_ids=[[0]], no_allowed_token={"r": 0}))
    assert o.finish_reason == "error" and o.error_param == "min_tokens"  # its own rules
    assert "after 1 output token" in o.stop_reason and "r" not in sched.requests


def test_a_flagged_verification_row_ends_the_request_there():
    req = make_request("r", [1, 2, 3], eos=EOS, max_tokens=10)
    sched = scheduled(req, spec=True)
    n = req.num_tokens
    req.spec_token_ids = [A, B, 5]
    so = sched.schedule()
    assert so.scheduled_spec_decode_tokens == {"r": [A, B, 5]}
    # draft A accepted, row 1 had nothing allowed: A is kept, the rest dropped
    (o,) = sched.update_from_output(so, ModelRunnerOutput(
        req_ids=["r"], sampled_token_ids=[[A, 0]], num_draft_tokens={"r": 3},
        num_accepted_tokens={"r": 1}, no_allowed_token={"r": 1}))
    assert o.new_token_ids == [A] and o.finish_reason == "error"
    assert req.num_tokens == n + 1 and req.num_computed_tokens == n  # drafts rolled back
    assert "after 2 output tokens" in o.stop_reason


def test_a_stop_before_the_flagged_row_wins():
    req = make_request("r", [1, 2, 3], eos=EOS, max_tokens=10)
    sched = scheduled(req, spec=True)
    req.spec_token_ids = [EOS, B, 5]
    so = sched.schedule()
    (o,) = sched.update_from_output(so, ModelRunnerOutput(
        req_ids=["r"], sampled_token_ids=[[EOS, 0]], no_allowed_token={"r": 1}))
    assert o.new_token_ids == [EOS] and o.finish_reason == "stop" and o.error_code is None


# -- admission: what can be decided up front ---------------------------------------------

def processor() -> InputProcessor:
    return InputProcessor(make_byte_tokenizer(), 64, 320, eos_token_ids=[256, 300])


@pytest.mark.parametrize(("params", "param", "says"), [
    (dict(allowed_token_ids=[256], min_tokens=5), "min_tokens",
     "every one of allowed_token_ids [256] ends the output (EOS 256 or stop_token_ids), "
     "which min_tokens = 5 forbids before 5 tokens"),
    (dict(allowed_token_ids=[300], min_tokens=1), "min_tokens", "[300]"),  # another EOS
    (dict(allowed_token_ids=[9, 256], stop_token_ids=[9], min_tokens=2), "min_tokens",
     "[9, 256]"),
    (dict(allowed_token_ids=[97, 98], bad_words=["a", "b"]), "bad_words",
     "bad_words forbid every one of allowed_token_ids [97, 98]"),
    (dict(allowed_token_ids=[97, 256], bad_words_token_ids=[[97]], min_tokens=1),
     "min_tokens", "or is a one-token bad word"),
])
def test_admission_refuses_rules_that_leave_nothing(params, param, says):
    with pytest.raises(InvalidRequestError) as info:
        processor().make_request("r", [1, 2], SamplingParams(max_tokens=8, **params))
    assert (info.value.code, info.value.param) == ("no_allowed_token", param)
    assert says in str(info.value)


@pytest.mark.parametrize("params", [
    dict(allowed_token_ids=[256], min_tokens=0),  # may stop at once
    dict(allowed_token_ids=[256], min_tokens=5, ignore_eos=True),  # EOS is a token then
    dict(allowed_token_ids=[256, 97], min_tokens=5),
    dict(allowed_token_ids=[97, 98], bad_words=["a"]),
    dict(allowed_token_ids=[97], bad_words_token_ids=[[97, 97]]),  # only later: dynamic
])
def test_admission_takes_rules_that_leave_a_token(params):
    processor().make_request("r", [1, 2], SamplingParams(max_tokens=8, **params))


def test_the_server_answers_400_for_rules_that_leave_nothing():
    from test_serve_http import assert_openai_error, make_client

    class ValidatingLLM:
        """What the completions route needs of an ``AsyncLLM``: validates as it does."""

        can_serve, num_engines, is_healthy = True, 1, True

        def __init__(self) -> None:
            self.tokenizer = make_byte_tokenizer()

        async def generate(self, prompt, params, **kwargs):
            processor().make_request("r", list(prompt.encode()), params)
            raise AssertionError("admitted")
            yield

    client = make_client()
    client.app.state.lmkit.llm = ValidatingLLM()
    body = {"model": "tiny", "prompt": "N", "max_tokens": 8, "min_tokens": 3,
            "allowed_token_ids": [256]}
    for stream in (False, True):
        err = assert_openai_error(client.post("/v1/completions", json={**body,
                                  "stream": stream}), 400, code="no_allowed_token",
                                  param="min_tokens")
        assert "allowed_token_ids [256]" in err["message"]


# -- the engine ---------------------------------------------------------------------------

COMMON = dict(device="cpu", dtype="float32", max_model_len=128, num_blocks=64, block_size=4,
              progress=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-masked"))


def check_fault(completion, param: str, num_tokens: int) -> None:
    assert completion.finish_reason == "error", completion
    assert isinstance(completion.error, RequestFaultError)
    assert (completion.error.code, completion.error.param) == ("no_allowed_token", param)
    assert completion.stop_reason == str(completion.error)
    assert completion.token_ids == [98] * num_tokens


@pytest.mark.parametrize("spec", [{}, dict(speculative="ngram", num_speculative_tokens=3)])
def test_llm_generate_ends_the_request_and_serves_the_others(tiny, spec):
    from lmkit import LLM

    # only "b", and "bbb" a bad word: nothing is left for the third token (with ngram
    # drafts, "x"'s third is a verification row: "b" drafted after "x", "b")
    conflict = SamplingParams(max_tokens=8, temperature=0, allowed_token_ids=[98],
                              bad_words_token_ids=[[98, 98, 98]])
    fine = SamplingParams(max_tokens=6, temperature=0)
    with LLM(str(tiny), **COMMON, **spec) as llm:
        alone = llm.generate(["bbbbbbbb"], [fine])[0].outputs[0]
        outs = llm.generate(["bbbbbbbb", "bbbbbbbb", "x"], [conflict, fine, conflict])
        # past admission (were it skipped): EOS is the only token and min_tokens bans it
        llm.input_processor._check_some_token_allowed = lambda params: None
        (late,) = llm.generate(["bbbbbbbb"], [SamplingParams(
            max_tokens=8, temperature=0, allowed_token_ids=[256], min_tokens=3)])
    for i in (0, 2):  # two tokens, then an error (was: "b", "b", garbage 0, "b", ...)
        check_fault(outs[i].outputs[0], "bad_words", 2)
        assert "after 2 output tokens" in outs[i].outputs[0].stop_reason
    f = outs[1].outputs[0]
    assert f.finish_reason == "length" and f.error is None and f.token_ids == alone.token_ids
    c = late.outputs[0]
    assert c.finish_reason == "error" and c.token_ids == [] and c.error.param == "min_tokens"
    assert "min_tokens = 3 is more than allowed_token_ids [256] allow" in str(c.error)

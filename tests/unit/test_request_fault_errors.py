"""Errors a request causes itself, told apart from engine faults.

A constrained request whose own parameters (``allowed_token_ids``, ``min_tokens``,
``bad_words``) leave no token the constraint allows ends with ``finish_reason`` "error"
marked as its own fault (``no_allowed_token``, the parameter named): the engine output
carries the code over the wire, ``LLM``'s completion carries a ``RequestFaultError``,
and the server answers 400 instead of 500 ``engine_error``. A refused token while
tokens were left is still an engine fault.
"""

from __future__ import annotations

import json

import pytest
from lmkit.api.outputs import CompletionOutput, EngineCoreOutput, RequestOutput
from lmkit.api.request import Request, RequestStatus
from lmkit.api.sampling_params import SamplingParams
from lmkit.engine.messages import EngineOutputs, make_encoder, make_frontend_decoder
from lmkit.errors import InvalidRequestError, RequestFaultError
from lmkit.frontend.output_processor import OutputProcessor
from lmkit.testing.tiny_model import make_byte_tokenizer
from test_serve_http import assert_openai_error, make_client

pytest.importorskip("xgrammar")
from test_structured_manager import EOS, admit_all, ids, make_manager  # noqa: E402

BYTE_ZERO = 0  # what a greedy sampler draws from a row of -inf logits


def constrained(rid: str, constraint: dict, **params) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(structured_outputs=constraint, **params),
                   eos_token_id=EOS)


def advance_one(constraint: dict, steps: list[list[int]], **params):
    """Run ``steps`` (each step's new tokens, appended to the output as the scheduler
    does) through a manager; returns the last step's output and the scheduler."""
    manager = make_manager()
    req = constrained("r", constraint, **params)
    manager.add_request(req)
    admit_all(manager, manager.scheduler)
    out = None
    for tokens in steps:
        req.append_output_token_ids(tokens)
        out = EngineCoreOutput("r", tokens)
        manager.advance([out])
    return out, manager.scheduler


def test_regex_against_allowed_token_ids_is_the_requests_fault():
    out, scheduler = advance_one({"regex": "[0-9]+"}, [[BYTE_ZERO]],
                                 allowed_token_ids=[ord("a")])
    assert out.finish_reason == "error"
    assert (out.error_code, out.error_param) == ("no_allowed_token", "allowed_token_ids")
    assert "allowed_token_ids [97]" in out.stop_reason
    assert 'regex "[0-9]+" constraint have no token in common' in out.stop_reason
    assert "at the first output token" in out.stop_reason
    assert scheduler.finished == [("r", RequestStatus.FINISHED_ERROR)]
    fault = out.request_fault()
    assert isinstance(fault, RequestFaultError) and isinstance(fault, InvalidRequestError)
    assert (fault.code, fault.param, str(fault)) == ("no_allowed_token", "allowed_token_ids",
                                                     out.stop_reason)


def test_min_tokens_longer_than_the_constraint_is_the_requests_fault():
    # "7" completes the regex; only EOS may follow, and min_tokens=4 forbids it
    out, _ = advance_one({"regex": "[0-9]"}, [ids("7"), [BYTE_ZERO]], min_tokens=4)
    assert (out.finish_reason, out.error_code, out.error_param) == (
        "error", "no_allowed_token", "min_tokens")
    assert "min_tokens = 4 is more than the regex" in out.stop_reason
    assert "after 1 output token " in out.stop_reason and f"[{EOS}]" in out.stop_reason


def test_drafts_are_explained_at_the_first_refused_one():
    # speculative decoding: "7" accepted, the garbage after it refused
    out, _ = advance_one({"regex": "[0-9]"}, [[*ids("7"), BYTE_ZERO]], min_tokens=4)
    assert out.error_param == "min_tokens" and "after 1 output token " in out.stop_reason


def test_explaining_leaves_the_grammar_as_it_was():
    from lmkit.structured.fault import explain_refused_tokens

    manager = make_manager()
    req = constrained("r", {"regex": "[0-9]{3}"}, min_tokens=5)
    manager.add_request(req)
    admit_all(manager, manager.scheduler)
    grammar = req.structured_output.grammar
    req.append_output_token_ids([*ids("12"), BYTE_ZERO])
    refusal = explain_refused_tokens(grammar, req, [*ids("12"), BYTE_ZERO], "regex", 320)
    assert refusal.code is None and "after 2 output tokens" in refusal.message  # digits left
    assert grammar.accept_tokens(ids("123"))  # from the start again: rolled back


def test_bad_words_banning_the_only_choice_is_the_requests_fault():
    out, _ = advance_one({"choice": ["yes"]}, [ids("ye"), [BYTE_ZERO]],
                        bad_words_token_ids=[[ord("s")]])
    assert (out.error_code, out.error_param) == ("no_allowed_token", "bad_words")
    assert "bad_words forbid every token" in out.stop_reason and "[115]" in out.stop_reason


def test_a_refused_token_with_tokens_left_stays_an_engine_fault():
    out, _ = advance_one({"regex": "ab"}, [ids("z")], allowed_token_ids=[ord("a"), ord("z")])
    assert out.finish_reason == "error" and "does not allow" in out.stop_reason
    assert out.error_code is None and out.error_param is None and out.request_fault() is None
    out, _ = advance_one({"regex": "[0-9]"}, [ids("7"), [BYTE_ZERO]], min_tokens=1)
    assert out.error_code is None  # min_tokens already reached: EOS was allowed


def test_a_refused_last_token_is_an_error_even_when_the_scheduler_stopped_it():
    # max_tokens=1: the scheduler finished the request with "length"; its only token is
    # garbage (was: "length" with that token, a 200 from the server)
    manager = make_manager()
    req = constrained("r", {"regex": "[0-9]+"}, allowed_token_ids=[ord("a")], max_tokens=1)
    manager.add_request(req)
    admit_all(manager, manager.scheduler)
    req.append_output_token_ids([BYTE_ZERO])
    out = EngineCoreOutput("r", [BYTE_ZERO], finish_reason="length")
    manager.advance([out])
    assert (out.finish_reason, out.error_code) == ("error", "no_allowed_token")


def test_the_fault_crosses_the_wire_and_reaches_the_completion():
    fault = EngineCoreOutput("r", [BYTE_ZERO], finish_reason="error", stop_reason="why",
                             error_code="no_allowed_token", error_param="min_tokens")
    engine = EngineCoreOutput("e", [BYTE_ZERO], finish_reason="error", stop_reason="bug")
    decoded = make_frontend_decoder().decode(make_encoder().encode(
        EngineOutputs([fault, engine]))).outputs
    assert [(o.error_code, o.error_param) for o in decoded] == [
        ("no_allowed_token", "min_tokens"), (None, None)]
    processor = OutputProcessor(make_byte_tokenizer())
    for rid in ("r", "e"):
        processor.add_request(Request(rid, [1], SamplingParams(max_tokens=4)), "x")
    outs = {o.request_id: o.outputs[0] for o in processor.process_outputs(decoded)
            .request_outputs}
    error = outs["r"].error
    assert isinstance(error, RequestFaultError) and isinstance(error, InvalidRequestError)
    assert (str(error), error.code, error.param) == ("why", "no_allowed_token", "min_tokens")
    assert outs["r"].finish_reason == "error" and outs["r"].stop_reason == "why"
    assert outs["e"].error is None and outs["e"].finish_reason == "error"


# -- the HTTP server --------------------------------------------------------------------

FAULT = RequestFaultError("allowed_token_ids [97] and the regex constraint have no token "
                          "in common", param="allowed_token_ids", code="no_allowed_token")


def output(text: str, finish: str | None = None, error: RequestFaultError | None = None,
           reason: str | None = None) -> RequestOutput:
    c = CompletionOutput(0, text, list(text.encode()), finish_reason=finish,
                         stop_reason=reason, error=error, delta_text=text,
                         delta_token_ids=list(text.encode()))
    return RequestOutput("r", "N", [78], [c], finished=finish is not None)


class FakeLLM:
    """What the completions route needs of an ``AsyncLLM``: yields ``outputs``."""

    can_serve = True
    is_healthy = True
    num_engines = 1

    def engine_stats(self):
        return {}

    def __init__(self, outputs: list[RequestOutput]) -> None:
        self.outputs = outputs
        self.tokenizer = make_byte_tokenizer()

    async def generate(self, prompt, params, **kwargs):
        for out in self.outputs:
            yield out


def client_with(outputs: list[RequestOutput]):
    client = make_client()
    client.app.state.lmkit.llm = FakeLLM(outputs)
    return client


BODY = {"model": "tiny", "prompt": "N", "max_tokens": 8}


def stream_events(client) -> tuple[int, list]:
    with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as resp:
        if resp.status_code != 200:
            resp.read()
            return resp.status_code, [resp.json()]
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return 200, [json.loads(d) for d in lines[:-1]]


def test_a_request_fault_is_a_400_streamed_or_not():
    client = client_with([output("\x00", "error", FAULT, str(FAULT))])
    err = assert_openai_error(client.post("/v1/completions", json=BODY), 400,
                              code="no_allowed_token", param="allowed_token_ids")
    assert err["type"] == "invalid_request_error" and err["message"] == str(FAULT)
    status, events = stream_events(client)  # failed at its first output: still a status
    assert status == 400 and events[0]["error"]["code"] == "no_allowed_token"
    # the engine's side counts a request when it ends (here a scripted engine, which
    # counts nothing): the HTTP layer adds no count of its own
    assert 'outcome="invalid"} 1.0' not in client.get("/metrics").text


def test_a_request_fault_after_streamed_tokens_is_an_error_event():
    client = client_with([output("1"), output("1\x00", "error", FAULT, str(FAULT))])
    status, events = stream_events(client)
    assert status == 200 and events[0]["choices"][0]["text"] == "1"
    assert events[-1]["error"] == {"message": str(FAULT), "type": "invalid_request_error",
                                   "param": "allowed_token_ids", "code": "no_allowed_token"}
    assert_openai_error(client.post("/v1/completions", json=BODY), 400,
                        code="no_allowed_token")


def test_an_engine_fault_stays_a_500():
    client = client_with([output("z", "error", None, "the model produced tokens [122]")])
    err = assert_openai_error(client.post("/v1/completions", json=BODY), 500,
                              code="engine_error")
    assert err["type"] == "server_error" and "tokens [122]" in err["message"]
    status, events = stream_events(client)
    assert status == 500 and events[0]["error"]["code"] == "engine_error"


@pytest.mark.parametrize("errors,outcome", [
    ([FAULT], "invalid"),  # the request's own fault: counted as a 400 is
    ([None], "error"),  # an engine fault
    ([FAULT, None], "error"),  # n = 2, one of each: the engine's fault wins
])
def test_the_metrics_outcome_says_whose_fault_it_was(errors, outcome):
    from lmkit.frontend.collector import OutputCollector

    seen = []

    class Observer:
        def on_first_token(self, ttft_s):
            pass

        def on_tokens(self, num_tokens, inter_token_s):
            pass

        def on_finish(self, outcome, e2e_s, num_prompt_tokens, num_generated_tokens):
            seen.append(outcome)

    completions = [CompletionOutput(index=i, text="", token_ids=[], finish_reason="error",
                                    stop_reason="no token", error=e)
                   for i, e in enumerate(errors)]
    OutputCollector(1, Observer()).put(RequestOutput("r", "N", [78], completions,
                                                     finished=True))
    assert seen == [outcome]

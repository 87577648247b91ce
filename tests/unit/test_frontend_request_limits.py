"""The frontend's request checks that need the model's facts but no engine (issue 25):
``min_tokens`` against the context left, 64-bit bounds, the constraint size limit, and
bookkeeping that stays linear however many requests are in flight."""

from __future__ import annotations

import time

import pytest
from lmkit.api.outputs import EngineCoreOutput
from lmkit.api.sampling_params import SamplingParams
from lmkit.errors import InvalidRequestError
from lmkit.frontend.output_processor import OutputProcessor
from lmkit.frontend.processor import InputProcessor
from lmkit.testing.tiny_model import make_byte_tokenizer

CONTEXT = 64


@pytest.fixture(scope="module")
def tokenizer():
    return make_byte_tokenizer()


@pytest.fixture
def processor(tokenizer):
    return InputProcessor(tokenizer, CONTEXT, 256, (320,), max_constraint_chars=100)


def test_min_tokens_past_the_context_left_is_refused(processor):
    prompt = list(b"hello")  # 5 tokens: 59 left
    with pytest.raises(InvalidRequestError, match="lower min_tokens to at most 59") as info:
        processor.make_request("r", prompt, SamplingParams(max_tokens=None, min_tokens=10**9))
    assert info.value.param == "min_tokens"
    ok = processor.make_request("r", prompt, SamplingParams(max_tokens=None, min_tokens=59))
    assert ok.max_tokens == 59


@pytest.mark.parametrize("field", ["seed", "top_k", "max_tokens", "min_tokens"])
def test_sampling_integers_past_64_bits_are_refused(field):
    with pytest.raises(InvalidRequestError, match="64-bit") as info:
        SamplingParams(**{field: 2**63})
    assert info.value.param == field
    SamplingParams(seed=-(2**63))  # the whole int64 range is a valid seed


def test_priority_past_64_bits_is_refused(processor):
    with pytest.raises(InvalidRequestError, match="64-bit") as info:
        processor.make_request("r", [1, 2], SamplingParams(), priority=2**64)
    assert info.value.param == "priority"


def test_constraint_size_is_bounded_before_compiling(processor):
    big = {"regex": "a" * 101}
    with pytest.raises(InvalidRequestError, match="max_constraint_chars") as info:
        processor.make_request("r", [1], SamplingParams(structured_outputs=big))
    assert info.value.code == "constraint_too_large"
    processor.make_request("r", [1], SamplingParams(structured_outputs={"regex": "a" * 90}))


def test_finishing_requests_is_linear_in_the_requests(tokenizer, processor):
    """Finishing a request touched every id in flight: 40,000 took half a minute on 2 cores."""
    out = OutputProcessor(tokenizer)
    num = 40_000
    params = SamplingParams(max_tokens=1)
    for i in range(num):
        out.add_request(processor.make_request(f"r{i}", [65], params), None)
    start = time.monotonic()
    finished = 0
    for i in range(0, num, 100):  # 100 requests finish per step
        step = [EngineCoreOutput(f"r{j}", [66], "length") for j in range(i, i + 100)]
        finished += sum(o.finished for o in out.process_outputs(step).request_outputs)
    assert finished == num and not out.has_unfinished()
    assert time.monotonic() - start < 5.0


def test_abort_forgets_only_its_own_completions(tokenizer, processor):
    out = OutputProcessor(tokenizer)
    for parent in ("a", "b"):
        for i in range(3):
            req = processor.make_request(f"{parent}-{i}", [65], SamplingParams(max_tokens=2))
            out.add_request(req, None, parent_id=parent, index=i, n=3)
    assert sorted(out.abort("a")) == ["a-0", "a-1", "a-2"]
    assert out.abort("a") == []
    step = out.process_outputs([EngineCoreOutput("b-1", [66], None)])
    assert [o.request_id for o in step.request_outputs] == ["b"]


def test_a_shared_constraint_is_checked_once_per_request(processor, monkeypatch):
    import lmkit.frontend.processor as module

    calls = []
    real = module.validate_structured_outputs
    monkeypatch.setattr(module, "validate_structured_outputs",
                        lambda c, m: calls.append(c) or real(c, m))
    params = SamplingParams(n=8, structured_outputs={"json": {"type": "object"}})
    for i in range(8):  # what AsyncLLM does for n=8: one request per completion
        processor.make_request(f"r-{i}", [1], module.child_params(params, i))
    assert len(calls) == 1
    with pytest.raises(InvalidRequestError, match="infinitely deep"):
        processor.make_request("s", [1], SamplingParams(structured_outputs={"json": {"$ref": "#"}}))


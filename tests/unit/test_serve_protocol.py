"""OpenAI request bodies -> SamplingParams, and the 400s they raise (with ``param``)."""

from __future__ import annotations

import pydantic
import pytest
from lmkit.errors import InvalidRequestError
from lmkit.serve.protocol import ChatCompletionRequest, CompletionRequest


def chat(**kw):
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **kw)


def test_completion_fields_map_onto_sampling_params():
    body = CompletionRequest(model="m", prompt="x", n=2, max_tokens=7, temperature=0.5,
                             top_p=0.9, top_k=3, min_p=0.1, frequency_penalty=0.2,
                             presence_penalty=-0.3, repetition_penalty=1.1,
                             logit_bias={"12": 5}, seed=3, stop="END", logprobs=2, echo=True,
                             min_tokens=2, ignore_eos=True, stop_token_ids=[4])
    p = body.to_sampling_params()
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (2, 7, 0.5, 0.9, 3, 0.1)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.2, -0.3, 1.1)
    assert p.logit_bias == {12: 5.0} and p.seed == 3 and p.stop == ["END"]
    assert p.logprobs == 2 and p.prompt_logprobs == 2  # echo + logprobs
    assert p.min_tokens == 2 and p.ignore_eos and p.stop_token_ids == [4]


def test_token_constraints_map_onto_sampling_params_on_both_endpoints():
    fields = dict(allowed_token_ids=[3, 5], bad_words="no", logits_processors=["p"],
                  extra_args={"k": 1})
    for body in (CompletionRequest(model="m", prompt="x", **fields), chat(**fields)):
        p = body.to_sampling_params()
        assert p.allowed_token_ids == [3, 5] and p.bad_words == ["no"]
        assert p.logits_processors == ["p"] and p.extra_args == {"k": 1}
    p = chat(bad_words=["a", "b c"]).to_sampling_params()
    assert p.bad_words == ["a", "b c"] and p.allowed_token_ids is None
    with pytest.raises(InvalidRequestError, match="allowed_token_ids must not be empty") as e:
        chat(allowed_token_ids=[]).to_sampling_params()
    assert e.value.param == "allowed_token_ids"


def test_completion_defaults_follow_openai():
    p = CompletionRequest(model="m", prompt="x").to_sampling_params()
    assert p.max_tokens == 16 and p.temperature == 1.0 and p.logprobs is None
    assert p.prompt_logprobs is None


def test_prompt_batches():
    assert CompletionRequest(model="m", prompt="a").prompts() == ["a"]
    assert CompletionRequest(model="m", prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(model="m", prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(model="m", prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]


def test_chat_max_completion_tokens_and_logprobs():
    p = chat(max_completion_tokens=9, max_tokens=3, logprobs=True, top_logprobs=4
             ).to_sampling_params()
    assert p.max_tokens == 9 and p.logprobs == 4
    assert chat().to_sampling_params().max_tokens is None  # until the context is full
    assert chat(logprobs=True).to_sampling_params().logprobs == 0
    assert chat().template_messages() == [{"role": "user", "content": "hi"}]


def test_text_parts_are_joined():
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert body.template_messages()[0]["content"] == "ab"


@pytest.mark.parametrize("kwargs,param", [
    ({"n": 0}, "n"), ({"n": 129}, "n"), ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"), ({"min_p": 2}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"1": 500}}, "logit_bias"), ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
])
def test_invalid_chat_values_name_their_param(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        chat(**kwargs).to_sampling_params()
    assert info.value.param == param


@pytest.mark.parametrize("kwargs,param", [
    ({"logprobs": 21}, "logprobs"), ({"best_of": 3}, "best_of"), ({"suffix": "x"}, "suffix"),
])
def test_invalid_completion_values_name_their_param(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        CompletionRequest(model="m", prompt="x", **kwargs).to_sampling_params()
    assert info.value.param == param


def test_unknown_fields_and_non_text_parts_fail_validation():
    with pytest.raises(pydantic.ValidationError, match="extra"):
        chat(frobnicate=1)
    with pytest.raises(pydantic.ValidationError, match="text parts only"):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(pydantic.ValidationError):
        ChatCompletionRequest(model="m", messages=[])
    with pytest.raises(InvalidRequestError):
        CompletionRequest(model="m", prompt=[]).prompts()

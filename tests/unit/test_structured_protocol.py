"""OpenAI ``response_format`` and the lmkit ``structured_outputs`` extension map onto
``SamplingParams.structured_outputs``; malformed ones are 400s naming the field."""

from __future__ import annotations

import pydantic
import pytest
from lmkit.errors import InvalidRequestError
from lmkit.serve.protocol import ChatCompletionRequest, CompletionRequest

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**kwargs) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], **kwargs)


@pytest.mark.parametrize(("response_format", "expected"), [
    ({"type": "text"}, None),
    ({"type": "json_object"}, {"json_object": True}),
    ({"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}},
     {"json": SCHEMA}),
    ({"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}, {"json": SCHEMA}),
])
def test_response_format_becomes_a_constraint(response_format, expected):
    params = chat(response_format=response_format).to_sampling_params()
    assert params.structured_outputs == expected


@pytest.mark.parametrize("extension", [
    {"json": SCHEMA}, {"json": '{"type": "string"}'}, {"regex": "[0-9]{3}"},
    {"grammar": 'root ::= "yes" | "no"'}, {"choice": ["red", "blue"]}, {"json_object": True},
])
def test_structured_outputs_extension_on_both_endpoints(extension):
    assert chat(structured_outputs=extension).to_sampling_params().structured_outputs == extension
    completion = CompletionRequest(model="m", prompt="x", structured_outputs=extension)
    assert completion.to_sampling_params().structured_outputs == extension


@pytest.mark.parametrize(("kwargs", "param", "message"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r"}}},
     "response_format", "needs json_schema.schema"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list"),
    ({"structured_outputs": {"json": "{oops"}}, "structured_outputs", "not valid JSON"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "not both"),
])
def test_malformed_constraints_name_their_field(kwargs, param, message):
    with pytest.raises(InvalidRequestError, match=message) as info:
        chat(**kwargs).to_sampling_params()
    assert info.value.param == param


def test_unknown_constraint_kinds_fail_validation():
    with pytest.raises(pydantic.ValidationError, match="extra"):
        chat(structured_outputs={"jsonschema": SCHEMA})
    with pytest.raises(pydantic.ValidationError):
        chat(response_format={"type": "xml"})

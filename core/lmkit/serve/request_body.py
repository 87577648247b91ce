"""Reading a request body by hand, so that its cost can be checked before paying it.

FastAPI validates a body fully before the route runs: a batch of 190,000 prompts would
be validated (and checked for bad text) before the route could count it and refuse it.
The completions route reads the JSON itself, counts the sequences it asks for
(:func:`count_sequences`), and only then validates it, with the same 400s as FastAPI's
(:class:`~fastapi.exceptions.RequestValidationError`, mapped by
:func:`lmkit.serve.errors.validation_error`). Every other POST route reads its body the
same way, so that all of them take JSON whatever the ``Content-Type`` (``curl -d`` sends
a form type) and answer an empty, compressed or non-object body with the same error.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from lmkit.serve.errors import APIError

ModelT = TypeVar("ModelT", bound=BaseModel)


_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}


async def read_json(request: Request) -> dict[str, Any]:
    """The request's body parsed as a JSON object; 415 when it is compressed
    (``Content-Encoding``), 400 (with a code) when it is empty, not JSON, or JSON but
    not an object."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise APIError(415, f"Content-Encoding {encoding!r} is not supported; send the "
                       "request body uncompressed (JSON encoded as UTF-8)",
                       code="unsupported_content_encoding")
    raw = await request.body()
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object with the "
                       "request's parameters (Content-Type: application/json)",
                       code="missing_body")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # also bad UTF-8, integers of 4300+ digits
        raise APIError(400, f"the request body could not be parsed as JSON: {e}; send a "
                       "JSON object encoded as UTF-8", code="invalid_json") from None
    if not isinstance(data, dict):
        kind = _JSON_TYPES.get(type(data), type(data).__name__)
        raise APIError(400, f"the request body must be a JSON object ({{...}}) holding the "
                       f"request's parameters, got {kind}", code="invalid_body")
    return data


def validate(model: type[ModelT], data: Any) -> ModelT:
    """``data`` as ``model``, or the 400 that FastAPI's own validation would give."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err.get("loc", ()))} for err in e.errors()]
        raise RequestValidationError(errors) from None


def count_sequences(data: Any) -> tuple[int, int]:
    """(prompts, completions per prompt) that an unvalidated completions body asks for,
    from the length of its ``prompt`` list and its ``n`` / ``best_of``; (1, 1) where
    they are not yet well formed (validation reports that)."""
    if not isinstance(data, dict):
        return 1, 1
    prompt = data.get("prompt")
    num_prompts = 1
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        num_prompts = len(prompt)  # a batch; a list of ints is one prompt
    per_prompt = [v for v in (data.get("n"), data.get("best_of"))
                  if isinstance(v, int) and not isinstance(v, bool)]
    return num_prompts, max([1, *per_prompt])

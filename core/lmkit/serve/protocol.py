"""OpenAI request bodies for ``/v1/completions`` and ``/v1/chat/completions``.

Validated once at the boundary (pydantic, ``extra="forbid"``: an unknown argument is a
400, as with OpenAI). Fields beyond OpenAI's (``top_k``, ``min_p``, ``min_tokens``,
``repetition_penalty``, ``ignore_eos``, ``structured_outputs``, ``allowed_token_ids``,
``bad_words``, ``logits_processors``, ...) are lmkit extensions
that the ``openai`` client sends through ``extra_body``. ``response_format`` (``text``,
``json_object``, ``json_schema``) and ``structured_outputs`` (``json``, ``regex``,
``grammar``, ``choice``, ...) become ``SamplingParams.structured_outputs``. :meth:`to_sampling_params` maps a body onto
:class:`lmkit.SamplingParams`, whose own validation names the offending field.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from lmkit.api.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    MAX_LOGPROBS,
    MAX_TOKEN_IDS,
    SamplingParams,
)
from lmkit.errors import InvalidRequestError
from lmkit.serve.limits import LogprobsParams
from lmkit.serve.text_check import find_lone_surrogate
from lmkit.structured.constraint import validate_structured_outputs

# every integer crosses to the engine as int64: larger ones are a 400 here, not a 500 later
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]


def _prompt_form(value: Any) -> str:
    """Which form a completion prompt takes, from its first element, so that only that
    form is validated (a plain union would validate a 190,000-prompt batch four times).
    The tags are type names, which error messages leave out of the field's name."""
    if isinstance(value, str):
        return "str"
    first = value[0] if isinstance(value, list) and value else None
    if isinstance(first, str):
        return "list[str]"
    return "list[list[int]]" if isinstance(first, list) else "list[int]"


def _fits_int64(value: Any) -> Any:
    """``value`` (free-form JSON: a schema, ``extra_args``) unchanged, or a ValueError naming
    where it holds an integer past 64 bits (the channel to the engine carries none)."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:  # iterative: the value may nest deeper than Python's recursion limit
        path, item = stack.pop()
        if isinstance(item, dict):
            stack.extend((f"{path}.{key}" if path else str(key), v) for key, v in item.items())
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(item))
        elif isinstance(item, int) and not INT64_MIN <= item <= INT64_MAX:
            digits = len(str(abs(item))) if item.bit_length() < 10_000 else "thousands of"
            raise ValueError(f"{path or 'the value'} is an integer of {digits} digits, outside "
                             f"the 64-bit range [{INT64_MIN}, {INT64_MAX}] this server takes")
    return value


Prompt = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[str], Tag("list[str]")]
    | Annotated[list[Int64], Tag("list[int]")]
    | Annotated[list[list[Int64]], Tag("list[list[int]]")],
    Discriminator(_prompt_form),
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _TextBody(_Body):
    """A body whose every text must be valid Unicode (generation and pooling alike)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = find_lone_surrogate(data)
        if where is not None:
            raise PydanticCustomError(
                "invalid_unicode", "{where} holds a lone UTF-16 surrogate (an unpaired "
                "\\ud800-\\udfff escape), which is not valid Unicode text; send characters "
                "outside the BMP as a surrogate pair or as UTF-8", {"where": where})
        return data


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JSONSchemaFormat(_Body):
    """``response_format.json_schema``: a named schema; ``strict`` is accepted (lmkit
    always enforces the schema and never adds properties it does not name)."""

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    _fits = field_validator("schema_")(_fits_int64)


class ResponseFormat(_Body):
    """OpenAI ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def constraint(self) -> dict[str, Any] | None:
        """The equivalent ``structured_outputs`` (``None`` for text)."""
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.schema_ is None:
                raise InvalidRequestError(
                    "response_format of type json_schema needs json_schema.schema (a JSON "
                    "schema object)", param="response_format", code="invalid_value")
            return {"json": self.json_schema.schema_}
        return None


class StructuredOutputs(_Body):
    """The lmkit extension ``structured_outputs``: exactly one constraint."""

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None

    _fits = field_validator("json_", "structural_tag")(_fits_int64)

    def constraint(self) -> dict[str, Any]:
        """The constraint as ``SamplingParams.structured_outputs`` (the spec itself, not
        a copy: ``model_dump`` would copy a schema of megabytes on the event loop)."""
        specs = ((field.alias or name, getattr(self, name))
                 for name, field in type(self).model_fields.items())
        return {kind: spec for kind, spec in specs if spec is not None}


class _SamplingFields(_TextBody):
    """Fields shared by both endpoints."""

    model: str
    n: Int64 = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: Int64 | None = None
    user: str | None = None
    # lmkit / vLLM extensions
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 = 0
    ignore_eos: bool = False
    stop_token_ids: list[Int64] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: Int64 = 0
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: str | list[str] | None = None
    logits_processors: list[str] | None = None
    extra_args: dict[str, Any] | None = None

    _fits = field_validator("extra_args")(_fits_int64)

    def _check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true",
                                      param="stream_options", code="invalid_value")

    def _structured_outputs(self, max_chars: int | None) -> dict[str, Any] | None:
        """The request's constraint, from ``response_format`` or ``structured_outputs``,
        checked (its size against ``max_chars`` first, before any costlier check)."""
        from_format = self.response_format.constraint() if self.response_format else None
        if self.structured_outputs is None:
            constraint, param = from_format, "response_format"
        elif from_format is not None:
            raise InvalidRequestError("give either response_format or structured_outputs, "
                                      "not both", param="structured_outputs",
                                      code="invalid_value")
        else:
            constraint, param = self.structured_outputs.constraint(), "structured_outputs"
        try:
            validate_structured_outputs(constraint, max_chars)
        except InvalidRequestError as e:
            raise InvalidRequestError(str(e), param=param, code=e.code) from None
        return constraint

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        if len(self.logit_bias) > MAX_TOKEN_IDS:  # before looking at each key
            raise InvalidRequestError(
                f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_TOKEN_IDS} are "
                "allowed per request (each costs work on every generated token, shared with "
                "the other requests); send fewer", param="logit_bias", code="invalid_value")
        out = {}
        for key, value in self.logit_bias.items():
            # plain ASCII digits: int() would also take " 1", "1_0" and "١" (Arabic one)
            if re.fullmatch(r"-?[0-9]{1,100}", key) is None:
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids (integers as strings, e.g. \"50256\"), "
                    f"got {key[:40]!r}", param="logit_bias", code="invalid_value")
            out[int(key)] = float(value)
        return out

    def _params(self, max_tokens: int | None, logprobs: int | None,
                prompt_logprobs: int | None = None,
                max_constraint_chars: int | None = None) -> SamplingParams:
        self._check_stream_options()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            logit_bias=self._logit_bias(),
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self._structured_outputs(max_constraint_chars),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=[self.bad_words] if isinstance(self.bad_words, str) else self.bad_words,
            logits_processors=self.logits_processors,
            extra_args=self.extra_args,
        )


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: one prompt or a batch (text or token ids)."""

    prompt: Prompt
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    echo: bool = False
    best_of: Int64 | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The batch as a list of prompts, each text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("prompt must not be empty", param="prompt",
                                      code="invalid_value")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def to_sampling_params(self, max_constraint_chars: int | None = None) -> SamplingParams:
        """Sampling parameters; ``echo`` with ``logprobs`` also asks for prompt logprobs.
        ``max_constraint_chars`` (``structured_output.max_constraint_chars``) refuses a
        longer constraint before its costlier checks run on the event loop."""
        if self.suffix:
            raise InvalidRequestError("suffix is not supported by this server", param="suffix",
                                      code="unsupported_parameter")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError(
                f"best_of ({self.best_of}) different from n ({self.n}) is not supported; "
                "leave best_of unset", param="best_of", code="unsupported_parameter")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got "
                                      f"{self.logprobs}", param="logprobs", code="invalid_value")
        prompt_logprobs = self.logprobs if (self.echo and self.logprobs is not None) else None
        return self._params(self.max_tokens, self.logprobs, prompt_logprobs,
                            max_constraint_chars)

    def logprobs_params(self) -> LogprobsParams:
        """The fields a response too large in log-probabilities is blamed on."""
        return LogprobsParams()


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; content is text or a list of text parts."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        if isinstance(v, list):
            for part in v:
                if isinstance(part, dict) and part.get("type") not in (None, "text"):
                    raise ValueError(f"content part type {part.get('type')!r} is not "
                                     "supported; this server takes text parts only")
        return v

    def as_template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it (text parts joined)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    add_generation_prompt: bool = True

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as plain dicts for the chat template."""
        return [m.as_template_dict() for m in self.messages]

    def to_sampling_params(self, max_constraint_chars: int | None = None) -> SamplingParams:
        """Sampling parameters; no ``max_tokens`` means "until the context is full";
        ``max_constraint_chars`` as for completions."""
        if self.tools:
            raise InvalidRequestError("tool calling is not supported by this server yet",
                                      param="tools", code="unsupported_parameter")
        if self.tool_choice not in (None, "none", "auto"):  # would be silently ignored
            raise InvalidRequestError(
                f"tool_choice {repr(self.tool_choice)[:100]} cannot be honored: this server does not "
                "call tools yet; leave tool_choice unset (or 'none' / 'auto')",
                param="tool_choice", code="unsupported_parameter")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise InvalidRequestError("top_logprobs requires logprobs to be true",
                                          param="top_logprobs", code="invalid_value")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise InvalidRequestError(
                    f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                    param="top_logprobs", code="invalid_value")
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(max_tokens, logprobs, max_constraint_chars=max_constraint_chars)

    def logprobs_params(self) -> LogprobsParams:
        """As for completions; the token bound is named as sent (OpenAI's current
        ``max_completion_tokens`` when neither is)."""
        sent_max_tokens = self.max_tokens is not None and self.max_completion_tokens is None
        return LogprobsParams(logprobs="top_logprobs", prompt_logprobs="prompt_logprobs",
                              max_tokens="max_tokens" if sent_max_tokens
                              else "max_completion_tokens")

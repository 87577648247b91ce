"""Outputs: per-step from the engine core, and user-facing from ``LLM``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmkit.errors import RequestFaultError


@dataclass(slots=True)
class TokenLogprob:
    """The chosen token's log-probability, its rank, and the top alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass(slots=True)
class EngineCoreOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    new_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0
    pooled: list[Any] | None = None  # a pooling request's output (floats, or lists of them)
    # with finish_reason "error" caused by the request's own parameters (not an engine
    # fault): a RequestFaultError code (e.g. "no_allowed_token") and the parameter to
    # change; stop_reason holds the message. None for an engine fault.
    error_code: str | None = None
    error_param: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def request_fault(self) -> RequestFaultError | None:
        """The :class:`~lmkit.errors.RequestFaultError` this output finished with, or
        ``None`` (not finished with an error, or an engine fault)."""
        if self.finish_reason != "error" or self.error_code is None:
            return None
        return RequestFaultError(str(self.stop_reason), param=self.error_param,
                                 code=self.error_code)


@dataclass
class PoolingOutput:
    """A pooling request's result: ``data`` is the pooled vector (``embed``), the class
    probabilities (``classify``) or one vector per token (``all``)."""

    request_id: str
    prompt_token_ids: list[int]
    data: list[Any]  # floats, or one list of floats per token

    @property
    def embedding(self) -> list[Any]:
        """``data`` under the name embedding APIs use."""
        return self.data


@dataclass
class CompletionOutput:
    """One of a request's ``n`` completions."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None
    # what this step added (streaming); empty when nothing changed
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] | None = None
    # with finish_reason "error": set when the request's own parameters caused it (e.g.
    # constraints that leave no token; stop_reason holds the same message); None for
    # an engine fault
    error: RequestFaultError | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's outputs so far (cumulative), or the new part only when streaming deltas."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0

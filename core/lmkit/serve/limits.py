"""Admission control and request-size limits.

:class:`AdmissionController` bounds the sequences in flight: what the engine can run at
once (``max_num_seqs``) plus a queue of ``max_queued_requests``. Past that, a request is
refused at once with 429 and ``Retry-After`` instead of queueing without bound.
:class:`BodySizeLimitMiddleware` refuses bodies over ``max_bytes`` with 413 before any
JSON is parsed, whether or not the client sent ``Content-Length``.
:func:`check_response_logprobs` refuses with 400 a request whose response could carry
more log-probability entries than ``server.max_response_logprobs``, before any prompt
is tokenized.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lmkit.api.sampling_params import SamplingParams
from lmkit.serve.errors import APIError, error_body

# a token covers at least one byte of UTF-8 text (byte-level BPE, SentencePiece with byte
# fallback); the tokenizer may add a few of its own (BOS, EOS, SentencePiece's "▁" prefix)
_ADDED_TOKENS = 8


class Admission:
    """One admitted request's share of the bound; release it exactly once."""

    def __init__(self, controller: AdmissionController, num_seqs: int) -> None:
        self._controller = controller
        self.num_seqs = num_seqs
        self._released = False

    def release(self) -> None:
        """Give the slots back (idempotent)."""
        if not self._released:
            self._released = True
            self._controller.in_flight -= self.num_seqs


class AdmissionController:
    """Counts sequences in flight and refuses new ones past ``capacity``."""

    def __init__(self, capacity: int, retry_after_s: int = 1) -> None:
        if capacity < 1:
            raise ValueError(f"admission capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self.num_rejected = 0

    def admit(self, num_seqs: int) -> Admission:
        """Reserve ``num_seqs`` slots or raise a 429 :class:`APIError`."""
        if self.in_flight + num_seqs > self.capacity and self.in_flight > 0:
            self.num_rejected += 1
            raise APIError(
                429, f"the server is at capacity ({self.in_flight} sequences in flight, "
                f"limit {self.capacity}); retry after {self.retry_after_s}s",
                code="rate_limit_exceeded", headers={"Retry-After": str(self.retry_after_s)})
        self.in_flight += num_seqs
        return Admission(self, num_seqs)


class BodySizeLimitMiddleware:
    """ASGI middleware: 413 for a request body larger than ``max_bytes``.

    The body is read (up to the limit) before the app runs and replayed to it; later
    ``receive`` calls go to the server, so the app still sees ``http.disconnect``.
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    too_big = int(value) > self.max_bytes
                except ValueError:
                    too_big = False
                if too_big:
                    await self._refuse(send)
                    return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # disconnected while sending
                await self.app(scope, _replay([message], receive), send)
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._refuse(send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
        await self.app(scope, _replay(replay, receive), send)

    async def _refuse(self, send: Any) -> None:
        import json

        body = json.dumps(error_body(
            f"the request body is larger than the server's limit of {self.max_bytes} bytes "
            "(server.max_request_body_bytes)", "invalid_request_error",
            code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _replay(messages: list[dict[str, Any]], receive: Any) -> Any:
    pending = list(messages)

    async def replay_receive() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay_receive


@dataclass(frozen=True, slots=True)
class LogprobsParams:
    """The request fields a too-large log-probability response is blamed on, by endpoint
    (the defaults are ``/v1/completions``'s)."""

    logprobs: str = "logprobs"  # alternatives per token
    max_tokens: str = "max_tokens"
    prompt_logprobs: str = "echo"  # what asks for the prompt's log-probabilities
    n: str = "n"
    batch: str = "prompt"


@dataclass(frozen=True, slots=True)
class ResponseLogprobs:
    """The most log-probability entries a response can carry, and what they come from."""

    num_seqs: int
    generated_tokens: int  # over all sequences
    prompt_tokens: int  # echoed prompt tokens (prompt logprobs), over all sequences
    entries: int


def prompt_token_bounds(prompt: str | Sequence[int] | None, context_len: int
                        ) -> tuple[int, int]:
    """(fewest, most) tokens ``prompt`` can hold without tokenizing it: token ids exactly;
    text at most one token per UTF-8 byte plus a few added ones; chat messages (``None``,
    rendered later) anything. Capped at ``context_len`` (longer prompts are refused)."""
    if prompt is None:
        return 0, context_len
    if isinstance(prompt, str):
        size = len(prompt) if prompt.isascii() else len(prompt.encode("utf-8", "surrogatepass"))
        return 0, min(size + _ADDED_TOKENS, context_len)
    return min(len(prompt), context_len), min(len(prompt), context_len)


def count_response_logprobs(params: SamplingParams,
                            prompts: Sequence[str | Sequence[int] | None],
                            context_len: int) -> ResponseLogprobs:
    """The worst case of ``params`` over ``prompts``: ``n`` sequences per prompt, each
    generating ``max_tokens`` (unset: the context the prompt leaves) with ``1 + logprobs``
    entries per token, plus its prompt with ``1 + prompt_logprobs`` when those are asked
    for (prompt and generated tokens together fit in the context)."""
    generated = echoed = 0
    for prompt in prompts:
        fewest, most = prompt_token_bounds(prompt, context_len)
        room = context_len - fewest
        gen = room if params.max_tokens is None else min(params.max_tokens, room)
        gen = 0 if params.logprobs is None else gen
        generated += gen
        if params.prompt_logprobs is not None:
            echoed += min(most, context_len - gen)
    n = params.n
    entries = generated * (1 + (params.logprobs or 0))
    entries += echoed * (1 + (params.prompt_logprobs or 0))
    return ResponseLogprobs(len(prompts) * n, generated * n, echoed * n, entries * n)


def check_response_logprobs(params: SamplingParams,
                            prompts: Sequence[str | Sequence[int] | None],
                            context_len: int, limit: int | None,
                            names: LogprobsParams = LogprobsParams()) -> None:
    """400 ``response_too_large`` when the response to ``params`` over ``prompts`` could
    carry more than ``limit`` log-probability entries (``None``: no limit; a request
    without log-probabilities always passes). ``param`` names what to lower first: an
    unset ``max_tokens`` (the worst case is then the whole context); else ``n`` or the
    batch, since several requests get the same results; else the prompt log-probabilities
    when they are the larger part; else ``max_tokens``."""
    if limit is None or (params.logprobs is None and params.prompt_logprobs is None):
        return
    worst = count_response_logprobs(params, prompts, context_len)
    if worst.entries <= limit:
        return
    parts = []
    if worst.generated_tokens:
        unset = (f", {names.max_tokens} unset: up to the {context_len:,}-token context"
                 if params.max_tokens is None else "")
        parts.append(f"{worst.generated_tokens:,} generated tokens x {1 + (params.logprobs or 0)}"
                     f" (the token and {names.logprobs}={params.logprobs}){unset}")
    if worst.prompt_tokens:
        parts.append(f"{worst.prompt_tokens:,} prompt tokens (for {names.prompt_logprobs}) "
                     f"x {1 + (params.prompt_logprobs or 0)}")
    if params.max_tokens is None and worst.generated_tokens:
        param, advice = names.max_tokens, f"set {names.max_tokens}"
    elif params.n > 1:
        param, advice = names.n, "lower n (send several requests instead)"
    elif worst.num_seqs > 1:
        param, advice = names.batch, "split the batch into several requests"
    elif worst.prompt_tokens > worst.generated_tokens:
        param = names.prompt_logprobs
        advice = f"ask for fewer prompt log-probabilities ({names.prompt_logprobs})"
    else:
        param, advice = names.max_tokens, f"lower {names.max_tokens}"
    raise APIError(
        400, f"this request could return up to {worst.entries:,} log-probability entries "
        f"({worst.num_seqs} sequence(s): {' + '.join(parts)}), more than the {limit:,} "
        "this server puts in one response (server.max_response_logprobs); "
        f"{advice}, or lower {names.logprobs}", param=param, code="response_too_large")

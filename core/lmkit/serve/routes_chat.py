"""``POST /v1/chat/completions``: the tokenizer's chat template (sandboxed) over the
messages, then generation, streamed as ``chat.completion.chunk`` events or answered
as one ``chat.completion``."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from lmkit.api.outputs import RequestOutput
from lmkit.serve.app import get_state
from lmkit.serve.handler import created_now, respond
from lmkit.serve.logprobs import TokenTexts, chat_logprobs, logprobs_cost, text_cost
from lmkit.serve.protocol import ChatCompletionRequest
from lmkit.serve.request_body import read_json, validate
from lmkit.serve.streaming import ChunkTemplate

router = APIRouter()


class ChatFormatter:
    """OpenAI chat-completion JSON for one conversation, ``n`` choices."""

    def __init__(self, body: ChatCompletionRequest, request_id: str, model: str,
                 texts: TokenTexts) -> None:
        self.body = body
        self.id = request_id
        self.model = model
        self.created = created_now()
        self.texts = texts
        self.num_top = (body.top_logprobs or 0) if body.logprobs else None
        opts = body.stream_options
        self.include_usage = bool(opts and opts.include_usage)
        self.continuous_usage = bool(opts and opts.continuous_usage_stats)
        self._started = False
        self._finished: set[int] = set()
        self._usage_counts = (0, 0)
        self._template = ChunkTemplate({"id": request_id, "object": "chat.completion.chunk",
                                        "created": self.created, "model": model,
                                        "system_fingerprint": None}, self.include_usage)

    def _usage(self) -> dict[str, int]:
        prompt, completion = self._usage_counts
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def _track(self, output: RequestOutput, delta: bool = False) -> None:
        """Usage from a final output (whole completions) or, with ``delta``, a streamed
        one (only the tokens it adds: ``"delta"`` kind)."""
        completion = sum(len(c.delta_token_ids if delta else c.token_ids)
                         for c in output.outputs)
        if delta:
            completion += self._usage_counts[1]
        self._usage_counts = (len(output.prompt_token_ids), completion)

    def chunks(self, index: int, output: RequestOutput) -> list[dict[str, Any]]:
        usage = self._chunk_usage(output)
        return [self._template.as_dict(c, usage) for c in self._choices(output, lazy=False)]

    def events(self, index: int, output: RequestOutput, in_pieces: bool = False) -> bytes:
        usage = self._chunk_usage(output)
        return b"".join([self._template.event(c, usage, in_pieces)
                         for c in self._choices(output, lazy=in_pieces)])

    def cost(self, index: int, output: RequestOutput, delta: bool) -> int:
        """About how much work the JSON for ``output`` is (see ``Formatter.cost``)."""
        total = 0
        for c in output.outputs:
            total += text_cost(c.delta_text if delta else c.text)
            if self.num_top is not None:
                # each entry also carries its bytes: about twice a completions entry
                lps = c.delta_logprobs if delta else c.logprobs
                total += 2 * logprobs_cost(lps, self.num_top)
        return total

    def _chunk_usage(self, output: RequestOutput) -> dict[str, int] | None:
        self._track(output, delta=True)
        return self._usage() if self.include_usage and self.continuous_usage else None

    def _choices(self, output: RequestOutput, lazy: bool
                 ) -> Iterator[list[dict[str, Any]]]:
        """Each chunk's choices for a new output, built as they are consumed (``lazy``:
        their logprobs too, see :func:`chat_logprobs`)."""
        if not self._started:
            self._started = True
            for i in range(self.body.n):
                yield [{"index": i, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}]
        for c in output.outputs:
            if c.index in self._finished:
                continue
            if c.delta_text or (self.num_top is not None and c.delta_logprobs):
                logprobs = None
                if self.num_top is not None:
                    logprobs = chat_logprobs(self.texts, c.delta_logprobs or [], self.num_top,
                                             lazy)
                yield [{"index": c.index, "delta": {"content": c.delta_text},
                        "logprobs": logprobs, "finish_reason": None}]
            if c.finish_reason is not None:
                self._finished.add(c.index)
                yield [{"index": c.index, "delta": {}, "logprobs": None,
                        "finish_reason": c.finish_reason}]

    def final_chunks(self) -> list[dict[str, Any]]:
        if not self.include_usage:
            return []
        return [self._template.as_dict([], self._usage())]

    def response(self, outputs: list[RequestOutput], iterate_choices: bool = False
                 ) -> dict[str, Any]:
        """The response; with ``iterate_choices`` its ``choices`` is an iterator building
        each choice when it is consumed (see ``Formatter.response``)."""
        (output,) = outputs
        self._track(output)
        choices = self._response_choices(output, lazy=iterate_choices)
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model, "system_fingerprint": None,
                "choices": choices if iterate_choices else list(choices),
                "usage": self._usage()}

    def _response_choices(self, output: RequestOutput, lazy: bool
                          ) -> Iterator[dict[str, Any]]:
        for c in output.outputs:
            logprobs = None
            if self.num_top is not None:
                logprobs = chat_logprobs(self.texts, c.logprobs or [], self.num_top, lazy)
            yield {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text, "refusal": None},
                "logprobs": logprobs, "finish_reason": c.finish_reason,
            }


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    """Answer the conversation; see OpenAI's ``POST /v1/chat/completions``."""
    state = get_state(request)
    # read by hand, as the other routes: any Content-Type, the same 400s for bad bodies
    body = validate(ChatCompletionRequest, await read_json(request))
    state.check_model(body.model)
    state.check_fan_out(1, body.n, param="n")
    # 400s need no engine; an over-long constraint is refused before it is walked
    params = body.to_sampling_params(state.config.structured_output.max_constraint_chars)
    state.check_response_logprobs(params, [None], body.logprobs_params())
    llm = state.require_llm()
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    chat_kwargs = None if body.add_generation_prompt else {"add_generation_prompt": False}
    stream = llm.generate(None, params, messages=body.template_messages(), request_id=rid,
                          priority=body.priority, chat_kwargs=chat_kwargs,
                          output_kind="delta" if body.stream else "final")
    formatter = ChatFormatter(body, rid, body.model, state.token_texts(llm))
    return await respond(request, state, params.n, [stream], formatter, body.stream)

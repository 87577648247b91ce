"""``POST /v1/completions``: text completion of one prompt or a batch, with ``n``,
``echo``, ``logprobs`` and streaming in OpenAI's ``text_completion`` chunk format."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from lmkit.api.outputs import RequestOutput
from lmkit.serve.app import get_state
from lmkit.serve.handler import created_now, respond
from lmkit.serve.logprobs import (
    TokenTexts,
    completion_logprobs,
    logprobs_cost,
    merge_completion_logprobs,
    text_cost,
)
from lmkit.serve.protocol import CompletionRequest
from lmkit.serve.request_body import count_sequences, read_json, validate
from lmkit.serve.streaming import ChunkTemplate

router = APIRouter()


class CompletionFormatter:
    """OpenAI completions JSON for a batch of prompts, ``n`` choices each (choice index =
    prompt index * n + completion index)."""

    def __init__(self, body: CompletionRequest, request_id: str, model: str,
                 texts: TokenTexts) -> None:
        self.body = body
        self.id = request_id
        self.model = model
        self.created = created_now()
        self.texts = texts
        self.n = body.n
        opts = body.stream_options
        self.include_usage = bool(opts and opts.include_usage)
        self.continuous_usage = bool(opts and opts.continuous_usage_stats)
        self._echoed: set[int] = set()
        self._finished: set[int] = set()
        self._offsets: dict[int, int] = {}
        self._prompt_tokens: dict[int, int] = {}
        self._completion_tokens: dict[int, int] = {}
        self._template = ChunkTemplate({"id": request_id, "object": "text_completion",
                                        "created": self.created, "model": model},
                                       self.include_usage)

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return str(self.texts.tokenizer.decode(output.prompt_token_ids))

    def _prompt_logprobs(self, output: RequestOutput) -> dict[str, Any]:
        return completion_logprobs(self.texts, output.prompt_logprobs or [],
                                   output.prompt_token_ids, self.body.logprobs or 0)

    def _usage(self) -> dict[str, int]:
        prompt = sum(self._prompt_tokens.values())
        completion = sum(self._completion_tokens.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def _track(self, index: int, output: RequestOutput, delta: bool = False) -> None:
        """Usage from prompt ``index``'s output: a final one (whole completions) or, with
        ``delta``, a streamed one (only the tokens it adds: ``"delta"`` kind)."""
        self._prompt_tokens[index] = len(output.prompt_token_ids)
        completion = sum(len(c.delta_token_ids if delta else c.token_ids)
                         for c in output.outputs)
        if delta:
            completion += self._completion_tokens.get(index, 0)
        self._completion_tokens[index] = completion

    def chunks(self, index: int, output: RequestOutput) -> list[dict[str, Any]]:
        return [self._template.as_dict(c, u) for c, u in self._parts(index, output)]

    def events(self, index: int, output: RequestOutput, in_pieces: bool = False) -> bytes:
        return b"".join([self._template.event(c, u, in_pieces)
                         for c, u in self._parts(index, output)])

    def cost(self, index: int, output: RequestOutput, delta: bool) -> int:
        """About how much work the JSON for ``output`` is (see ``Formatter.cost``)."""
        num_top = self.body.logprobs
        echo = (text_cost(output.prompt) if output.prompt is not None
                else len(output.prompt_token_ids) // 16)  # ~4 characters a token
        if num_top is not None:
            echo += logprobs_cost(output.prompt_logprobs, num_top)
        total = 0
        for c in output.outputs:
            total += text_cost(c.delta_text if delta else c.text)
            if num_top is not None:
                total += logprobs_cost(c.delta_logprobs if delta else c.logprobs, num_top)
            if self.body.echo and not (delta and index * self.n + c.index in self._echoed):
                total += echo
        return total

    def _parts(self, index: int, output: RequestOutput
               ) -> Iterator[tuple[list[dict[str, Any]], dict[str, int] | None]]:
        """Each chunk's choices and usage for a new output of prompt ``index``, built as
        they are consumed (an echoed prompt can make each one large)."""
        self._track(index, output, delta=True)
        usage = self._usage() if self.include_usage and self.continuous_usage else None
        echo_lp: dict[str, Any] | None = None  # shared by this prompt's n choices
        for c in output.outputs:
            choice = index * self.n + c.index
            if choice in self._finished:
                continue
            text = c.delta_text
            logprobs = None
            if self.body.logprobs is not None:
                logprobs = completion_logprobs(
                    self.texts, c.delta_logprobs or [], c.delta_token_ids, self.body.logprobs,
                    self._offsets.get(choice, 0))
            if self.body.echo and choice not in self._echoed:
                self._echoed.add(choice)
                prompt = self._prompt_text(output)
                if logprobs is not None:
                    if echo_lp is None:
                        echo_lp = self._prompt_logprobs(output)
                    shift = len(prompt)
                    logprobs["text_offset"] = [o + shift for o in logprobs["text_offset"]]
                    logprobs = merge_completion_logprobs(echo_lp, logprobs)
                text = prompt + text
            if logprobs is not None and logprobs["text_offset"]:
                last = logprobs["tokens"][-1]
                self._offsets[choice] = logprobs["text_offset"][-1] + len(last)
            if not (text or c.delta_token_ids or c.finish_reason):
                continue
            if c.finish_reason is not None:
                self._finished.add(choice)
            yield ([{"index": choice, "text": text, "logprobs": logprobs,
                     "finish_reason": c.finish_reason}], usage)

    def final_chunks(self) -> list[dict[str, Any]]:
        if not self.include_usage:
            return []
        return [self._template.as_dict([], self._usage())]

    def response(self, outputs: list[RequestOutput], iterate_choices: bool = False
                 ) -> dict[str, Any]:
        """The response; with ``iterate_choices`` its ``choices`` is an iterator building
        each choice when it is consumed (see ``Formatter.response``)."""
        for index, output in enumerate(outputs):
            self._track(index, output)
        choices = self._response_choices(outputs)
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices if iterate_choices else list(choices),
                "usage": self._usage()}

    def _response_choices(self, outputs: list[RequestOutput]) -> Iterator[dict[str, Any]]:
        for index, output in enumerate(outputs):
            prompt = self._prompt_text(output) if self.body.echo else ""
            echo_lp = (self._prompt_logprobs(output)  # shared by this prompt's n choices
                       if self.body.echo and self.body.logprobs is not None else None)
            for c in output.outputs:
                logprobs = None
                if self.body.logprobs is not None:
                    logprobs = completion_logprobs(self.texts, c.logprobs or [], c.token_ids,
                                                   self.body.logprobs, len(prompt))
                    if echo_lp is not None:
                        logprobs = merge_completion_logprobs(echo_lp, logprobs)
                yield {"index": index * self.n + c.index, "text": prompt + c.text,
                       "logprobs": logprobs, "finish_reason": c.finish_reason}


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    """Complete the prompt(s); see OpenAI's ``POST /v1/completions``."""
    state = get_state(request)
    data = await read_json(request)
    state.check_fan_out(*count_sequences(data))  # before validating a huge batch
    body = validate(CompletionRequest, data)
    state.check_model(body.model)
    prompts = body.prompts()
    # again with the validated counts: "n": "64" or 64.0 count only once validated
    state.check_fan_out(len(prompts), max(body.n, body.best_of or 1))
    # 400s need no engine; an over-long constraint is refused before it is walked
    params = body.to_sampling_params(state.config.structured_output.max_constraint_chars)
    state.check_response_logprobs(params, prompts, body.logprobs_params())
    llm = state.require_llm()
    rid = f"cmpl-{uuid.uuid4().hex}"
    streams = [
        llm.generate(p, params, request_id=rid if len(prompts) == 1 else f"{rid}-{i}",
                     priority=body.priority, output_kind="delta" if body.stream else "final")
        for i, p in enumerate(prompts)
    ]
    formatter = CompletionFormatter(body, rid, body.model, state.token_texts(llm))
    return await respond(request, state, params.n * len(prompts), streams, formatter,
                         body.stream)

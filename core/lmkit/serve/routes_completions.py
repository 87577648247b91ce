"""``POST /v1/completions``: text completion of one prompt or a batch, with ``n``,
``echo``, ``logprobs`` and streaming in OpenAI's ``text_completion`` chunk format."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from lmkit.api.outputs import RequestOutput
from lmkit.serve.app import get_state
from lmkit.serve.handler import created_now, respond
from lmkit.serve.logprobs import TokenTexts, completion_logprobs, merge_completion_logprobs
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

    def _track(self, index: int, output: RequestOutput) -> None:
        self._prompt_tokens[index] = len(output.prompt_token_ids)
        self._completion_tokens[index] = sum(len(c.token_ids) for c in output.outputs)

    def chunks(self, index: int, output: RequestOutput) -> list[dict[str, Any]]:
        return [self._template.as_dict(c, u) for c, u in self._parts(index, output)]

    def events(self, index: int, output: RequestOutput) -> bytes:
        return b"".join([self._template.event(c, u) for c, u in self._parts(index, output)])

    def _parts(self, index: int, output: RequestOutput
               ) -> list[tuple[list[dict[str, Any]], dict[str, int] | None]]:
        """Each chunk's choices and usage for a new output of prompt ``index``."""
        self._track(index, output)
        usage = self._usage() if self.include_usage and self.continuous_usage else None
        chunks = []
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
            chunks.append(([{"index": choice, "text": text, "logprobs": logprobs,
                             "finish_reason": c.finish_reason}], usage))
        return chunks

    def final_chunks(self) -> list[dict[str, Any]]:
        if not self.include_usage:
            return []
        return [self._template.as_dict([], self._usage())]

    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for index, output in enumerate(outputs):
            self._track(index, output)
            prompt = self._prompt_text(output) if self.body.echo else ""
            for c in output.outputs:
                logprobs = None
                if self.body.logprobs is not None:
                    logprobs = completion_logprobs(self.texts, c.logprobs or [], c.token_ids,
                                                   self.body.logprobs, len(prompt))
                    if self.body.echo:
                        logprobs = merge_completion_logprobs(self._prompt_logprobs(output),
                                                             logprobs)
                choices.append({"index": index * self.n + c.index, "text": prompt + c.text,
                                "logprobs": logprobs, "finish_reason": c.finish_reason})
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices, "usage": self._usage()}


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
    llm = state.require_llm()
    rid = f"cmpl-{uuid.uuid4().hex}"
    streams = [
        llm.generate(p, params, request_id=rid if len(prompts) == 1 else f"{rid}-{i}",
                     priority=body.priority)
        for i, p in enumerate(prompts)
    ]
    formatter = CompletionFormatter(body, rid, body.model, state.token_texts(llm))
    return await respond(request, state, params.n * len(prompts), streams, formatter,
                         body.stream)

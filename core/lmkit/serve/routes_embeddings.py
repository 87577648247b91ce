"""``POST /v1/embeddings``: OpenAI's embeddings endpoint over pooling requests.

Every input becomes one pooling request; they run beside generation in the same
engine steps. Limits and errors are the other endpoints': the batch is counted before
it is validated (``server.max_sequences_per_request``), admission answers 429 past the
server's capacity, and a client that leaves aborts its requests (499).

Every input of a batch is tokenized and checked (vocabulary, context, or truncated to
``truncate_prompt_tokens``) before any is submitted, so a bad one is a 400 naming it
(``input[3]``) and costs no engine work. The inputs then go to the engine a window at a
time (:func:`pool_windowed`): a batch of thousands does not queue ahead of every
generation request that arrives while it runs.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from lmkit.api.outputs import PoolingOutput
from lmkit.api.pooling import PoolingParams
from lmkit.errors import InvalidRequestError
from lmkit.frontend.async_llm import TOKENIZE_INLINE_CHARS
from lmkit.frontend.llm_pooling import check_dimensions
from lmkit.serve.app import ServerState, get_state
from lmkit.serve.errors import CLIENT_CLOSED_REQUEST, APIError
from lmkit.serve.handler import created_now
from lmkit.serve.protocol_pooling import EmbeddingRequest, count_inputs
from lmkit.serve.request_body import read_json, validate
from lmkit.serve.streaming import ClientDisconnected, until_disconnect

router = APIRouter()
T = TypeVar("T")


def encode_embedding(values: list[Any], encoding_format: str) -> list[Any] | str:
    """One embedding as OpenAI sends it: floats, or base64 of little-endian float32.

    :raises InvalidRequestError: base64 of per-token vectors (``pooling_type: all``),
        whose shape the flat bytes would lose.
    """
    if encoding_format != "base64":
        return values
    array = np.asarray(values, dtype="<f4")
    if array.ndim != 1:
        raise per_token_base64()
    return base64.b64encode(array.tobytes()).decode("ascii")


def per_token_base64() -> InvalidRequestError:
    """The 400 for base64 of per-token vectors (their shape would be lost)."""
    return InvalidRequestError(
        "encoding_format 'base64' sends one vector per input, but this output has one "
        "vector per token (pooling_type 'all'); use encoding_format 'float' for per-token "
        "outputs", param="encoding_format", code="invalid_value")


def embedding_response(outputs: list[PoolingOutput], model: str,
                       encoding_format: str) -> dict[str, Any]:
    """OpenAI's embeddings ``list`` object, with token usage."""
    num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {
        "object": "list", "model": model, "created": created_now(),
        "data": [{"object": "embedding", "index": i,
                  "embedding": encode_embedding(o.data, encoding_format)}
                 for i, o in enumerate(outputs)],
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }


def json_response(content: dict[str, Any], outputs: list[PoolingOutput],
                  labels: Sequence[str]) -> JSONResponse:
    """``content`` as JSON; a 500 naming the input when the model's output holds NaN or
    infinity (no JSON number stands for them)."""
    try:
        return JSONResponse(content)
    except ValueError:
        bad = next((label for label, o in zip(labels, outputs, strict=False)
                    if not np.isfinite(np.asarray(o.data, dtype=np.float64)).all()), None)
        if bad is None:
            raise
        raise APIError(500, f"the model's output for {bad} holds NaN or infinite values, "
                       "which JSON cannot carry (a numerical overflow in the model; with "
                       "float16, the bfloat16 or float32 dtype usually avoids it)",
                       code="non_finite_output") from None


@router.post("/v1/embeddings")
async def create_embedding(request: Request) -> Response:
    """Embed the input(s); see OpenAI's ``POST /v1/embeddings``."""
    state = get_state(request)
    data = await read_json(request)
    state.check_fan_out(count_inputs(data), 1, param="input")  # before validating a batch
    body = validate(EmbeddingRequest, data)
    state.check_model(body.model)
    inputs, labels = body.inputs(), body.labels()
    params = body.to_pooling_params()  # 400s need no engine
    if body.encoding_format == "base64" and params.pooling_type == "all":
        raise per_token_base64()  # before any work
    outputs = await pool_all(request, state, inputs, params, body.priority, "embd",
                             labels=labels, truncate=body.truncation())
    if isinstance(outputs, Response):
        return outputs
    if outputs:
        check_dimensions(outputs[0].data, body.dimensions)  # every output has one size
    return json_response(embedding_response(outputs, body.model, body.encoding_format),
                         outputs, labels)


async def prompt_ids(state: ServerState, inputs: Sequence[str | list[int]],
                     labels: Sequence[str], truncate: int | None = None) -> list[list[int]]:
    """The token ids of every input, each checked: ids inside the vocabulary, and at
    most the model's context, or cut to ``truncate`` tokens (``-1``: the context) as the
    tokenizer truncates (its ``truncation_side``, special tokens kept).

    :raises InvalidRequestError: naming the input (its ``labels`` entry) and the limit.
    """
    processor = state.require_llm().input_processor
    max_len = processor.max_model_len
    if truncate is not None and truncate > max_len:
        raise InvalidRequestError(
            f"truncate_prompt_tokens is {truncate}, more than this model's context of "
            f"{max_len} tokens; use at most {max_len}, or -1 for the context",
            param="truncate_prompt_tokens", code="invalid_value")
    keep = max_len if truncate == -1 else truncate
    texts = [x for x in inputs if isinstance(x, str)]
    encoded = iter(await _tokenize(processor.tokenizer, texts, keep) if texts else [])
    left = getattr(processor.tokenizer, "truncation_side", "right") == "left"
    ids_of: list[list[int]] = []
    for item, label in zip(inputs, labels, strict=True):
        if isinstance(item, str):
            ids = next(encoded)
        else:
            processor.check_ids(label, item)
            ids = item
        if keep is not None and len(ids) > keep:
            ids = ids[-keep:] if left else ids[:keep]
        if len(ids) > max_len:
            raise InvalidRequestError(
                f"{label} has {len(ids)} tokens, but this model's context is {max_len} "
                "tokens; shorten it, or set truncate_prompt_tokens (-1 truncates every "
                "input to the context)", param=label, code="context_length_exceeded")
        ids_of.append(ids)
    return ids_of


async def _tokenize(tokenizer: Any, texts: list[str], keep: int | None) -> list[list[int]]:
    """Token ids of ``texts`` in one tokenizer call (in a thread when there is much
    text: the fast tokenizer releases the GIL, and the event loop keeps serving)."""
    def run() -> list[list[int]]:
        kwargs = {} if keep is None else {"truncation": True, "max_length": keep}
        return [list(ids) for ids in tokenizer(texts, **kwargs)["input_ids"]]

    if sum(len(t) for t in texts) < TOKENIZE_INLINE_CHARS:
        return run()
    return await asyncio.to_thread(run)


async def pool_windowed(run: Callable[[int], Awaitable[T]], count: int, window: int
                        ) -> list[T]:
    """``[await run(i) for i in range(count)]`` with at most ``window`` of them running at
    once, in order of ``i``. When one raises (or this is cancelled) the others are
    cancelled, and awaited, before the error goes on: none is left running."""
    results: list[Any] = [None] * count
    indices = iter(range(count))

    async def worker() -> None:
        for i in indices:  # shared: each worker takes the next index
            results[i] = await run(i)

    tasks = [asyncio.ensure_future(worker()) for _ in range(min(window, count))]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return results


async def pool_all(request: Request, state: ServerState, inputs: Sequence[str | list[int]],
                   params: PoolingParams, priority: int, prefix: str, *,
                   labels: Sequence[str] | None = None, truncate: int | None = None
                   ) -> list[PoolingOutput] | Response:
    """Run one pooling request per input under admission; the outputs in order, or the
    499 response when the client left (its requests are aborted).

    Every input is checked first (:func:`prompt_ids`; ``labels`` name them in errors,
    default ``input[i]``); then at most two engine steps' worth of sequences per engine
    (``2 x scheduler.max_num_seqs``) are in flight at once, so that the batch keeps the
    engine busy without queueing ahead of later requests.
    """
    llm = state.require_llm()
    names = labels if labels is not None else [f"input[{i}]" for i in range(len(inputs))]
    admission = state.admission.admit(len(inputs))
    rid = f"{prefix}-{uuid.uuid4().hex}"
    window = 2 * state.config.scheduler.max_num_seqs * max(llm.num_engines, 1)
    try:
        ids = await prompt_ids(state, inputs, names, truncate)

        def run(i: int) -> Awaitable[PoolingOutput]:
            return llm.embed(ids[i], params, request_id=f"{rid}-{i}", priority=priority)

        return await until_disconnect(request, pool_windowed(run, len(ids), window))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        admission.release()

"""``POST /v1/embeddings``: OpenAI's embeddings endpoint over pooling requests.

Every input becomes one pooling request; they run beside generation in the same
engine steps. Limits and errors are the other endpoints': the batch is counted before
it is validated (``server.max_sequences_per_request``), admission answers 429 past the
server's capacity, and a client that leaves aborts its requests (499).
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from lmkit.api.outputs import PoolingOutput
from lmkit.api.pooling import PoolingParams
from lmkit.serve.app import ServerState, get_state
from lmkit.serve.errors import CLIENT_CLOSED_REQUEST
from lmkit.serve.handler import created_now
from lmkit.serve.protocol_pooling import EmbeddingRequest, count_inputs
from lmkit.serve.request_body import read_json, validate
from lmkit.serve.streaming import ClientDisconnected, until_disconnect

router = APIRouter()


def encode_embedding(values: list[Any], encoding_format: str) -> list[Any] | str:
    """One embedding as OpenAI sends it: floats, or base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")
    return values


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


@router.post("/v1/embeddings")
async def create_embedding(request: Request) -> Response:
    """Embed the input(s); see OpenAI's ``POST /v1/embeddings``."""
    state = get_state(request)
    data = await read_json(request)
    state.check_fan_out(count_inputs(data), 1, param="input")  # before validating a batch
    body = validate(EmbeddingRequest, data)
    state.check_model(body.model)
    inputs = body.inputs()
    params = body.to_pooling_params()  # 400s need no engine
    outputs = await pool_all(request, state, inputs, params, body.priority, "embd")
    if isinstance(outputs, Response):
        return outputs
    return JSONResponse(embedding_response(outputs, body.model, body.encoding_format))


async def pool_all(request: Request, state: ServerState, inputs: Sequence[str | list[int]],
                   params: PoolingParams, priority: int, prefix: str
                   ) -> list[PoolingOutput] | Response:
    """Run one pooling request per input under admission; the outputs in order, or the
    499 response when the client left (its requests are aborted)."""
    llm = state.require_llm()
    admission = state.admission.admit(len(inputs))
    rid = f"{prefix}-{uuid.uuid4().hex}"
    try:
        calls = [llm.embed(text, params, request_id=f"{rid}-{i}", priority=priority)
                 for i, text in enumerate(inputs)]
        return list(await until_disconnect(request, asyncio.gather(*calls)))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    finally:
        admission.release()

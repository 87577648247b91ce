"""``POST /score`` and ``POST /rerank``: similarity of texts from their embeddings;
``POST /classify``: class scores from a classification head.

Both pool every distinct text once (one pooling request each, beside generation) and
score pairs with :func:`lmkit.frontend.scoring.score`: the cosine of the embeddings, or
late-interaction MaxSim over per-token vectors with ``pooling_type: all``. A sequence
classifier (cross-encoder) is refused with a 400: texts are pooled separately, never as a
pair (:func:`~lmkit.frontend.scoring.check_scorable`). ``/score``
follows vLLM's shape, ``/rerank`` Jina's and Cohere's (also at ``/v1/rerank`` and
``/v2/rerank``). Limits and errors are the other endpoints'.
"""

from __future__ import annotations

import functools
import uuid
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from lmkit.api.pooling import MULTI_LABEL, PoolingParams
from lmkit.frontend.scoring import check_scorable, pair_texts, score
from lmkit.serve.app import ServerState, get_state
from lmkit.serve.handler import created_now
from lmkit.serve.protocol_pooling import (
    ClassifyRequest,
    RerankRequest,
    ScoreRequest,
    count_inputs,
    count_texts,
)
from lmkit.serve.request_body import read_json, validate
from lmkit.serve.routes_embeddings import json_response, pool_all

router = APIRouter()


@router.post("/score")
@router.post("/v1/score")
async def create_score(request: Request) -> Response:
    """Score ``text_1`` against ``text_2`` (one against many, or pairwise)."""
    state = get_state(request)
    data = await read_json(request)
    state.check_fan_out(count_texts(data, "text_1", "text_2"), 1, param="text_2")
    body = validate(ScoreRequest, data)
    state.check_model(body.model)
    params = body.to_pooling_params()
    _check_scorable(state, params)
    pairs = pair_texts(body.text_1, body.text_2)
    unique = list(dict.fromkeys(t for pair in pairs for t in pair))
    where = body.labels()
    labels = [where[t] for t in unique]
    outputs = await pool_all(request, state, unique, params, body.priority,
                             "score", labels=labels, truncate=body.truncation())
    if isinstance(outputs, Response):
        return outputs
    by_text = {t: o for t, o in zip(unique, outputs, strict=True)}
    num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return json_response({
        "id": f"score-{uuid.uuid4().hex}", "object": "list", "created": created_now(),
        "model": body.model,
        "data": [{"index": i, "object": "score", "score": score(by_text[a].data, by_text[b].data)}
                 for i, (a, b) in enumerate(pairs)],
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }, outputs, labels)


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def create_rerank(request: Request) -> Response:
    """Rank ``documents`` by relevance to ``query``, best first; ``top_n`` keeps the best
    N (0 or absent: every document, as vLLM; more than there are: all of them)."""
    state = get_state(request)
    data = await read_json(request)
    state.check_fan_out(count_texts(data, "query", "documents"), 1, param="documents")
    body = validate(RerankRequest, data)
    state.check_model(body.model)
    params = body.to_pooling_params()
    _check_scorable(state, params)
    texts = [body.query, *body.documents]
    labels = body.labels()
    outputs = await pool_all(request, state, texts, params, body.priority,
                             "rerank", labels=labels, truncate=body.truncation())
    if isinstance(outputs, Response):
        return outputs
    query, docs = outputs[0], outputs[1:]
    results: list[dict[str, Any]] = [
        {"index": i, "relevance_score": score(query.data, d.data)} for i, d in enumerate(docs)]
    results.sort(key=lambda r: -r["relevance_score"])
    if body.top_n:  # None or 0: all
        results = results[:body.top_n]
    if body.return_documents:
        for r in results:
            r["document"] = {"text": body.documents[r["index"]]}
    num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return json_response({"id": f"rerank-{uuid.uuid4().hex}", "model": body.model,
                          "results": results, "usage": {"total_tokens": num_tokens}},
                         outputs, labels)


@router.post("/classify")
@router.post("/v1/classify")
async def create_classification(request: Request) -> Response:
    """Class scores of each input (a model with a classification head): ``probs`` (as
    :class:`~lmkit.api.pooling.ClassifierHead` says: probabilities, or a regression
    head's raw values), ``label`` (the highest-scoring label) and, for a multi-label
    model, ``labels`` (every label scoring above 0.5, in label order)."""
    state = get_state(request)
    data = await read_json(request)
    state.check_fan_out(count_inputs(data), 1, param="input")
    body = validate(ClassifyRequest, data)
    state.check_model(body.model)
    inputs, where = body.inputs(), body.labels()
    outputs = await pool_all(request, state, inputs, body.to_pooling_params(), body.priority,
                             "classify", labels=where, truncate=body.truncation())
    if isinstance(outputs, Response):
        return outputs
    labels, problem_type = _head_config(state.require_llm().ready.model_dir)
    num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    data_out = []
    for i, o in enumerate(outputs):
        names = [labels.get(k, f"LABEL_{k}") for k in range(len(o.data))]
        best = max(range(len(o.data)), key=o.data.__getitem__)
        item = {"index": i, "object": "classification", "label": names[best],
                "probs": o.data, "num_classes": len(o.data)}
        if problem_type == MULTI_LABEL:  # independent labels: each one that applies
            item["labels"] = [n for n, p in zip(names, o.data, strict=True) if p > 0.5]
        data_out.append(item)
    return json_response({"id": f"classify-{uuid.uuid4().hex}", "object": "list",
                          "created": created_now(), "model": body.model, "data": data_out,
                          "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}},
                         outputs, where)


def _check_scorable(state: ServerState, params: PoolingParams) -> None:
    """Refuse (400) a sequence classifier, whose default pooler is ``classify``, or a
    request for ``classify``: scores come from separately pooled texts."""
    ready = state.require_llm().ready
    # a stand-in for AsyncLLM may carry no default_pooler: it pools like a bi-encoder
    check_scorable(getattr(ready, "default_pooler", "last"), params.pooling_type)


@functools.cache
def _head_config(model_dir: str) -> tuple[dict[int, str], str | None]:
    """The model's ``id2label`` and ``problem_type`` (config.json), read once; the
    engine refused a ``problem_type`` transformers does not define when it loaded."""
    import json
    from pathlib import Path

    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text("utf-8"))
    except (OSError, ValueError):
        return {}, None
    if not isinstance(cfg, dict):
        return {}, None
    labels = {int(k): str(v) for k, v in (cfg.get("id2label") or {}).items()}
    problem_type = cfg.get("problem_type")
    return labels, problem_type if isinstance(problem_type, str) else None

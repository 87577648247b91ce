"""``/health``, ``/v1/models``, ``/metrics`` and ``/v1/lmkit/stack``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from lmkit.serve.app import get_state

router = APIRouter()
OFFLOAD_STUCK = ("the KV offload tier is stuck (a read ran past offload.options.read_timeout_s "
                 "and has not returned); requests are served without it; see the engine log")


@router.get("/health")
async def health(request: Request) -> Response:
    """200 when the engine (every engine, with ``--dp N``) is running; 503 while loading,
    after a failed start, while a dead engine restarts (with ``Retry-After``), dead, or
    while a KV offload tier is stuck (``offload_unhealthy`` stat). With ``--dp N`` one
    dead engine is enough for 503 (the error names it) although the others go on
    serving."""
    state = get_state(request)
    llm = state.llm
    if llm is None:
        status = "failed" if state.startup_error else "loading"
        return JSONResponse({"status": status, "error": state.startup_error}, status_code=503)
    supervisor = state.supervisor
    if supervisor is not None and supervisor.is_restarting:
        return JSONResponse({"status": "restarting", "error": llm.dead_reason},
                            status_code=503,
                            headers={"Retry-After": str(supervisor.retry_after_s())})
    if not llm.is_healthy:
        return JSONResponse({"status": "dead", "error": llm.dead_reason}, status_code=503)
    if any(s.get("offload_unhealthy", 0) > 0 for s in llm.engine_stats):  # runs on without it
        return JSONResponse({"status": "unhealthy", "error": OFFLOAD_STUCK}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    """The served model, in OpenAI's list shape."""
    state = get_state(request)
    llm = state.llm
    card: dict[str, Any] = {
        "id": state.served_model_name, "object": "model", "created": int(state.created),
        "owned_by": "lmkit", "root": state.config.model.model,
    }
    if llm is not None:
        card["max_model_len"] = llm.max_model_len
    return {"object": "list", "data": [card]}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus exposition of the server's and the engine's metrics."""
    body, content_type = get_state(request).metrics.render()
    return Response(body, media_type=content_type)


@router.get("/v1/lmkit/stack")
async def stack(request: Request) -> dict[str, Any]:
    """The resolved plugin stack (with versions), the loaded plugins, the model's and its
    tokenizer's directories, and engine facts (``stats``: the first engine's; ``engines``: each engine's pid, liveness, routed
    requests and stats)."""
    state = get_state(request)
    llm = state.require_llm()
    ready = llm.ready
    from lmkit.version import PLUGIN_API_VERSION, __version__

    return {
        "lmkit_version": __version__,
        "plugin_api_version": PLUGIN_API_VERSION,
        "model": state.served_model_name,
        "model_dir": ready.model_dir,
        "tokenizer_dir": state.config.model.tokenizer or ready.model_dir,
        "max_model_len": ready.max_model_len,
        **ready.stack,
        "plugins": ready.plugins,
        "engine_pid": llm.engine_pid,
        "stats": llm.stats,
        "engines": [{"index": slot.index, "pid": slot.client.pid, "alive": slot.is_alive(),
                     "routed_requests": llm.engines.router.num_routed[slot.index],
                     "stats": slot.stats} for slot in llm.engines.slots],
    }

"""The FastAPI application: state, middleware, routes, and the engine's lifecycle.

``lmkit serve`` starts the engine (warmed up) first and hands it to :func:`build_app`, so
the server binds its port only once it can serve. Without one, the engine process starts
in the background from the lifespan hook (tests do this), ``/health`` answers 503 until
it is ready, and the generation routes answer 503 meanwhile. Either way an
:class:`~lmkit.serve.supervisor.EngineSupervisor` restarts the engine if it dies
(503 with ``Retry-After`` meanwhile). Middleware, outermost first: CORS (only when
origins are configured), API key, body-size limit, and the catch-all
that answers an unexpected exception with a 500 (keeping the connection).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from fastapi import FastAPI, Request

from lmkit.api.sampling_params import SamplingParams
from lmkit.config.schema import LMKitConfig
from lmkit.engine.gc_heap import unfreeze_heap
from lmkit.frontend.async_llm import AsyncLLM
from lmkit.serve.errors import APIError, install_error_handlers, shorten
from lmkit.serve.limits import AdmissionController, LogprobsParams, check_response_logprobs
from lmkit.serve.logprobs import TokenTexts
from lmkit.serve.metrics import ServerMetrics
from lmkit.serve.supervisor import EngineSupervisor, start_engine

logger = logging.getLogger(__name__)


@dataclass
class ServerState:
    """What every route needs; one per app, at ``app.state.lmkit``."""

    config: LMKitConfig
    served_model_name: str
    metrics: ServerMetrics
    admission: AdmissionController
    llm: AsyncLLM | None = None
    supervisor: EngineSupervisor | None = None
    startup_error: str | None = None
    created: float = 0.0
    accepted_model_names: set[str] = field(default_factory=set)
    _token_texts: TokenTexts | None = None

    def require_llm(self) -> AsyncLLM:
        """The running engine, or a 503 saying why there is none."""
        if self.llm is None:
            if self.startup_error:
                raise APIError(503, self.startup_error, code="engine_dead")
            raise APIError(503, "the model is still loading; retry shortly (GET /health "
                           "turns 200 when ready)", code="model_loading",
                           headers={"Retry-After": "5"})
        supervisor = self.supervisor
        restarting = supervisor is not None and supervisor.is_restarting
        # with data parallelism requests go on to the engines alive while one restarts
        if self.llm.can_serve and (self.llm.num_engines > 1 or not restarting):
            return self.llm
        if supervisor is not None and restarting:
            wait = supervisor.retry_after_s()
            raise APIError(503, f"the engine died ({self.llm.dead_reason}) and is restarting; "
                           f"retry in {wait}s (GET /health turns 200 when it is back)",
                           code="engine_restarting", headers={"Retry-After": str(wait)})
        raise APIError(503, f"the engine is not running: {self.llm.dead_reason or 'shut down'}",
                       code="engine_dead")

    def engine_is_up(self) -> bool:
        """True while the engine runs and no restart is under way."""
        restarting = self.supervisor is not None and self.supervisor.is_restarting
        return self.llm is not None and self.llm.is_healthy and not restarting

    def check_model(self, name: str) -> None:
        """404 unless ``name`` is the model this server serves."""
        if name not in self.accepted_model_names:
            raise APIError(404, f"the model {shorten(repr(name))} does not exist on this "
                           f"server; it serves {self.served_model_name!r} (see GET /v1/models)",
                           param="model", code="model_not_found")

    @property
    def max_sequences_per_request(self) -> int:
        """``server.max_sequences_per_request``, capped by what admission takes at once."""
        return min(self.config.server.max_sequences_per_request, self.admission.capacity)

    def check_fan_out(self, num_prompts: int, n: int, param: str = "prompt") -> None:
        """400 at once when ``num_prompts`` x ``n`` sequences exceed the per-request limit
        (checked before any tokenization, so a huge batch costs nothing)."""
        limit = self.max_sequences_per_request
        total = num_prompts * max(n, 1)
        if total > limit:
            raise APIError(
                400, f"this request asks for {total} sequences ({num_prompts} prompt(s) x "
                f"n={n}); this server takes at most {limit} per request (server."
                "max_sequences_per_request, capped by scheduler.max_num_seqs + "
                "server.max_queued_requests); split it into smaller requests",
                param=param, code="too_many_sequences")

    def check_response_logprobs(self, params: SamplingParams,
                                prompts: Sequence[str | list[int] | None],
                                names: LogprobsParams) -> None:
        """400 at once when the response to ``params`` over ``prompts`` (``None``: chat
        messages) could carry more log-probabilities than ``server.max_response_logprobs``
        (checked before any tokenization; see :func:`check_response_logprobs`). It needs
        the context length: the engine's, or ``model.max_model_len`` before the engine is
        up (without either the request meets the 503 of a loading model anyway)."""
        if params.logprobs is None and params.prompt_logprobs is None:
            return  # never limited (and needs no context length)
        context_len = (self.llm.max_model_len if self.llm is not None
                       else self.config.model.max_model_len)
        if context_len is not None:
            check_response_logprobs(params, prompts, context_len,
                                    self.config.server.max_response_logprobs, names)

    def token_texts(self, llm: AsyncLLM) -> TokenTexts:
        """Per-token text of ``llm``'s tokenizer (cached across requests)."""
        if self._token_texts is None or self._token_texts.tokenizer is not llm.tokenizer:
            self._token_texts = TokenTexts(llm.tokenizer)
        return self._token_texts

    def engine_stats(self) -> list[dict[str, float]]:
        """Each engine's latest stats (none before the engine starts)."""
        return self.llm.engine_stats if self.llm is not None else []

    def routed_requests(self) -> list[int]:
        """Requests the router sent to each engine since start."""
        return list(self.llm.engines.router.num_routed) if self.llm is not None else []


def get_state(request: Request) -> ServerState:
    """The :class:`ServerState` of the app handling ``request``."""
    return request.app.state.lmkit  # type: ignore[no-any-return]


def build_app(config: LMKitConfig, *, llm: AsyncLLM | None = None,
              metrics: ServerMetrics | None = None,
              on_ready: Callable[[AsyncLLM], None] | None = None,
              on_startup_failure: Callable[[BaseException], None] | None = None,
              on_give_up: Callable[[BaseException], None] | None = None,
              engine_env: dict[str, str] | None = None,
              startup_timeout: float | None = None) -> FastAPI:
    """An app serving ``config``'s model with ``llm`` (started by the caller with
    ``metrics`` as its observer), or with an engine started in the background when the
    app's lifespan starts.

    ``on_ready`` runs once a background engine is up; ``on_startup_failure`` runs if it
    cannot start; ``on_give_up`` runs when a dead engine could not be restarted (the CLI
    stops the server there, with status 1).
    """
    from lmkit.serve.routes_admin import router as admin_router
    from lmkit.serve.routes_chat import router as chat_router
    from lmkit.serve.routes_completions import router as completions_router
    from lmkit.serve.routes_embeddings import router as embeddings_router
    from lmkit.serve.routes_scoring import router as scoring_router

    server = config.server
    served = server.served_model_name or config.model.model

    metrics = metrics or ServerMetrics()
    # what the engines can run at once plus a bounded queue
    capacity = (config.scheduler.max_num_seqs * config.parallel.data_parallel_size
                + server.max_queued_requests)
    state = ServerState(config=config, served_model_name=served, metrics=metrics,
                        admission=AdmissionController(capacity),
                        accepted_model_names={served, config.model.model})
    metrics.bind(state.engine_stats, state.engine_is_up, state.routed_requests)

    def serve(started: AsyncLLM) -> asyncio.Task[None]:
        import time

        state.llm = started
        state.created = time.time()
        state.supervisor = EngineSupervisor(
            started, config, startup_timeout=startup_timeout, on_give_up=on_give_up,
            on_restart=lambda _: metrics.engine_restarts.inc())
        return asyncio.create_task(state.supervisor.run(), name="lmkit-engine-supervisor")

    async def start_in_background() -> None:
        try:
            started = await start_engine(config, observer=metrics, env=engine_env,
                                         startup_timeout=startup_timeout)
        except BaseException as e:
            state.startup_error = str(e)
            logger.error("%s", e)
            if on_startup_failure is not None:
                on_startup_failure(e)
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        tasks.append(serve(started))
        if on_ready is not None:
            on_ready(started)

    tasks: list[asyncio.Task[None]] = []

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if llm is not None:
            tasks.append(serve(llm))
        else:
            tasks.append(asyncio.create_task(start_in_background(), name="lmkit-engine-start"))
        try:
            yield
        finally:
            for task in tasks:  # engine start, supervisor (a restart under way stops)
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if state.llm is not None:
                await state.llm.shutdown()
            unfreeze_heap()  # (frozen once the engine was up; a no-op otherwise)

    app = FastAPI(title="lmkit", version=_version(), lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.lmkit = state
    install_error_handlers(app)
    app.include_router(admin_router)
    app.include_router(completions_router)
    app.include_router(chat_router)
    app.include_router(embeddings_router)
    app.include_router(scoring_router)
    _add_middleware(app, config)
    return app


def _add_middleware(app: FastAPI, config: LMKitConfig) -> None:
    from lmkit.serve.auth import APIKeyMiddleware, load_api_key
    from lmkit.serve.errors import InternalErrorMiddleware
    from lmkit.serve.limits import BodySizeLimitMiddleware

    server = config.server
    # add_middleware wraps: the last added runs first; the innermost turns an uncaught
    # exception into a 500 without closing the connection
    app.add_middleware(InternalErrorMiddleware)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=server.max_request_body_bytes)
    api_key = load_api_key(server)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    if server.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(server.cors_origins),
                           allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["authorization", "content-type"])


def _version() -> str:
    from lmkit.version import __version__

    return __version__


"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Route code raises :class:`APIError` (or lets an :class:`InvalidRequestError` or
:class:`EngineDeadError` through); the handlers installed by :func:`install_error_handlers`
turn every failure into this shape with the right status, so clients of the official
``openai`` library get their usual exception types. Every error carries a ``code``.
:class:`InternalErrorMiddleware` answers anything else with a 500 without dropping the
keep-alive connection.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from lmkit.errors import EngineDeadError, InvalidRequestError

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error answered to the client as an OpenAI-shaped JSON body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500
                                       else "invalid_request_error")
        self.headers = headers
        # already in lmkit_requests_total (it reached the engine, which counted its end)
        self.counted = False

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI returns for an error."""
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        """This error as a response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    @classmethod
    def from_exception(cls, e: BaseException) -> APIError:
        """Map lmkit's exceptions onto statuses: bad input 400, dead engine 503, else 500."""
        if isinstance(e, APIError):
            return e
        if isinstance(e, InvalidRequestError):
            return cls(400, str(e), param=e.param, code=e.code or "invalid_value")
        if isinstance(e, EngineDeadError):
            return cls(503, f"the engine is not running: {e}", code="engine_dead",
                       headers={"Retry-After": "5"})
        return cls(500, f"internal error: {type(e).__name__}: {e}", code="internal_error")


def error_body(message: str, type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """``{"error": {...}}`` as OpenAI shapes it."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _is_union_tag(part: Any) -> bool:
    """True for the loc entries pydantic adds for a union's member ("str",
    "list[TextPart]", "constrained-str"): no field of the request is named so."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part)


def _validation_param(loc: tuple[Any, ...]) -> str | None:
    # loc is e.g. ("body", "messages", 0, "content"); OpenAI names "messages[0].content"
    parts = [p for i, p in enumerate(loc) if p != "body" and not (i and _is_union_tag(p))]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def _relevant(errors: list[Any]) -> list[Any]:
    """The errors worth reporting: where a union's members all failed, the "should be a
    valid string" of the members the value was not meant for is left out when another
    member says what is wrong inside the value (``content: [{"type": "text"}]`` is
    missing ``text``, not "not a string")."""
    def where(e: Any) -> str:
        return _validation_param(tuple(e.get("loc", ()))) or ""

    specific = [where(e) for e in errors if not str(e.get("type", "")).endswith("_type")]
    kept = [e for e in errors if not str(e.get("type", "")).endswith("_type")
            or not any(w == where(e) or w.startswith((where(e) + ".", where(e) + "["))
                       for w in specific)]
    return kept or errors


def validation_error(exc: RequestValidationError) -> APIError:
    """A pydantic validation failure of the request body as a 400 naming the field."""
    errors = _relevant(list(exc.errors()))
    first: dict[str, Any] = (errors[0] if errors
                             else {"loc": (), "msg": "invalid request", "type": ""})
    param = _validation_param(tuple(first.get("loc", ())))
    kind = str(first.get("type", ""))
    if kind == "json_invalid":
        return APIError(400, "the request body is not valid JSON: " + str(first.get("msg")),
                        code="invalid_json")
    if kind == "extra_forbidden":
        return APIError(400, f"unrecognized request argument supplied: {param}", param=param,
                        code="unknown_parameter")
    if kind == "missing" and param is None:  # the whole body
        return APIError(400, "the request body is empty; send a JSON object with the "
                        "request's parameters (Content-Type: application/json)",
                        code="missing_body")
    if kind == "missing":
        return APIError(400, f"missing required parameter: {param}", param=param,
                        code="missing_required_parameter")
    if kind == "invalid_unicode":
        where = str(first.get("ctx", {}).get("where") or param or "body")
        return APIError(400, str(first.get("msg")), param=where, code="invalid_unicode")
    msg = "; ".join(  # (pydantic's "Value error, " prefix says nothing to a client)
        f"{_validation_param(tuple(e.get('loc', ()))) or 'body'}: "
        f"{str(e.get('msg')).removeprefix('Value error, ')}"
        for e in errors[:5]
    )
    return APIError(400, msg, param=param, code="invalid_value")


def _answer(request: Request, error: APIError) -> JSONResponse:
    # requests that never reached the engine still count in lmkit_requests_total
    state = getattr(request.app.state, "lmkit", None)
    if state is not None and request.method == "POST" and not error.counted:
        outcome = ("refused" if error.status == 429 else "error" if error.status >= 500
                   else "invalid")
        state.metrics.count(outcome)
    return error.response()


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error raised in a route in the OpenAI shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _answer(request, exc)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return _answer(request, APIError.from_exception(exc))

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return _answer(request, APIError.from_exception(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _answer(request, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return http_error(request, exc).response()


def http_error(request: Request, exc: StarletteHTTPException) -> APIError:
    """A routing or body-parsing failure (404, 405, an unparsable body) with a code and a
    message that says what to do."""
    message = str(exc.detail)
    code = _HTTP_CODES.get(exc.status_code)
    if exc.status_code == 404:
        message = f"no route {request.method} {shorten(request.url.path)}; see /v1/models, " \
                  "/v1/completions, /v1/chat/completions"
    elif exc.status_code == 405:
        allowed = (getattr(exc, "headers", None) or {}).get("Allow", "")
        message = (f"method {request.method} is not allowed on {shorten(request.url.path)}"
                   + (f"; use {allowed}" if allowed else ""))
    elif exc.status_code == 400 and exc.__cause__ is not None:
        # FastAPI's "There was an error parsing the body" (e.g. an integer of more than
        # 4300 digits, or bytes that are not UTF-8): say what failed
        cause = exc.__cause__
        message = (f"the request body could not be parsed as JSON: {type(cause).__name__}: "
                   f"{cause}; send a JSON object encoded as UTF-8")
        code = "invalid_json"
    return APIError(exc.status_code, message, code=code, headers=getattr(exc, "headers", None))


_HTTP_CODES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed"}


def shorten(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters (a client's 60 KB path is not echoed back)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class InternalErrorMiddleware:
    """ASGI middleware that answers any exception a route lets escape with an
    OpenAI-shaped 500 and keeps the connection open.

    Starlette's handler for ``Exception`` sends its response and then re-raises, and
    the server closes the connection: the client's next request on the same keep-alive
    connection would be reset. Here the exception ends with this request. If the
    response had already started (a stream), it is ended cleanly instead. A client that
    leaves while sending its body is no server error: no traceback, no 500 counted.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = finished = False

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started, finished
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                finished = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except ClientDisconnect:  # left while sending the body: nobody to answer, no error
            logger.info("client left %s %s before sending the whole request body",
                        scope.get("method"), scope.get("path"))
            if not started:
                await Response(status_code=CLIENT_CLOSED_REQUEST)(scope, receive, send)
        except Exception as exc:
            logger.exception("unhandled error in %s %s", scope.get("method"),
                             scope.get("path"))
            if not started:
                request = Request(scope)
                await _answer(request, APIError.from_exception(exc))(scope, receive, send)
            elif not finished:
                await send({"type": "http.response.body", "body": b"", "more_body": False})

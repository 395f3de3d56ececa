"""The FastAPI app: routes, auth, error bodies, health/stats/metrics.

`create_app(state)` is pure wiring; the engine behind `state.engine` may be the real engine process
(`EngineClient`) or a test double with the same `generate/cancel/stats/info/alive` surface.
"""
from __future__ import annotations

import hmac
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from . import anthropic_routes, openai_routes
from .engine_client import EngineError
from .generation import ApiError, ServerState
from .protocol import anthropic_error_body, openai_error_body, validation_error_message

log = logging.getLogger("moestream.server")

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def create_app(state: ServerState, lifespan=None) -> FastAPI:
    app = FastAPI(title="moestream", version=__version__, docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    app.state.moestream = state
    _install_error_handlers(app)
    _add_info_routes(app, state)
    _add_generation_routes(app, state)
    return app


# ---- errors ------------------------------------------------------------------------------------
def _is_anthropic(request: Request) -> bool:
    return request.url.path.startswith("/v1/messages")


def error_response(request: Request, status: int, message: str, type: str | None = None, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    if _is_anthropic(request):
        body = anthropic_error_body(message, type if type and type.endswith("_error") and type != "server_error"
                                    else _ANTHROPIC_TYPES.get(status, "api_error"))
    else:
        default = "invalid_request_error" if status < 500 else "server_error"
        body = openai_error_body(message, param=param, code=code, type=type or default)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return error_response(request, e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(ValidationError)
    async def _validation(request: Request, e: ValidationError):
        message, param = validation_error_message(e)
        return error_response(request, 400, message, param=param)

    @app.exception_handler(EngineError)
    async def _engine(request: Request, e: EngineError):
        return error_response(request, e.status, e.message)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        msg = {404: f"no route {request.method} {request.url.path}",
               405: f"method {request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return error_response(request, e.status_code, msg, code="not_found" if e.status_code == 404 else None)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(request, 500, f"internal server error: {type(e).__name__}: {e}")


def _check_auth(state: ServerState, request: Request) -> None:
    if not state.api_key:
        return
    given = None
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        given = auth[7:].strip()
    if given is None and _is_anthropic(request):
        given = request.headers.get("x-api-key")
    if given is None or not hmac.compare_digest(given.encode(), state.api_key.encode()):
        what = "missing" if given is None else "incorrect"
        raise ApiError(401, f"{what} API key: send it as 'Authorization: Bearer <key>'"
                       + (" or 'x-api-key: <key>'" if _is_anthropic(request) else ""),
                       type="authentication_error" if _is_anthropic(request) else "invalid_request_error",
                       code="invalid_api_key")


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


# ---- routes --------------------------------------------------------------------------------------
def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    handlers = {"/v1/chat/completions": openai_routes.chat_completions, "/v1/completions": openai_routes.completions,
                "/v1/messages": anthropic_routes.messages, "/v1/messages/count_tokens": anthropic_routes.count_tokens}
    for path, handler in handlers.items():
        app.add_api_route(path, _generation_endpoint(state, handler), methods=["POST"])


def _generation_endpoint(state: ServerState, handler):
    async def endpoint(request: Request):
        _check_auth(state, request)
        if not state.engine.alive:
            raise ApiError(503, "the engine is not running", type="server_error")
        return await handler(state, request, await _json_body(request))

    return endpoint


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health():
        ok = bool(state.engine.alive)
        body = {"status": "ok" if ok else "error", "model": state.model_name, "version": __version__,
                "uptime_s": round(time.time() - state.started, 3)}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models(request: Request):
        _check_auth(state, request)
        card = {"id": state.model_name, "object": "model", "created": int(state.started), "owned_by": "moestream",
                "root": state.model_name, "max_model_len": state.max_seq_len, "context_length": state.max_seq_len}
        return {"object": "list", "data": [card]}

    @app.get("/v1/stats")
    async def stats(request: Request):
        _check_auth(state, request)
        engine = await state.engine.stats()
        if state.metrics is not None:
            state.metrics.update_engine(engine)
        requests = state.metrics.summary() if state.metrics is not None else {}
        requests.update(active=engine.get("running", 0), queued=engine.get("queued", 0))
        return {"model": state.model_name, "engine": dict(state.engine.info), "uptime_s": time.time() - state.started,
                "running": engine.get("running", 0), "queued": engine.get("queued", 0),
                "kv": engine.get("kv"), "state": engine.get("state"), "throughput": engine.get("throughput"),
                "requests": requests, "experts": engine.get("experts"),
                "experts_hit_rate": engine.get("experts_hit_rate"), "memory_plan": engine.get("memory_plan"),
                "engine_totals": engine.get("totals")}

    @app.get("/metrics")
    async def metrics():
        if state.metrics is None:
            return Response(b"", media_type="text/plain")
        if state.engine.alive:
            try:
                state.metrics.update_engine(await state.engine.stats())
            except EngineError:
                pass
        return Response(state.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

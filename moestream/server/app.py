"""The FastAPI app: routes, auth, error bodies, health/stats/metrics.

`create_app(state)` is pure wiring; the engine behind `state.engine` may be the real engine process
(`EngineClient`) or a test double with the same `generate/cancel/stats/info/alive` surface.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .. import __version__
from . import anthropic_routes, openai_routes, web
from .engine_client import EngineError
from .generation import ApiError, ServerState
from .protocol.anthropic_api import anthropic_error_body
from .protocol.common import validation_error_message
from .protocol.openai_api import openai_error_body

log = logging.getLogger("moestream.server")

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def create_app(state: ServerState, lifespan=None) -> FastAPI:
    app = FastAPI(title="moestream", version=__version__, docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=_with_snapshots(state, lifespan))
    app.state.moestream = state
    _install_error_handlers(app)
    _add_info_routes(app, state)
    _add_generation_routes(app, state)
    _add_admin_routes(app, state)
    web.add_routes(app)
    return app


def _with_snapshots(state: ServerState, inner):
    @contextlib.asynccontextmanager
    async def lifespan(app):
        async with inner(app) if inner is not None else contextlib.nullcontext():
            task = asyncio.create_task(refresh_snapshot(state))
            try:
                yield
            finally:
                task.cancel()

    return lifespan


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
    if status in (408, 413):  # the body was not (fully) read: the connection cannot carry another request
        headers = {"Connection": "close"}
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
        # no log here: Starlette re-raises after answering and uvicorn logs it with its traceback (once)
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


async def _json_body(state: ServerState, request: Request) -> dict:
    """The body as a JSON object, bounded in size, time and nesting; every failure is a 4xx."""
    raw = await _read_body(state, request)
    return await run_in_threadpool(_parse_json, raw, state.limits.max_json_depth)  # big bodies: off the loop


async def _read_body(state: ServerState, request: Request) -> bytes:
    limit = state.limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body has {int(declared)} bytes; this server accepts at most {limit} "
                       "(--max-body-bytes)", type="request_too_large")
    chunks, size = [], 0

    async def read() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:  # chunked bodies declare no length: count as they come
                raise ApiError(413, f"the request body is larger than {limit} bytes, the most this server "
                               "accepts (--max-body-bytes)", type="request_too_large")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), state.limits.body_timeout)
    except asyncio.TimeoutError:  # e.g. a body shorter than its Content-Length: do not hold the connection
        raise ApiError(408, f"the request body did not arrive within {state.limits.body_timeout:g} s "
                       "(--body-timeout)", type="timeout_error") from None
    except ClientDisconnect:  # the client's doing, not the server's: no 500 and no traceback in the log
        raise ApiError(400, "the client closed the connection before the whole body arrived") from None
    return b"".join(chunks)


def _parse_json(raw: bytes, max_depth: int) -> dict:
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise ApiError(400, f"the request JSON is nested too deeply (at most {max_depth} levels)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    _check_json(body, max_depth)
    return body


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _check_json(body, max_depth: int) -> None:
    """Nesting within `max_depth` and every string valid Unicode (JSON may carry lone surrogates such as
    "\\ud800", which no tokenizer or encoder takes), iteratively so no input can overflow the stack."""
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > max_depth:
            raise ApiError(400, f"the request JSON is nested too deeply (at most {max_depth} levels)")
        if isinstance(value, dict):
            stack.extend((k, depth) for k in value)
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(400, "the request JSON has a string that is not valid Unicode "
                               f"(a lone surrogate \\u{ord(value[_bad_index(value)]):04x})") from None


def _bad_index(text: str) -> int:
    return next(i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF)


def _check_messages(state: ServerState, body: dict) -> None:
    n = len(body["messages"]) if isinstance(body.get("messages"), list) else 0
    if n > state.limits.max_messages:
        raise ApiError(400, f"the request has {n} messages; this server accepts at most "
                       f"{state.limits.max_messages} (--max-messages)", param="messages")


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
        body = await _json_body(state, request)
        _check_messages(state, body)
        return await handler(state, request, body)

    return endpoint


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health():
        ok = bool(state.engine.alive)
        body = {"status": "ok" if ok else "error", "model": state.model_name, "version": __version__,
                "uptime_s": round(time.time() - state.started, 3), "api_key_required": bool(state.api_key)}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models(request: Request):
        _check_auth(state, request)
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        _check_auth(state, request)
        if model_id != state.model_name:
            raise ApiError(404, f"The model '{model_id}' does not exist; this server serves '{state.model_name}'.",
                           param="model", code="model_not_found")
        return _model_card(state)

    @app.get("/v1/stats")
    async def stats(request: Request):
        _check_auth(state, request)
        return stats_body(state)

    @app.get("/v1/stats/stream")
    async def stats_stream(request: Request):
        """The /v1/stats body as server-sent events, one each time the snapshot is refreshed (every
        0.5 s): what the web page's dashboard draws. Same numbers as /v1/stats, no other source."""
        _check_auth(state, request)
        return StreamingResponse(_stats_events(state, request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/metrics")
    async def metrics(request: Request):
        if not state.metrics_public:
            _check_auth(state, request)
        if state.metrics is None:
            return Response(b"", media_type="text/plain")
        return Response(state.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _add_admin_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/admin/cache")
    async def rebuild_cache(request: Request):
        """Resize the KV pool (tokens) and the expert slot cache while serving (`moestream ctl cache`):
        {"kv_tokens": N, "moe_slots": M | "auto"}, either may be left out (kept as it is)."""
        _check_auth(state, request)
        if not state.engine.alive:
            raise ApiError(503, "the engine is not running", type="server_error")
        kv, moe = _cache_sizes(await _json_body(state, request))
        try:
            report = await state.engine.rebuild_caches(kv, moe)
        except asyncio.TimeoutError:
            raise ApiError(504, "the engine did not answer in time; the rebuild may still complete (see /v1/stats)",
                           type="server_error") from None
        await _refresh_now(state)  # /v1/stats shows the new sizes as soon as this answer is out
        return {"object": "cache_rebuild", **report}


def _cache_sizes(body: dict) -> tuple[int | None, int | str | None]:
    """(kv_tokens, moe_slots) of an /v1/admin/cache body; every mistake a 400 naming its field."""
    unknown = sorted(set(body) - {"kv_tokens", "moe_slots"})
    if unknown:
        raise ApiError(400, f"unknown field {unknown[0]!r}: this route takes kv_tokens and moe_slots", param=unknown[0])
    kv, moe = body.get("kv_tokens"), body.get("moe_slots")
    if kv is None and moe is None:
        raise ApiError(400, "give kv_tokens (KV pool tokens) and/or moe_slots (expert slots, or \"auto\")")
    if kv is not None and (not isinstance(kv, int) or isinstance(kv, bool) or kv < 1):
        raise ApiError(400, f"kv_tokens must be a positive integer, got {kv!r}", param="kv_tokens")
    if moe is not None and moe != "auto" and (not isinstance(moe, int) or isinstance(moe, bool) or moe < 1):
        raise ApiError(400, f"moe_slots must be a positive integer or \"auto\", got {moe!r}", param="moe_slots")
    return kv, moe


def stats_body(state: ServerState) -> dict:
    engine = state.snapshot  # never wait on the engine: a long prefill would stall scrapers
    requests = state.metrics.summary() if state.metrics is not None else {}
    requests.update(active=engine.get("running", 0), queued=engine.get("queued", 0))
    return {"model": state.model_name, "engine": dict(state.engine.info), "uptime_s": time.time() - state.started,
            "engine_alive": bool(state.engine.alive), "snapshot_age_s": _snapshot_age(state),
            "snapshot_at": engine.get("_at"), "max_seq_len": state.max_seq_len,
            "running": engine.get("running", 0), "queued": engine.get("queued", 0),
            "kv": engine.get("kv"), "state": engine.get("state"), "throughput": engine.get("throughput"),
            "requests": requests, "experts": engine.get("experts"),
            "experts_hit_rate": engine.get("experts_hit_rate"), "memory_plan": engine.get("memory_plan"),
            "prefix_cache": engine.get("prefix_cache"), "speculative": engine.get("speculative"),
            "overlapped_steps": engine.get("overlapped_steps", 0),
            "engine_totals": engine.get("totals"), "host_memory": engine.get("host_memory"),
            "cache_rebuilds": engine.get("cache_rebuilds"), "cuda_graphs": engine.get("cuda_graphs")}


async def _stats_events(state: ServerState, request: Request, poll: float = 0.1, heartbeat: float = 15.0):
    last, quiet = object(), 0.0
    while True:
        at = state.snapshot.get("_at")
        if at != last:
            last, quiet = at, 0.0
            body = await run_in_threadpool(json.dumps, stats_body(state))  # big expert maps: off the loop
            yield f"data: {body}\n\n"
        elif quiet >= heartbeat:  # a comment line keeps proxies from closing an idle stream
            quiet = 0.0
            yield ": keep-alive\n\n"
        if await request.is_disconnected():
            return
        await asyncio.sleep(poll)
        quiet += poll


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": int(state.started), "owned_by": "moestream",
            "root": state.model_name, "max_model_len": state.max_seq_len, "context_length": state.max_seq_len}


def _snapshot_age(state: ServerState) -> float | None:
    at = state.snapshot.get("_at")
    return None if at is None else round(time.time() - at, 3)


async def refresh_snapshot(state: ServerState, interval: float = 0.5) -> None:
    """Keep `state.snapshot` (and the Prometheus gauges) fresh; runs for the life of the server."""
    check_alive = getattr(state.engine, "check_alive", None)
    while True:
        if check_alive is not None:
            check_alive()
        if state.engine.alive:
            await _refresh_now(state)
        await asyncio.sleep(interval)


async def _refresh_now(state: ServerState, timeout: float = 30.0) -> None:
    """Ask the engine for its numbers now and make them the snapshot (kept as it was if the engine is busy
    past the timeout or gone)."""
    try:
        asked = time.time()  # the engine's numbers are from after this moment
        data = dict(await asyncio.wait_for(state.engine.stats(), timeout))
    except (EngineError, asyncio.TimeoutError):
        return
    data["_at"] = asked
    if (state.snapshot.get("_at") or 0) <= asked:  # a slower, older answer never replaces a newer one
        state.snapshot = data
        if state.metrics is not None:
            state.metrics.update_engine(data)

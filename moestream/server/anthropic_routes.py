"""Anthropic routes: /v1/messages (plain and streaming) and /v1/messages/count_tokens.

Any `model` name is accepted: Claude Code and other Anthropic clients send their own model ids, and
this server has exactly one model to answer with.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from .protocol import anthropic_api as P
from .engine_client import EngineError
from .generation import ApiError, GenSpec, ServerState, chat_spec, collect, encode, render_chat, run

PING_SECONDS = 15.0  # keep-alive for clients and proxies that drop idle streams (long prefill, queue)


def _prompt(state: ServerState, req) -> str:
    return render_chat(state, req.to_openai_messages(), req.tools_openai(), req.template_kwargs())


def _prepare(state: ServerState, body: dict) -> tuple[P.AnthropicMessagesRequest, GenSpec]:
    req = P.AnthropicMessagesRequest.model_validate(body, strict=True)
    # max_tokens is required here and clients such as Claude Code send one fixed value for every
    # model: it is cut to the context left instead of refused
    th = req.thinking
    budget = th.budget_tokens if th is not None and th.type == "enabled" else None
    spec = chat_spec(state, _prompt(state, req), lambda room: req.to_sampling_params(), req.tools_openai(),
                     req.tool_choice_openai(), clamp=True,
                     max_thinking_tokens=budget if budget is not None and _has_think(state) else None)
    return req, spec


def _has_think(state: ServerState) -> bool:
    # Anthropic clients send thinking budgets to any model; a model without a reasoning block ignores it
    return state.tokenizer is not None and state.tokenizer.token_to_id("</think>") is not None


async def messages(state: ServerState, request, body: dict) -> Any:
    # validation, template and tokenizer are CPU work that grows with the body: off the event loop
    req, spec = await run_in_threadpool(_prepare, state, body)
    mid = P.new_message_id()
    if req.stream:
        return StreamingResponse(_stream(state, spec, request, mid), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        got = await collect(run(state, spec, request, mid))
    except EngineError as e:
        raise ApiError(e.status, e.message, type="api_error" if e.status >= 500 else "invalid_request_error")
    return JSONResponse(P.anthropic_message_response(
        mid, state.model_name, text=got.content, thinking=got.reasoning, tool_calls=got.tool_calls,
        finish_reason=got.finish_reason, stop_sequence=got.stop, input_tokens=len(spec.prompt_ids),
        output_tokens=got.completion_tokens, cache_read_input_tokens=got.cached_tokens))


async def count_tokens(state: ServerState, request, body: dict) -> Any:
    return JSONResponse({"input_tokens": await run_in_threadpool(_count, state, body)})


def _count(state: ServerState, body: dict) -> int:
    req = P.CountTokensRequest.model_validate(body, strict=True)
    return len(encode(state, _prompt(state, req), bound=False))  # a count, whatever its length


async def _stream(state: ServerState, spec: GenSpec, request, mid: str) -> AsyncIterator[str]:
    enc = P.AnthropicStreamEncoder(mid, state.model_name, len(spec.prompt_ids))
    yield enc.start()
    events = run(state, spec, request, mid).__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            # A task that outlives the ping timeout: timing out must not cancel the generation.
            pending = pending or asyncio.ensure_future(_next(events))
            done, _ = await asyncio.wait({pending}, timeout=PING_SECONDS)
            if not done:
                yield enc.ping()
                continue
            ev, pending = pending.result(), None
            if ev is None:
                break
            if ev.kind == "reasoning":
                yield enc.reasoning(ev.text)
            elif ev.kind == "content":
                yield enc.text(ev.text)
            elif ev.kind == "tool_call":
                yield enc.tool_call(ev.call)
            else:
                yield enc.finish(ev.finish_reason, ev.completion_tokens, stop_sequence=ev.stop,
                                 cache_read_input_tokens=ev.cached_tokens)
    except EngineError as e:
        yield enc.error(e.message, "overloaded_error" if e.status == 503 else "api_error" if e.status >= 500
                        else "invalid_request_error")
    finally:
        if pending is not None:  # client gone mid-wait: stop the generation (this aborts it)
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        await events.aclose()


async def _next(events):
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None

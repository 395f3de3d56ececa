"""OpenAI routes: /v1/chat/completions and /v1/completions, streaming (SSE) and not."""
from __future__ import annotations

import time
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from . import protocol as P
from .engine_client import EngineError
from .generation import (ApiError, GenSpec, ServerState, chat_spec, collect, encode, new_request_id, plain_spec,
                         run)


def check_model(state: ServerState, model: str) -> None:
    if model and model != state.model_name:
        raise ApiError(404, f"The model '{model}' does not exist; this server serves '{state.model_name}'.",
                       type="invalid_request_error", param="model", code="model_not_found")


async def chat_completions(state: ServerState, request, body: dict) -> Any:
    # validation, template and tokenizer are CPU work that grows with the body: off the event loop
    req, spec = await run_in_threadpool(_chat_prepare, state, body)
    rid = new_request_id("chatcmpl")
    if req.stream:
        return _sse(_chat_stream(state, spec, request, rid, req.include_usage))
    got = await _collect(state, spec, request, rid)
    return JSONResponse(P.chat_completion_response(
        rid, state.model_name, got.content or None, reasoning_content=got.reasoning, tool_calls=got.tool_calls,
        finish_reason=got.finish_reason, prompt_tokens=len(spec.prompt_ids), completion_tokens=got.completion_tokens,
        cached_tokens=got.cached_tokens))


def _chat_prepare(state: ServerState, body: dict) -> tuple[P.ChatCompletionRequest, GenSpec]:
    req = P.ChatCompletionRequest.model_validate(body)
    check_model(state, req.model)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    prompt = _render(state, req)
    spec = chat_spec(state, prompt, lambda room: req.to_sampling_params(room), tools, req.tool_choice,
                     req.skip_special_tokens)
    return req, spec


def _render(state: ServerState, req: P.ChatCompletionRequest) -> str:
    from .generation import render_chat

    return render_chat(state, req.template_messages(), req.template_tools(), req.template_kwargs(),
                       req.add_generation_prompt, req.continue_final_message)


async def _collect(state: ServerState, spec: GenSpec, request, rid: str):
    try:
        return await collect(run(state, spec, request, rid), lambda: spec.reasoning.saw_reasoning)
    except EngineError as e:
        raise ApiError(e.status, e.message, type="server_error" if e.status >= 500 else "invalid_request_error")


async def _chat_stream(state: ServerState, spec: GenSpec, request, rid: str, include_usage: bool
                       ) -> AsyncIterator[str]:
    created = int(time.time())
    model = state.model_name
    yield P.sse_data(P.chat_completion_chunk(rid, model, created=created, role="assistant", content=""))
    n_calls = 0
    try:
        async for ev in run(state, spec, request, rid):
            if ev.kind == "reasoning":
                yield P.sse_data(P.chat_completion_chunk(rid, model, created=created, reasoning_content=ev.text))
            elif ev.kind == "content":
                yield P.sse_data(P.chat_completion_chunk(rid, model, created=created, content=ev.text))
            elif ev.kind == "tool_call":
                yield P.sse_data(P.chat_completion_chunk(rid, model, created=created, tool_calls=[ev.call],
                                                         tool_call_start_index=n_calls))
                n_calls += 1
            else:
                reason = P.openai_finish_reason(ev.finish_reason, n_calls > 0)
                yield P.sse_data(P.chat_completion_chunk(rid, model, created=created, finish_reason=reason))
                if include_usage:
                    usage = P.usage_dict(len(spec.prompt_ids), ev.completion_tokens, ev.cached_tokens)
                    yield P.sse_data(P.chat_completion_chunk(rid, model, created=created, usage=usage,
                                                             include_choice=False))
    except EngineError as e:
        yield P.sse_data(P.openai_error_body(e.message, type="server_error"))
    yield P.SSE_DONE


async def completions(state: ServerState, request, body: dict) -> Any:
    req, spec = await run_in_threadpool(_completion_prepare, state, body)
    ids = spec.prompt_ids
    rid = new_request_id("cmpl")
    if req.stream:
        return _sse(_completion_stream(state, spec, request, rid, req.include_usage))
    got = await _collect(state, spec, request, rid)
    return JSONResponse(P.completion_response(rid, state.model_name, got.content, finish_reason=got.finish_reason,
                                              prompt_tokens=len(ids), completion_tokens=got.completion_tokens,
                                              cached_tokens=got.cached_tokens))


async def _completion_stream(state: ServerState, spec: GenSpec, request, rid: str, include_usage: bool
                             ) -> AsyncIterator[str]:
    created = int(time.time())
    model = state.model_name
    try:
        async for ev in run(state, spec, request, rid):
            if ev.kind == "content" and ev.text:
                yield P.sse_data(P.completion_chunk(rid, model, created=created, text=ev.text))
            elif ev.kind == "done":
                reason = P.openai_finish_reason(ev.finish_reason)
                yield P.sse_data(P.completion_chunk(rid, model, created=created, finish_reason=reason))
                if include_usage:
                    usage = P.usage_dict(len(spec.prompt_ids), ev.completion_tokens, ev.cached_tokens)
                    yield P.sse_data(P.completion_chunk(rid, model, created=created, usage=usage,
                                                        include_choice=False))
    except EngineError as e:
        yield P.sse_data(P.openai_error_body(e.message, type="server_error"))
    yield P.SSE_DONE


def _completion_prepare(state: ServerState, body: dict) -> tuple[P.CompletionRequest, GenSpec]:
    req = P.CompletionRequest.model_validate(body)
    check_model(state, req.model)
    ids = req.prompt_token_ids
    if ids is None:
        if state.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
        ids = encode(state, req.prompt_text)
    return req, plain_spec(state, ids, lambda room: req.to_sampling_params(room))


def _sse(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

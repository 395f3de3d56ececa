"""OpenAI routes: /v1/chat/completions and /v1/completions, streaming (SSE) and not."""
from __future__ import annotations

import asyncio
import copy
import time
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from ..core import SEED_MAX, RequestError
from .protocol import openai_api as P
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
    specs = fork(spec, req.n or 1)
    if req.stream:
        return _sse(_chat_stream(state, specs, request, rid, req.include_usage))
    gots = await _collect_all(state, specs, request, rid)
    out = None
    for i, got in enumerate(gots):
        lp = P.chat_logprobs(state.tokenizer, got.logprobs) if spec.params.logprobs is not None else None
        one = P.chat_completion_response(
            rid, state.model_name, got.content or None, reasoning_content=got.reasoning, tool_calls=got.tool_calls,
            finish_reason=got.finish_reason, prompt_tokens=len(spec.prompt_ids),
            completion_tokens=got.completion_tokens, index=i, logprobs=lp, cached_tokens=got.cached_tokens)
        if out is None:
            out = one
        else:
            out["choices"] += one["choices"]
            out["usage"] = P.usage_dict(len(spec.prompt_ids), out["usage"]["completion_tokens"] + got.completion_tokens,
                                        out["usage"]["prompt_tokens_details"]["cached_tokens"])
    return JSONResponse(out)


def fork(spec: GenSpec, n: int) -> list[GenSpec]:
    """n choices of one request: fresh parsers each, and with a seed, choice i samples with seed + i (so
    n=4 with seed s answers as the four single requests with seeds s..s+3 do). Choices 1..n-1 name choice 0
    as their parent: the engine copies its prefill instead of computing the prompt n times."""
    if n == 1:
        return [spec]
    out = []
    for i in range(n):
        s = copy.deepcopy(spec)
        if s.params.seed is not None:
            s.params.seed = (s.params.seed + i) % (SEED_MAX + 1)
        out.append(s)
    return out


def engine_ids(rid: str, specs: list[GenSpec]) -> list[str]:
    """Engine request ids of the choices; sets each fork's parent to choice 0."""
    if len(specs) == 1:
        return [rid]
    rids = [f"{rid}-{i}" for i in range(len(specs))]
    for s in specs[1:]:
        s.parent = rids[0]
    return rids


async def _collect_all(state: ServerState, specs: list[GenSpec], request, rid: str):
    rids = engine_ids(rid, specs)
    tasks = [asyncio.ensure_future(_collect(state, s, request, r)) for s, r in zip(specs, rids)]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:  # one failed (or the client left): stop the others
            t.cancel()


async def _merge(gens: list[AsyncIterator[str]]) -> AsyncIterator[str]:
    """The items of several async generators as they come (n > 1 streams)."""
    if len(gens) == 1:
        async for item in gens[0]:
            yield item
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(g):
        try:
            async for item in g:
                await q.put(item)
        finally:
            await q.put(done)

    tasks = [asyncio.ensure_future(pump(g)) for g in gens]
    try:
        left = len(tasks)
        while left:
            item = await q.get()
            if item is done:
                left -= 1
            else:
                yield item
        for t in tasks:
            t.result()  # an exception in a choice reaches the caller
    finally:
        for t in tasks:
            t.cancel()


def _chat_prepare(state: ServerState, body: dict) -> tuple[P.ChatCompletionRequest, GenSpec]:
    req = P.ChatCompletionRequest.model_validate(body, strict=True)
    check_model(state, req.model)
    try:
        grammar = req.grammar_request()
    except RequestError as e:
        raise ApiError(400, str(e), param="response_format") from None
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    prompt = _render(state, req)
    spec = chat_spec(state, prompt, lambda room: req.to_sampling_params(room), tools, req.tool_choice,
                     req.skip_special_tokens, grammar=grammar, max_thinking_tokens=req.max_thinking_tokens)
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


async def _chat_stream(state: ServerState, specs: list[GenSpec], request, rid: str, include_usage: bool
                       ) -> AsyncIterator[str]:
    choice = lambda s, r, i, created, tokens, cached: _chat_choice(  # noqa: E731
        state, s, request, r, rid, i, created, tokens, cached)
    async for item in _choices_stream(state, specs, rid, include_usage, choice, P.chat_completion_chunk):
        yield item


async def _choices_stream(state: ServerState, specs: list[GenSpec], rid: str, include_usage: bool, choice,
                          usage_chunk) -> AsyncIterator[str]:
    """The n choices' SSE events merged as they come (choice(spec, engine id, index, created, tokens, cached) gives
    one choice's events and counts its tokens), then the usage chunk (usage_chunk: the API's chunk builder) and
    [DONE]; an engine failure becomes an error event."""
    created = int(time.time())
    tokens = [0] * len(specs)
    cached = [0] * len(specs)  # prompt tokens each choice took from the prefix cache (the usage reports choice 0's)
    rids = engine_ids(rid, specs)
    try:
        async for item in _merge([choice(s, r, i, created, tokens, cached) for i, (s, r) in enumerate(zip(specs, rids))]):
            yield item
        if include_usage:
            usage = P.usage_dict(len(specs[0].prompt_ids), sum(tokens), cached[0])
            yield P.sse_data(usage_chunk(rid, state.model_name, created=created, usage=usage, include_choice=False))
    except EngineError as e:
        kind = "server_error" if e.status >= 500 else "invalid_request_error"  # 400: the request's own fault
        yield P.sse_data(P.openai_error_body(e.message, type=kind))
    yield P.SSE_DONE


async def _chat_choice(state: ServerState, spec: GenSpec, request, engine_rid: str, rid: str, index: int,
                       created: int, tokens: list[int], cached: list[int]) -> AsyncIterator[str]:
    model = state.model_name
    want_lp = spec.params.logprobs is not None

    def lp(ev):
        return P.chat_logprobs(state.tokenizer, ev.logprobs) if want_lp and ev.logprobs else None

    yield P.sse_data(P.chat_completion_chunk(rid, model, created=created, role="assistant", content="", index=index))
    n_calls = 0
    async for ev in run(state, spec, request, engine_rid):
        if ev.kind == "reasoning":
            yield P.sse_data(P.chat_completion_chunk(rid, model, created=created, reasoning_content=ev.text,
                                                     index=index))
        elif ev.kind == "content":
            yield P.sse_data(P.chat_completion_chunk(rid, model, created=created, content=ev.text, index=index,
                                                     logprobs=lp(ev)))
        elif ev.kind == "tool_call":
            yield P.sse_data(P.chat_completion_chunk(rid, model, created=created, tool_calls=[ev.call],
                                                     tool_call_start_index=n_calls, index=index, logprobs=lp(ev)))
            n_calls += 1
        else:
            tokens[index] = ev.completion_tokens
            cached[index] = ev.cached_tokens
            reason = P.openai_finish_reason(ev.finish_reason, n_calls > 0)
            yield P.sse_data(P.chat_completion_chunk(rid, model, created=created, finish_reason=reason, index=index,
                                                     logprobs=lp(ev)))


async def completions(state: ServerState, request, body: dict) -> Any:
    req, spec = await run_in_threadpool(_completion_prepare, state, body)
    ids = spec.prompt_ids
    rid = new_request_id("cmpl")
    specs = fork(spec, req.candidates)
    echo = _echo_text(state, req, ids) if req.echo else None
    if req.stream:
        return _sse(_completion_stream(state, specs, request, rid, req.include_usage, echo))
    gots = await _collect_all(state, specs, request, rid)
    out = None
    for i, got in enumerate(best(gots, req.n or 1)):
        text = (echo or "") + got.content
        lp = None
        if req.logprobs is not None:
            entries = _prompt_entries(ids, got.prompt_logprobs) if req.echo else []
            lp = P.completion_logprobs(state.tokenizer, entries + got.logprobs)
        one = P.completion_response(rid, state.model_name, text, finish_reason=got.finish_reason,
                                    prompt_tokens=len(ids), completion_tokens=got.completion_tokens, index=i,
                                    logprobs=lp, cached_tokens=got.cached_tokens)
        if out is None:
            out = one
        else:
            out["choices"] += one["choices"]
    # every candidate was generated, so usage counts them all (as OpenAI bills best_of)
    out["usage"] = P.usage_dict(len(ids), sum(g.completion_tokens for g in gots),
                                out["usage"]["prompt_tokens_details"]["cached_tokens"])
    return JSONResponse(out)


def best(gots: list, n: int) -> list:
    """best_of: the n candidates with the highest cumulative logprob of their generated tokens, best first
    (the earlier candidate on a tie); all of them, in order, when there are only n."""
    if len(gots) == n:
        return gots
    return sorted(gots, key=lambda g: -sum(e[1] for e in g.logprobs or []))[:n]


def _echo_text(state: ServerState, req: P.CompletionRequest, ids: list[int]) -> str:
    if req.prompt_text is not None:
        return req.prompt_text
    return state.tokenizer.decode(ids, skip_special_tokens=False) if state.tokenizer is not None else ""


def _prompt_entries(ids: list[int], plps: list | None) -> list:
    """Echoed prompt tokens as logprob entries (the first token has none)."""
    plps = plps or []
    out = []
    for k, tid in enumerate(ids):
        e = plps[k] if k < len(plps) else None
        out.append([tid, None, []] if e is None else [tid, e[0], e[1]])
    return out


async def _completion_stream(state: ServerState, specs: list[GenSpec], request, rid: str, include_usage: bool,
                             echo: str | None) -> AsyncIterator[str]:
    choice = lambda s, r, i, created, tokens, cached: _completion_choice(  # noqa: E731
        state, s, request, r, rid, i, created, tokens, echo, cached)
    async for item in _choices_stream(state, specs, rid, include_usage, choice, P.completion_chunk):
        yield item


async def _completion_choice(state: ServerState, spec: GenSpec, request, engine_rid: str, rid: str, index: int,
                             created: int, tokens: list[int], echo: str | None, cached: list[int]) -> AsyncIterator[str]:
    model = state.model_name
    want_lp = spec.params.logprobs is not None
    offset = 0
    echoed = echo is None

    def lp(entries):
        nonlocal offset
        if not want_lp or not entries:
            return None
        out = P.completion_logprobs(state.tokenizer, entries, offset)
        offset += sum(len(t) for t in out["tokens"])
        return out

    async for ev in run(state, spec, request, engine_rid):
        if not echoed:  # the prompt first (with its logprobs, which come with the first token)
            echoed = True
            entries = _prompt_entries(spec.prompt_ids, ev.prompt_logprobs) if want_lp else []
            yield P.sse_data(P.completion_chunk(rid, model, created=created, text=echo, index=index,
                                                logprobs=lp(entries)))
        if ev.kind == "content" and ev.text:
            yield P.sse_data(P.completion_chunk(rid, model, created=created, text=ev.text, index=index,
                                                logprobs=lp(ev.logprobs)))
        elif ev.kind == "done":
            tokens[index] = ev.completion_tokens
            cached[index] = ev.cached_tokens
            reason = P.openai_finish_reason(ev.finish_reason)
            yield P.sse_data(P.completion_chunk(rid, model, created=created, finish_reason=reason, index=index,
                                                logprobs=lp(ev.logprobs)))


def _completion_prepare(state: ServerState, body: dict) -> tuple[P.CompletionRequest, GenSpec]:
    req = P.CompletionRequest.model_validate(body, strict=True)
    check_model(state, req.model)
    try:
        grammar = req.grammar_request()
    except RequestError as e:
        raise ApiError(400, str(e)) from None
    ids = req.prompt_token_ids
    if ids is None:
        if state.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
        ids = encode(state, req.prompt_text, "prompt")
    if req.suffix:
        ids = _fill_in_the_middle(state, ids, req.suffix)

    def make(room):
        params = req.to_sampling_params(room)
        if req.echo and req.logprobs is not None:
            params.prompt_logprobs = req.logprobs  # echo + logprobs: the prompt's tokens are scored too
        if req.candidates > (req.n or 1) and params.logprobs is None:
            params.logprobs = 0  # best_of ranks by the sampled tokens' logprobs (not returned unless asked)
        return params

    return req, plain_spec(state, ids, make, grammar=grammar)


def _fill_in_the_middle(state: ServerState, ids: list[int], suffix: str) -> list[int]:
    """A fill-in-the-middle prompt: PREFIX prompt SUFFIX suffix MIDDLE, in the tokenizer's FIM tokens."""
    fim = state.tokenizer.fim_ids() if state.tokenizer is not None else None
    if fim is None:
        raise ApiError(400, "suffix needs a model trained for fill-in-the-middle, whose tokenizer has FIM tokens "
                       "(<|fim_prefix|>, <|fim_suffix|>, <|fim_middle|> or StarCoder's / DeepSeek-Coder's); "
                       "this model's tokenizer has none", param="suffix")
    prefix, suffix_tok, middle = fim
    return [prefix, *ids, suffix_tok, *encode(state, suffix, "suffix"), middle]


def _sse(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

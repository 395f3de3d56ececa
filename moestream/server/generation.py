"""Protocol-neutral core of the routes: prompt -> validated GenSpec -> typed events.

Every wire adapter (OpenAI chat, completions, Anthropic messages) renders its request into a
`GenSpec`, then consumes `Event`s: reasoning text, content text, whole tool calls, and one `done`.
Reasoning and tool-call parsing happen here once, for streaming and non-streaming alike (the
non-streaming answer is the concatenation of the same events).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from ..core import MoestreamError, SamplingParams
from .parsers import NoReasoningParser, NoToolParser, ReasoningParser, ToolCall, ToolParser, prompt_opens_reasoning


class ApiError(Exception):
    """An error answered with an HTTP status and an OpenAI/Anthropic error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


@dataclass
class Limits:
    """Bounds on the work one request can ask for (flags of `moestream serve`)."""

    max_body_bytes: int = 32 * 1024 * 1024  # larger bodies: 413 before they are read
    max_messages: int = 4096
    max_json_depth: int = 64  # nesting of the request JSON (tool schemas are the deepest honest use)
    body_timeout: float = 30.0  # seconds to receive the whole body once the headers are in (408 after)


@dataclass
class ServerState:
    """What the routes share: the engine handle, the tokenizer and the serving options."""

    engine: Any  # EngineClient, or a test double with generate/cancel/stats/info/alive
    tokenizer: Any
    model_name: str
    tool_parser_cls: type[ToolParser]
    reasoning_parser_cls: type[ReasoningParser]
    api_key: str | None = None
    metrics: Any = None
    started: float = field(default_factory=time.time)
    limits: Limits = field(default_factory=Limits)
    metrics_public: bool = False  # /metrics without the API key
    # The engine's last stats, refreshed in the background: /v1/stats and /metrics never wait on it.
    snapshot: dict = field(default_factory=dict)

    @property
    def max_seq_len(self) -> int:
        return int(self.engine.info["max_seq_len"])

    @property
    def kv_tokens(self) -> int:
        return int(self.engine.info.get("kv_tokens", self.max_seq_len))


@dataclass
class GenSpec:
    prompt_ids: list[int]
    params: SamplingParams
    tool_parser: ToolParser
    reasoning: ReasoningParser
    keep_markup: bool = True
    parent: str | None = None  # n > 1: the engine id of choice 0, whose prefill this choice copies


@dataclass
class Event:
    kind: str  # "reasoning" | "content" | "tool_call" | "done"
    text: str = ""
    call: ToolCall | None = None
    finish_reason: str | None = None
    stop: str | None = None
    completion_tokens: int = 0
    # the logprob entries ([token, logprob, alternatives]) of the tokens up to this event, when asked for
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (on "done")


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


# ---- preparing ---------------------------------------------------------------------------------
def render_chat(state: ServerState, messages: list[dict], tools: list[dict] | None, template_kwargs: dict,
                add_generation_prompt: bool = True, continue_final: bool = False) -> str:
    if state.tokenizer is None or state.tokenizer.chat_template is None:
        raise ApiError(400, "this model has no chat template; use /v1/completions with a plain prompt")
    messages = _template_roles(messages, state.tokenizer.chat_template)
    prompt = _apply_template(state, messages, tools, template_kwargs, add_generation_prompt)
    if tools and prompt == _apply_template(state, messages, None, template_kwargs, add_generation_prompt):
        # the template ignores `tools`: the model would never see them, so answering would be a lie
        raise ApiError(400, "this model's chat template does not render tools, so tool calling is not "
                       "available with it; send the request without tools (or with tool_choice \"none\")",
                       param="tools")
    if continue_final:
        prompt = _continue_final(prompt, messages[-1].get("content"))
    return prompt


def _continue_final(prompt: str, content) -> str:
    """The prompt cut right after the final message's text, its end-of-turn dropped, so the model continues the
    message. Templates may rewrite that text (Qwen's move a reasoning block into their own markup, strip
    whitespace): its visible part after the reasoning is looked for then. Where it cannot be found the request is
    refused rather than answered as a new turn."""
    if isinstance(content, list):  # content parts: the text parts, joined as the templates join them
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    text = content if isinstance(content, str) else ""
    if not text.strip():
        raise ApiError(400, "continue_final_message needs a final message with text to continue",
                       param="continue_final_message")
    tail = text.rsplit("</think>", 1)[-1]
    for want in (text, text.strip(), tail, tail.strip()):
        if want.strip() and (cut := prompt.rfind(want)) >= 0:
            return prompt[:cut + len(want)]
    raise ApiError(400, "continue_final_message: the chat template rewrote the final message, so where its text "
                   "ends cannot be found in the prompt; send it without continue_final_message, or use "
                   "/v1/completions with the prompt as you want it", param="continue_final_message")


def _template_roles(messages: list[dict], template: str) -> list[dict]:
    """OpenAI's "developer" role is its newer name for "system". Templates that never name it (Qwen's, the
    demo's) skip such a message without a word, so the model would never see its instructions: there it is
    rendered as a system message."""
    if "developer" in template or not any(m.get("role") == "developer" for m in messages):
        return messages
    return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]


def _apply_template(state: ServerState, messages: list[dict], tools: list[dict] | None, template_kwargs: dict,
                    add_generation_prompt: bool) -> str:
    try:
        return state.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                   add_generation_prompt=add_generation_prompt, **template_kwargs)
    except Exception as e:  # template errors come as jinja2/ChatTemplateError/TypeError; all are the request's
        raise ApiError(400, f"the chat template could not render these messages: {e}") from None


def check_prompt_fits(state: ServerState, n: int, param: str = "messages", at_least: bool = False) -> None:
    """Refuse, before any compute, a prompt the context or the KV cache cannot hold (at_least: n is a lower bound
    of its tokens, found without tokenizing it)."""
    if n == 0 and not at_least:
        raise ApiError(400, "the prompt is empty", param=param)
    has = f"at least {n}" if at_least else f"{n}"
    if n >= state.max_seq_len:
        raise ApiError(400, f"This model's maximum context length is {state.max_seq_len} tokens, but the prompt "
                       f"has {has} tokens (prompt plus at least one generated token must fit). Shorten the "
                       "prompt, or raise --max-seq-len-override.", param=param, code="context_length_exceeded")
    if n + 1 > state.kv_tokens:
        raise ApiError(400, f"the prompt has {has} tokens but this server's KV cache holds {state.kv_tokens}; "
                       f"shorten the prompt, or start the server with --max-seq-len-override {n + 1} or more (its "
                       "memory plan then holds one whole request that long before expert slots) or a larger "
                       "--num-tokens", param=param, code="context_length_exceeded")


def sampling_params(state: ServerState, n_prompt: int, make, clamp: bool = False) -> SamplingParams:
    """`make(default_max_tokens)` -> SamplingParams. max_tokens beyond the context left is refused as
    OpenAI does (400), or with `clamp` cut to what fits (Anthropic clients send their own fixed value). The
    context is the model's, or the KV cache's when that is smaller (the engine ends a request there)."""
    limit = min(state.max_seq_len, state.kv_tokens + 1)  # the KV pages hold every token but the last
    room = limit - n_prompt
    try:
        params = make(room)
    except MoestreamError as e:
        raise ApiError(400, str(e)) from None
    if params.max_tokens > room and not clamp:
        where = (f"This model's maximum context length is {state.max_seq_len} tokens" if limit == state.max_seq_len
                 else f"This server's KV cache holds {state.kv_tokens} tokens (--num-tokens), so a request may "
                 f"reach {limit}")
        raise ApiError(400, f"{where}. However, you requested {n_prompt + params.max_tokens} tokens ({n_prompt} in "
                       f"the prompt, {params.max_tokens} in the completion). Please reduce the length of the "
                       "prompt or max_tokens.", param="max_tokens", code="context_length_exceeded")
    params.max_tokens = min(params.max_tokens, room)
    _check_token_ids(state, params.stop_token_ids, "stop_token_ids")
    _check_token_ids(state, list(params.logit_bias), "logit_bias")
    if params.min_tokens > params.max_tokens:
        raise ApiError(400, f"min_tokens ({params.min_tokens}) exceeds max_tokens ({params.max_tokens})",
                       param="min_tokens")
    return params


def _check_token_ids(state: ServerState, ids: list[int], param: str) -> None:
    vocab = state.engine.info.get("vocab_size")
    if vocab and any(not 0 <= t < vocab for t in ids):
        raise ApiError(400, f"{param} must be token ids in [0, {vocab})", param=param)


def chat_spec(state: ServerState, prompt: str, params_fn, tools: list | None, tool_choice: Any,
              skip_special_tokens: bool = True, clamp: bool = False, grammar: tuple | None = None,
              max_thinking_tokens: int | None = None) -> GenSpec:
    """grammar: (kind, value, param) of a structured output; a forced tool_choice constrains the call."""
    ids = encode(state, prompt)
    check_prompt_fits(state, len(ids))
    params = sampling_params(state, len(ids), params_fn, clamp)
    use_tools = bool(tools) and tool_choice != "none"
    tool_parser = state.tool_parser_cls(tools) if use_tools else NoToolParser()
    opens = prompt_opens_reasoning(prompt)
    reasoning = state.reasoning_parser_cls(starts_in_reasoning=opens)
    forced = _forced_tools(tools, tool_choice) if use_tools else None
    if forced is not None and state.tool_parser_cls.name == "none":  # no call could come back as a tool call
        raise ApiError(400, "this server reads no tool-call format for this model (--tool-call-parser none, or a "
                       "chat template in a format it does not know), so a tool call cannot be required; send "
                       "tool_choice \"auto\" to get the model's text as it is", param="tool_choice")
    if grammar is not None and forced is not None:
        raise ApiError(400, "a structured output (response_format / guided_*) cannot be combined with a forced "
                       "tool_choice; send one of them", param=grammar[2])
    if grammar is not None:
        params.grammar = compile_structured(state, *grammar)
    elif forced is not None:
        params.grammar = _tool_grammar(state, forced, tool_choice)
    params.reasoning_open = opens and state.reasoning_parser_cls.name != "none"
    if max_thinking_tokens is not None:
        if state.tokenizer is None or state.tokenizer.token_to_id("</think>") is None:
            raise ApiError(400, "max_thinking_tokens needs a reasoning model (this tokenizer has no </think>)",
                           param="max_thinking_tokens")
        params.max_thinking_tokens = max_thinking_tokens
    return GenSpec(ids, params, tool_parser, reasoning, keep_markup=skip_special_tokens)


def compile_structured(state: ServerState, kind: str, value: Any, param: str | None = None) -> str:
    """A request's structured output -> the llguidance grammar the engine applies; 400 when invalid,
    501 when the grammar engine is not installed."""
    from ..tokenizer.grammar import GrammarUnavailable, compile_grammar

    special = _special_ids(state.tokenizer) if kind == "structural_tag" else None
    try:
        return compile_grammar(kind, value, special)
    except GrammarUnavailable as e:
        raise ApiError(501, str(e), type="server_error", param=param) from None
    except MoestreamError as e:
        raise ApiError(400, str(e), param=param) from None


def _special_ids(tok) -> dict[str, int]:
    """{text: id} of the tokenizer's special tokens: grammars match them as that token (a special token's
    text written out in pieces is another thing)."""
    if tok is None:
        return {}
    pieces = {tid: tok.id_to_token(tid) for tid in tok.special_added_token_ids}
    return {piece: tid for tid, piece in pieces.items() if piece}


def _forced_tools(tools: list | None, tool_choice: Any) -> list[dict] | None:
    """The tools a forced tool_choice allows ([{"name", "parameters"}]), None when the choice is free."""
    if not tools:
        return None
    fns = [t.get("function", t) for t in tools]
    name = None
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
    elif hasattr(tool_choice, "function"):
        name = tool_choice.function.name
    elif tool_choice != "required":
        return None
    return [{"name": f["name"], "parameters": f.get("parameters")} for f in fns if name is None or f["name"] == name]


_warned_tool_grammar = False


def _tool_grammar(state: ServerState, tools: list[dict], tool_choice: Any) -> str | None:
    """The grammar of the tool-call format the parser reads (hermes JSON or qwen3_coder XML; other formats
    stay unconstrained); None when the grammar engine is unavailable."""
    global _warned_tool_grammar
    from ..tokenizer.grammar import GrammarUnavailable, tool_call_grammar, xml_tool_call_grammar

    build = {"hermes": tool_call_grammar, "qwen3_coder": xml_tool_call_grammar}.get(
        getattr(state.tool_parser_cls, "name", ""))
    if build is None:
        return None
    special = _special_ids(state.tokenizer)
    try:
        return build(tools, special, multiple=tool_choice == "required")
    except GrammarUnavailable as e:
        if not _warned_tool_grammar:
            logging.getLogger("moestream.server").warning("forced tool calls are not constrained: %s", e)
            _warned_tool_grammar = True
        return None
    except MoestreamError as e:
        raise ApiError(400, f"the tool schemas cannot be enforced: {e}", param="tools") from None


def encode(state: ServerState, text: str, param: str = "messages", bound: bool = True) -> list[int]:
    """The prompt's token ids. bound: a text longer than the context can hold, as a lower bound of its tokens
    shows (Tokenizer.min_tokens), is refused before it is encoded: encoding megabytes takes the server's CPU and
    gigabytes of memory for seconds, to count tokens that cannot fit."""
    if bound and len(text) > state.max_seq_len:
        check_prompt_fits(state, state.tokenizer.min_tokens(text), param, at_least=True)
    try:
        return state.tokenizer.encode(text)
    except (UnicodeError, ValueError) as e:  # e.g. a lone surrogate that slipped into a template variable
        raise ApiError(400, f"the prompt could not be tokenized: {e}") from None


def plain_spec(state: ServerState, ids: list[int], params_fn, grammar: tuple | None = None) -> GenSpec:
    check_prompt_fits(state, len(ids), "prompt")
    _check_token_ids(state, ids, "prompt")
    params = sampling_params(state, len(ids), params_fn)
    if grammar is not None:
        params.grammar = compile_structured(state, *grammar)
    return GenSpec(ids, params, NoToolParser(), NoReasoningParser(), keep_markup=False)


# ---- running -------------------------------------------------------------------------------------
async def run(state: ServerState, spec: GenSpec, request=None, rid: str | None = None) -> AsyncIterator[Event]:
    """Events of one generation; a client disconnect (seen on `request`) aborts it at once."""
    rid = rid or new_request_id("gen")
    watcher = asyncio.create_task(_watch_disconnect(request, state.engine, rid)) if request is not None else None
    t0 = time.perf_counter()
    first: float | None = None
    tokens = 0
    outcome = "error"  # an EngineError (or a bug) leaves it so
    try:
        extra = {"parent": spec.parent} if spec.parent else {}
        async with contextlib.aclosing(state.engine.generate(rid, spec.prompt_ids, spec.params,
                                                             spec.keep_markup, **extra)) as deltas:
            lps: list = []  # logprob entries not yet attached to an event
            plps = None
            async for d in deltas:
                tokens += d.tokens
                if first is None and d.tokens:
                    first = time.perf_counter()
                if d.logprobs:
                    lps += d.logprobs
                if d.prompt_logprobs:
                    plps = d.prompt_logprobs
                for ev in _feed(spec, d.text):
                    if lps and ev.kind != "reasoning":
                        ev.logprobs, lps = lps, []
                    ev.prompt_logprobs = plps  # a stream's first event carries them (echo + logprobs)
                    yield ev
                if d.finish_reason is not None:
                    for ev in _finish(spec):
                        if lps and ev.kind != "reasoning":
                            ev.logprobs, lps = lps, []
                        ev.prompt_logprobs = plps
                        yield ev
                    outcome = "aborted" if d.finish_reason == "abort" else d.finish_reason  # engine totals' word
                    yield Event("done", finish_reason=d.finish_reason, stop=d.stop, completion_tokens=tokens,
                                logprobs=lps or None, prompt_logprobs=plps,
                                cached_tokens=getattr(d, "cached_tokens", 0))
                    return
        outcome = "aborted"
    except (GeneratorExit, asyncio.CancelledError):
        outcome = "aborted"  # the client went away and its response closed this generator
        raise
    finally:
        if watcher is not None:
            watcher.cancel()
        if state.metrics is not None:
            state.metrics.record(len(spec.prompt_ids), tokens, (first - t0) if first else None,
                                 time.perf_counter() - t0, outcome)


async def _watch_disconnect(request, engine, rid: str) -> None:
    with contextlib.suppress(Exception):
        while True:
            msg = await request.receive()
            if msg.get("type") == "http.disconnect":
                engine.cancel(rid)
                return


def _tool_events(events) -> list[Event]:
    return [Event("content", text=e) if isinstance(e, str) else Event("tool_call", call=e) for e in events if e]


def _feed(spec: GenSpec, text: str) -> list[Event]:
    if not text:
        return []
    r, c = spec.reasoning.feed(text)
    out = [Event("reasoning", text=r)] if r else []
    return out + _tool_events(spec.tool_parser.feed(c) if c else [])


def _finish(spec: GenSpec) -> list[Event]:
    r, c = spec.reasoning.finish()
    out = [Event("reasoning", text=r)] if r else []
    return out + _tool_events((spec.tool_parser.feed(c) if c else []) + spec.tool_parser.finish())


@dataclass
class Collected:
    reasoning: str | None
    content: str
    tool_calls: list[ToolCall]
    finish_reason: str
    stop: str | None
    completion_tokens: int
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    cached_tokens: int = 0


async def collect(events: AsyncIterator[Event], saw_reasoning=None) -> Collected:
    """The whole answer (non-streaming routes)."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[ToolCall] = []
    lps: list = []
    done = Event("done", finish_reason="abort")
    async for ev in events:
        lps += ev.logprobs or []
        if ev.kind == "reasoning":
            reasoning.append(ev.text)
        elif ev.kind == "content":
            content.append(ev.text)
        elif ev.kind == "tool_call":
            calls.append(ev.call)
        else:
            done = ev
    has_reasoning = bool(reasoning) or bool(saw_reasoning and saw_reasoning())
    return Collected("".join(reasoning) if has_reasoning else None, "".join(content), calls,
                     done.finish_reason or "abort", done.stop, done.completion_tokens, lps, done.prompt_logprobs,
                     done.cached_tokens)

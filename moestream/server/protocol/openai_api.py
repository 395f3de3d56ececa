"""The OpenAI API: /v1/chat/completions and /v1/completions requests (pydantic), their responses and
stream chunks (plain dicts), error bodies and logprobs.

Messages handed to chat templates (``ChatCompletionRequest.template_messages()``) are OpenAI-style dicts
normalized for HF templates: ``content`` is always a string, and ``tool_calls[i].function.arguments`` is a
dict (Qwen3's template prints a dict with ``tojson`` and a string verbatim; Qwen3-Coder/Qwen3.5 templates
iterate ``arguments|items`` and need the dict).
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Iterable, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from moestream.core import SEED_MAX, SEED_MIN, RequestError, SamplingParams
from moestream.server.parsers import ToolCall

from .common import (MAX_N, MAX_STOP_CHARS, MAX_STOP_SEQUENCES, MAX_TOKEN_IDS, RequestModel, make_sampling_params,
                     now)


def openai_error_body(
    message: str, param: str | None = None, code: str | None = None, type: str = "invalid_request_error"
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---- requests ------------------------------------------------------------------------------------


class StreamOptions(RequestModel):
    include_usage: bool = False


class JsonSchemaFormat(RequestModel):
    name: str = "response"
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class StructuralTag(RequestModel):
    """One tag of a ``structural_tag`` response format (vLLM's shape): ``begin``, JSON valid against
    ``schema`` (any JSON value without one), ``end``."""
    begin: str = Field(min_length=1)
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    end: str = ""


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"] = "text"
    json_schema: Optional[JsonSchemaFormat] = None
    structures: Optional[list[StructuralTag]] = None  # structural_tag: the tags
    triggers: Optional[list[str]] = None  # structural_tag: texts that start a tag (each begin starts with one)
    format: Optional[Any] = None  # xgrammar's newer structural_tag shape: refused, not ignored

    @model_validator(mode="after")
    def _check_schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type 'json_schema' needs a json_schema object")
        if self.type == "structural_tag" and self.format is not None:
            raise ValueError("the structural_tag 'format' shape is not supported; send 'structures' "
                             "([{begin, schema, end}]) and 'triggers'")
        if self.type == "structural_tag" and (not self.structures or not self.triggers):
            raise ValueError("response_format of type 'structural_tag' needs 'structures' and 'triggers'")
        return self

    def grammar(self) -> list[tuple[str, Any, str]]:
        """The structured output it asks for, as `_OpenAISampling.grammar_request` lists them."""
        if self.type == "text":
            return []
        if self.type == "json_object":
            return [("json_object", None, "response_format")]
        if self.type == "structural_tag":
            tags = [{"begin": t.begin, "schema": t.schema_, "end": t.end} for t in self.structures]
            return [("structural_tag", {"structures": tags, "triggers": self.triggers}, "response_format")]
        schema = self.json_schema.schema_ if self.json_schema.schema_ is not None else {}
        return [("json_schema", schema, "response_format")]


class _OpenAISampling(RequestModel):
    model: str = ""
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=-1)
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    seed: Optional[int] = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[Annotated[int, Field(ge=0, lt=MAX_TOKEN_IDS)]]] = Field(
        default=None, max_length=MAX_STOP_SEQUENCES * 16)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: Optional[int] = Field(default=None, ge=1, le=MAX_N)
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: Optional[float] = Field(default=None, gt=0.0, le=10.0)
    logit_bias: Optional[dict[str, float]] = None
    min_tokens: Optional[int] = Field(default=None, ge=0)
    user: Optional[str] = None
    # structured outputs in the shapes vLLM (guided_*, structured_outputs) and llama.cpp (grammar,
    # json_schema) accept; at most one of them, response_format included
    guided_json: Optional[Union[dict[str, Any], str]] = None
    guided_regex: Optional[str] = None
    guided_grammar: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    grammar: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = None
    # OpenAI's field (chat); vLLM takes it on completions too
    response_format: Optional[ResponseFormat] = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: Any) -> Any:
        for s in [v] if isinstance(v, str) else v or []:
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"stop sequences may have at most {MAX_STOP_CHARS} characters, got {len(s)}")
        if isinstance(v, list):
            if len(v) > MAX_STOP_SEQUENCES:
                raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(v)}")
            if any(s == "" for s in v):
                raise ValueError("stop sequences must be non-empty strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        for k, b in (v or {}).items():
            if not (k.strip().isascii() and k.strip().isdigit()) or int(k) >= MAX_TOKEN_IDS:  # not "٣"
                raise ValueError(f"logit_bias keys must be token ids, got {k!r}")
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b}")
        return v

    def grammar_request(self) -> Optional[tuple[str, Any, str]]:
        """(kind, value, param) of the structured output asked for, None when none; two at once: 400."""
        found: list[tuple[str, Any, str]] = []
        gj = self.guided_json
        if isinstance(gj, str):
            try:
                gj = json.loads(gj)
            except ValueError:
                raise RequestError("guided_json must be a JSON schema (an object or its JSON text)") from None
        for kind, value, param in (("json_schema", gj, "guided_json"), ("regex", self.guided_regex, "guided_regex"),
                                   ("grammar", self.guided_grammar, "guided_grammar"),
                                   ("choice", self.guided_choice, "guided_choice"),
                                   ("grammar", self.grammar, "grammar"),
                                   ("json_schema", self.json_schema, "json_schema")):
            if value is not None:
                found.append((kind, value, param))
        so = self.structured_outputs or {}
        names = {"json": "json_schema", "regex": "regex", "grammar": "grammar", "choice": "choice",
                 "json_object": "json_object", "structural_tag": "structural_tag"}
        for key, value in so.items():
            if key not in names:
                if value is not None and key not in ("disable_fallback", "disable_any_whitespace",
                                                     "disable_additional_properties", "whitespace_pattern"):
                    raise RequestError(f"structured_outputs.{key} is not supported by this server")
                continue
            if value is None or (key == "json_object" and not value):
                continue
            if key == "json" and isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    raise RequestError("structured_outputs.json must be a JSON schema") from None
            found.append((names[key], value, f"structured_outputs.{key}"))
        found += self.response_format.grammar() if self.response_format is not None else []
        if len(found) > 1:
            raise RequestError("only one structured output may be asked for per request, got "
                               + ", ".join(f for _, _, f in found))
        return found[0] if found else None

    @model_validator(mode="after")
    def _check_stream_options(self) -> "_OpenAISampling":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _max_tokens(self) -> Optional[int]:
        return self.max_tokens

    def sampling_kwargs(self) -> dict[str, Any]:
        """``SamplingParams`` keyword arguments; a value is None where the request did not set it, so the
        server applies its default (drop the Nones, or use :meth:`to_sampling_params`)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return {
            "max_tokens": self._max_tokens(),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": stop,
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            "min_tokens": self.min_tokens,
            "logprobs": self._logprobs(),
        }

    def _logprobs(self) -> Optional[int]:
        return None

    def to_sampling_params(self, default_max_tokens: int, **defaults: Any) -> SamplingParams:
        """``SamplingParams`` from the request, with ``defaults`` (and ``default_max_tokens``) where unset."""
        return make_sampling_params(self.sampling_kwargs(), default_max_tokens, defaults)


class TextPart(RequestModel):
    type: Literal["text"] = "text"
    text: str


def _check_parts(v: Any) -> Any:
    if isinstance(v, list):
        for i, part in enumerate(v):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", None):
                raise ValueError(f"content part {i} has type {kind!r}; only 'text' content parts are supported")
    return v


class FunctionCall(RequestModel):
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"


class ChatToolCall(RequestModel):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ChatToolCall]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None  # vLLM's newer name for reasoning_content; accepted as an alias

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, v: Any) -> Any:
        return _check_parts(v)

    @model_validator(mode="after")
    def _check_role_fields(self) -> "ChatMessage":
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("messages with role 'tool' must have a tool_call_id")
        if self.role != "assistant" and self.tool_calls:
            raise ValueError(f"only assistant messages may have tool_calls, not role {self.role!r}")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required for role {self.role!r}")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template wants it (content a string, tool-call arguments a dict)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.name is not None:
            out["name"] = self.name
        if self.role == "assistant":
            reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
            if reasoning is not None:
                out["reasoning_content"] = reasoning
            if self.tool_calls:
                out["tool_calls"] = [
                    {
                        "id": tc.id or f"call_{i}",
                        "type": "function",
                        "function": {"name": tc.function.name, "arguments": _arguments_dict(tc.function.arguments)},
                    }
                    for i, tc in enumerate(self.tool_calls)
                ]
        if self.role == "tool":
            out["tool_call_id"] = self.tool_call_id
        return out


def _arguments_dict(arguments: Union[str, dict[str, Any]]) -> Union[str, dict[str, Any]]:
    """JSON-string arguments as a dict for templates; left as the string if it is not a JSON object."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


class FunctionDef(RequestModel):
    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ChatTool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDef

    def for_template(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.function.name}
        if self.function.description is not None:
            fn["description"] = self.function.description
        fn["parameters"] = self.function.parameters or {"type": "object", "properties": {}}
        return {"type": "function", "function": fn}


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    tools: Optional[list[ChatTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # reasoning models: tokens allowed inside <think>...</think> before the server closes the block
    max_thinking_tokens: Optional[int] = Field(default=None, ge=0)

    def _logprobs(self) -> Optional[int]:
        if self.logprobs:
            return self.top_logprobs or 0
        if self.top_logprobs:
            raise RequestError("top_logprobs needs logprobs: true")
        return None

    @model_validator(mode="after")
    def _check_tools(self) -> "ChatCompletionRequest":
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tool function names must be unique")
        tc = self.tool_choice
        if tc is not None and tc != "none" and not self.tools:
            raise ValueError("tool_choice is only allowed when tools are specified")
        if isinstance(tc, NamedToolChoice) and tc.function.name not in names:
            raise ValueError(f"tool_choice names function {tc.function.name!r}, which is not among the tools")
        if self.continue_final_message and (self.add_generation_prompt or self.messages[-1].role != "assistant"):
            raise ValueError(
                "continue_final_message needs add_generation_prompt=false and a final assistant message"
            )
        return self

    def _max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as dicts for ``apply_chat_template``."""
        return [m.for_template() for m in self.messages]

    def template_tools(self) -> Optional[list[dict[str, Any]]]:
        """Tools for ``apply_chat_template``; None when there are none or tool_choice is "none"."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.for_template() for t in self.tools]

    def template_kwargs(self) -> dict[str, Any]:
        return dict(self.chat_template_kwargs or {})


class CompletionRequest(_OpenAISampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    echo: bool = False
    # text after the insertion point: the prompt becomes a fill-in-the-middle prompt (models with FIM tokens)
    suffix: Optional[str] = None
    # candidates generated; the n with the highest cumulative logprob are returned
    best_of: Optional[int] = Field(default=None, ge=1, le=MAX_N)

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], (str, list)) and len(v) != 1:
                raise ValueError(f"only one prompt per request is supported, got {len(v)}")
            if isinstance(v[0], list) and not v[0]:
                raise ValueError("prompt token list must not be empty")
            ids = v[0] if isinstance(v[0], list) else v
            if isinstance(ids[0], int) and any(not isinstance(t, int) or t < 0 for t in ids):
                raise ValueError("prompt token ids must be integers >= 0")
        return v

    def _logprobs(self) -> Optional[int]:
        return self.logprobs

    @model_validator(mode="after")
    def _check_best_of_and_suffix(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of < (self.n or 1):
            raise ValueError(f"best_of ({self.best_of}) must be greater than or equal to n ({self.n})")
        if self.stream and (self.best_of or 1) > 1:
            raise ValueError("best_of cannot be used with stream: the best candidate is known only at the end")
        if self.suffix and self.echo:
            raise ValueError("echo cannot be combined with suffix")
        return self

    @property
    def candidates(self) -> int:
        """Completions generated: best_of, or n."""
        return self.best_of or self.n or 1

    @property
    def prompt_text(self) -> Optional[str]:
        """The prompt if it was given as text, else None."""
        p = self.prompt
        if isinstance(p, str):
            return p
        return p[0] if isinstance(p[0], str) else None

    @property
    def prompt_token_ids(self) -> Optional[list[int]]:
        """The prompt if it was given as token ids, else None."""
        p = self.prompt
        if isinstance(p, list) and isinstance(p[0], int):
            return list(p)  # type: ignore[arg-type]
        if isinstance(p, list) and isinstance(p[0], list):
            return list(p[0])
        return None


# ---- responses -----------------------------------------------------------------------------------


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},  # from the prefix cache
    }


def openai_finish_reason(finish_reason: Optional[str], has_tool_calls: bool = False) -> Optional[str]:
    """Engine finish reason ("stop" | "length" | "abort" | None) -> OpenAI's."""
    if finish_reason is None:
        return None
    if has_tool_calls and finish_reason == "stop":
        return "tool_calls"
    return "length" if finish_reason == "length" else "stop"


def _tool_calls_list(tool_calls: Optional[Iterable[ToolCall]], streaming: bool, start_index: int = 0) -> list[dict]:
    return [tc.to_openai(index=start_index + i if streaming else None) for i, tc in enumerate(tool_calls or [])]


def chat_completion_response(
    request_id: str,
    model: str,
    content: Optional[str],
    *,
    reasoning_content: Optional[str] = None,
    tool_calls: Optional[list[ToolCall]] = None,
    finish_reason: Optional[str] = "stop",
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    created: Optional[int] = None,
    cached_tokens: int = 0,
    index: int = 0,
    logprobs: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """A ``chat.completion`` object. ``finish_reason`` is the engine's; it becomes "tool_calls" when calls were made."""
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if tool_calls else "")}
    if reasoning_content is not None:
        message["reasoning_content"] = reasoning_content
    if tool_calls:
        message["tool_calls"] = _tool_calls_list(tool_calls, streaming=False)
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created if created is not None else now(),
        "model": model,
        "choices": [
            {
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": openai_finish_reason(finish_reason, bool(tool_calls)),
            }
        ],
        "usage": usage_dict(prompt_tokens, completion_tokens, cached_tokens),
    }


def chat_completion_chunk(
    request_id: str,
    model: str,
    *,
    created: int,
    role: Optional[str] = None,
    content: Optional[str] = None,
    reasoning_content: Optional[str] = None,
    tool_calls: Optional[list[ToolCall]] = None,
    tool_call_start_index: int = 0,
    finish_reason: Optional[str] = None,
    usage: Optional[dict[str, int]] = None,
    include_choice: bool = True,
    index: int = 0,
    logprobs: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """A ``chat.completion.chunk``. ``finish_reason`` is OpenAI's (use :func:`openai_finish_reason`).
    ``tool_calls`` are complete calls, numbered from ``tool_call_start_index``. With
    ``include_choice=False`` it is the final usage-only chunk (``choices: []``)."""
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
    }
    if include_choice:
        delta: dict[str, Any] = {}
        if role is not None:
            delta["role"] = role
        if content is not None:
            delta["content"] = content
        if reasoning_content is not None:
            delta["reasoning_content"] = reasoning_content
        if tool_calls:
            delta["tool_calls"] = _tool_calls_list(tool_calls, streaming=True, start_index=tool_call_start_index)
        chunk["choices"].append({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason})
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def completion_response(
    request_id: str,
    model: str,
    text: str,
    *,
    finish_reason: Optional[str] = "stop",
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    created: Optional[int] = None,
    cached_tokens: int = 0,
    index: int = 0,
    logprobs: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created if created is not None else now(),
        "model": model,
        "choices": [
            {"index": index, "text": text, "logprobs": logprobs, "finish_reason": openai_finish_reason(finish_reason)}
        ],
        "usage": usage_dict(prompt_tokens, completion_tokens, cached_tokens),
    }


def completion_chunk(
    request_id: str,
    model: str,
    *,
    created: int,
    text: str = "",
    finish_reason: Optional[str] = None,
    usage: Optional[dict[str, int]] = None,
    include_choice: bool = True,
    index: int = 0,
    logprobs: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """A streamed ``text_completion`` object; ``finish_reason`` is OpenAI's."""
    chunk: dict[str, Any] = {
        "id": request_id, "object": "text_completion", "created": created, "model": model, "choices": [],
    }
    if include_choice:
        chunk["choices"].append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason})
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def sse_data(obj: Any) -> str:
    """One OpenAI SSE message."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


# ---- logprobs ------------------------------------------------------------------------------------


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character that stands for each byte, inverted."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_DECODER = _byte_decoder()


def _token_text(tokenizer, tid: int) -> tuple[str, list[int]]:
    """(text, UTF-8 bytes) of one token. A byte-level token may hold part of a character: its text then
    shows U+FFFD while `bytes` keeps the real bytes, as OpenAI's logprobs do."""
    if tokenizer is None:
        return str(tid), list(str(tid).encode())
    text = tokenizer.decode([tid], skip_special_tokens=False)
    if "\ufffd" in text:
        piece = tokenizer.id_to_token(tid) if hasattr(tokenizer, "id_to_token") else None
        if piece and all(c in _BYTE_DECODER for c in piece):
            return text, [_BYTE_DECODER[c] for c in piece]
    return text, list(text.encode("utf-8"))


def chat_logprobs(tokenizer, entries: list) -> dict[str, Any]:
    """Engine entries ``[token, logprob, [[id, logprob], ...]]`` -> a chat choice's ``logprobs``."""
    content = []
    for tid, lp, alts in entries:
        text, raw = _token_text(tokenizer, tid)
        tops = []
        for aid, alp in alts:
            at, ab = _token_text(tokenizer, aid)
            tops.append({"token": at, "logprob": alp, "bytes": ab})
        content.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": tops})
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer, entries: list, offset: int = 0) -> dict[str, Any]:
    """Engine entries (``[token, logprob, alternatives]``; logprob None for a prompt's first token) ->
    a completion choice's ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset)."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, lp, alts in entries:
        text, _ = _token_text(tokenizer, tid)
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append(None if lp is None else {_token_text(tokenizer, a)[0]: v for a, v in alts})
        out["text_offset"].append(offset)
        offset += len(text)
    return out

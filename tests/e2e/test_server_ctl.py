"""Live cache rebuild end to end: the real `moestream serve` on the tiny Qwen3.5 (Gated DeltaNet + attention,
offload expert cache) resized by POST /v1/admin/cache and `moestream ctl` while 4 greedy streams run.

One server for the module; the tests run in order (the first one relies on the server's first pages)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from test_server_e2e import start_server

KEY = "ctl-key"
MODEL = "tiny"
PROMPT_LEN, MAX_TOKENS = 20, 300  # 320 tokens: 20 KV pages of 16 a request
PROMPTS = [[100 + 7 * i + j for j in range(PROMPT_LEN)] for i in range(4)]
FILLER = [[300 + 7 * i + j for j in range(PROMPT_LEN)] for i in range(4)]


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    proc, port, log = start_server(["--model-path", str(tiny_checkpoint("qwen35")), "--served-model-name", MODEL,
                                    "--api-key", KEY, "--max-running-requests", "4", "--num-tokens", "4096",
                                    "--moe-backend", "offload", "--moe-cache-size", "12", "--moe-cpu-threads", "1"])
    yield {"proc": proc, "url": f"http://127.0.0.1:{port}", "log": log}
    proc.kill()
    proc.wait()
    log.close()


@pytest.fixture(scope="module")
def http(server):
    return httpx.Client(base_url=server["url"], headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def streams(url: str, progress: list[int] | None = None, prompts=PROMPTS) -> list[tuple[str, str, int]]:
    """The 4 prompts as concurrent greedy streams: (text, finish reason, completion tokens) each."""
    oai = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    out: dict[int, tuple] = {}

    def run(i: int) -> None:
        text, finish, usage = "", None, None
        for chunk in oai.completions.create(model=MODEL, prompt=prompts[i], max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}):
            usage = chunk.usage or usage
            for ch in chunk.choices:
                text += ch.text or ""
                finish = ch.finish_reason or finish
                if progress is not None:
                    progress[i] += 1
        out[i] = (text, finish, usage.completion_tokens if usage else None)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    return threads, out


def finish(threads, out) -> list:
    for t in threads:
        t.join(300)
    assert len(out) == 4
    return [out[i] for i in range(4)]


def rebuild(http, **body) -> httpx.Response:
    return http.post("/v1/admin/cache", json=body)


def ctl(server, *args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moestream.cli", "ctl", *args, "--server", server["url"]],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


def test_live_rebuild_under_four_streams_keeps_every_token(server, http):
    # other prompts first, then the reference: its pages (which the live streams, computing the same tokens, share:
    # the prefix cache keeps one copy of a page) come after the filler's, many above the 96 pages of the new pool,
    # and the filler's pages are unreferenced prefix pages the rebuild must evict
    assert all(f == "length" for _, f, _ in finish(*streams(server["url"], prompts=FILLER)))
    reference = finish(*streams(server["url"]))  # every page they used stays in the prefix cache
    assert all(f == "length" and n == MAX_TOKENS for _, f, n in reference)
    progress = [0] * 4
    threads, out = streams(server["url"], progress)
    deadline = time.time() + 120
    while min(progress) < 100 and time.time() < deadline:  # each stream ~120 tokens in: 8 pages, many above 96
        time.sleep(0.005)
    r = rebuild(http, kv_tokens=1536, moe_slots=6)
    live = finish(threads, out)
    assert r.status_code == 200, r.text
    rep = r.json()
    assert rep["object"] == "cache_rebuild" and rep["running"] == 4  # really under the 4 streams
    assert rep["kv_tokens"] == {"before": 4096, "after": 1536} and rep["moe_slots"] == {"before": 12, "after": 6}
    assert rep["moved_pages"] > 0 and rep["evicted_prefix_pages"] > 0 and rep["rebuild_s"] > 0
    assert rep["plan"]["kv_tokens"] == 1536 and rep["plan"]["cache_slots"] == 6
    assert "expert slots 6 of 32" in rep["plan_text"]
    assert live == reference
    stats = http.get("/v1/stats").json()
    assert stats["kv"]["total_pages"] == 96 and stats["engine"]["kv_tokens"] == 1536
    assert stats["memory_plan"]["kv_tokens"] == 1536 and stats["memory_plan"]["cache_slots"] == 6
    assert stats["cache_rebuilds"]["count"] == 1 and stats["cache_rebuilds"]["last"]["moved_pages"] > 0
    load = stats["host_memory"]["at_load"]
    assert load["rss"] > 0 and load["bank_bytes"] > 0 and stats["host_memory"]["now"]["rss"] > 0
    server["log"].seek(0)
    text = server["log"].read()
    assert "cache rebuild in" in text and "expert slots 6 of 32" in text and "host memory at load: RSS" in text


def test_ctl_cache_and_stats(server, http, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    p = ctl(server, "cache", "--kv", "2048", "--moe", "auto", "--api-key-file", str(key_file))
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("cache rebuilt in ") and "KV 1536 -> 2048 tokens, expert slots 6 -> 32 of 32" in p.stdout
    assert "expert plan: backend offload" in p.stdout
    # the front end checks prompts against the pool's new size
    assert rebuild(http, kv_tokens=256).json()["kv_tokens"]["after"] == 256
    oai = openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="KV cache holds 256"):
        oai.completions.create(model=MODEL, prompt=list(range(5, 305)), max_tokens=4)
    c = oai.completions.create(model=MODEL, prompt=list(range(5, 205)), max_tokens=4, temperature=0)
    assert c.usage.prompt_tokens == 200 and c.choices[0].finish_reason == "length"
    assert rebuild(http, kv_tokens=2048).json()["kv_tokens"] == {"before": 256, "after": 2048}
    time.sleep(1.2)  # /v1/stats is a snapshot refreshed every 0.5 s
    p = ctl(server, "stats", env={"MOESTREAM_API_KEY": KEY})
    assert p.returncode == 0, p.stderr
    assert "KV cache: 2048 tokens (128 pages of 16)" in p.stdout
    assert "experts: backend offload, 32 of 32 expert slots (100.0%)" in p.stdout
    assert "cache rebuilds: 4 done, 0 refused" in p.stdout and "host memory: RSS" in p.stdout
    metrics = http.get("/metrics").text
    for line in (f'moestream_kv_cache_tokens{{model="{MODEL}"}} 2048.0',
                 f'moestream_expert_cache_slots{{model="{MODEL}"}} 32.0',
                 f'moestream_cache_rebuilds{{model="{MODEL}"}} 4.0'):
        assert line in metrics
    rss, = [line.split()[-1] for line in metrics.splitlines() if line.startswith("moestream_host_rss_bytes{")]
    assert float(rss) > 1 << 20


def test_refusals_change_nothing_and_serving_goes_on(server, http):
    before = http.get("/v1/stats").json()["memory_plan"]
    r = rebuild(http, kv_tokens=10 ** 9)  # ~0.5 TB of KV
    assert r.status_code == 409
    err = r.json()["error"]
    assert "budget" in err["message"] and err["type"] == "invalid_request_error"
    r = rebuild(http, moe_slots=33)
    assert r.status_code == 400 and "32 routed experts" in r.json()["error"]["message"]
    for body, param in (({"kv_tokens": "many"}, "kv_tokens"), ({"kv_tokens": True}, "kv_tokens"),
                        ({"moe_slots": 0}, "moe_slots"), ({"moe_slots": "most"}, "moe_slots"),
                        ({"kv": 5}, "kv")):
        r = rebuild(http, **body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = rebuild(http)
    assert r.status_code == 400 and "kv_tokens" in r.json()["error"]["message"]
    p = ctl(server, "cache", "--kv", str(10 ** 9), "--api-key", KEY)
    assert p.returncode != 0 and p.stdout == ""
    line, = p.stderr.strip().splitlines()
    assert line.startswith("moestream: error: ") and "HTTP 409" in line and "budget" in line
    time.sleep(1.2)
    stats = http.get("/v1/stats").json()
    assert stats["memory_plan"] == before and stats["kv"]["total_pages"] == 128
    assert stats["cache_rebuilds"]["refused"] == 3 and stats["cache_rebuilds"]["count"] == 4
    oai = openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0)
    assert oai.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3).usage.completion_tokens == 3


def test_auth(server):
    r = httpx.post(server["url"] + "/v1/admin/cache", json={"kv_tokens": 1024})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(server["url"] + "/v1/admin/cache", json={"kv_tokens": 1024},
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    p = ctl(server, "cache", "--kv", "1024", env={"MOESTREAM_API_KEY": ""})
    assert p.returncode != 0 and "HTTP 401" in p.stderr and "--api-key" in p.stderr
    p = ctl(server, "stats", "--api-key", "wrong")
    assert p.returncode != 0 and "HTTP 401" in p.stderr
    assert httpx.get(server["url"] + "/v1/stats", headers={"Authorization": f"Bearer {KEY}"}).json()[
        "kv"]["total_pages"] == 128  # nothing changed

"""Agent-like replay: TTFT per turn of a growing conversation, with and without the prefix cache.

A coding agent resends its whole conversation every turn: a long system prompt with tool definitions,
then user messages, tool outputs and the model's own answers. This script replays such a conversation
(made-up text, seeded) against the OpenAI chat API, streaming each turn and timing the first streamed
token, and reads `prompt_tokens_details.cached_tokens` from the usage. Each turn appends the model's
answer and a new tool output of --tool-words words, so the prompt grows by a few hundred tokens a turn.

--conversations N replays N such agents (different seeds) taking turns, so on a small KV pool each
evicts the others' pages: what the prefix cache's host tier (--prefix-cache-host-gb) is for.

By default it starts `moestream serve` once per --compare configuration (prefix cache on, then
--disable-prefix-cache), each with the same --serve-args, and prints one table; --server URL measures
one running server instead.

    PYTHONPATH=$PWD python benchmarks/agent_replay.py --turns 8 --out /tmp/replay.json
    PYTHONPATH=$PWD python benchmarks/agent_replay.py --serve-args "--model-path demo"
    PYTHONPATH=$PWD python benchmarks/agent_replay.py --conversations 2 --serve-args "--num-tokens 4096" \
        --compare "host=--prefix-cache-host-gb 1;cache=;no_cache=--disable-prefix-cache"
    PYTHONPATH=$PWD python benchmarks/agent_replay.py --server http://127.0.0.1:1919
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import time

import httpx

WORDS = ("read write file path line error test build config module import return value index list map "
         "request response server client token cache layer page state queue step batch kernel thread "
         "commit branch merge diff patch function class method argument option default result output").split()


def text(rng: random.Random, words: int) -> str:
    """`words` made-up words in short lines, like code or logs."""
    out, line = [], []
    for i in range(words):
        w = rng.choice(WORDS)
        line.append(w if rng.random() < 0.8 else f"{w}_{rng.randrange(1000)}")
        if len(line) >= rng.randrange(6, 14):
            out.append(" ".join(line))
            line = []
    return "\n".join(out + [" ".join(line)])


def system_prompt(rng: random.Random, words: int) -> str:
    tools = "\n".join(f"- tool_{i}(path, {rng.choice(WORDS)}): {text(rng, 20)}" for i in range(12))
    return f"You are a coding agent. Tools:\n{tools}\n\nProject notes:\n{text(rng, max(words - 300, 0))}"


def stream_turn(client: httpx.Client, url: str, model: str, messages: list, max_tokens: int) -> dict:
    """One streamed chat completion: TTFT (first content or reasoning delta), answer text, usage."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, parts, usage = None, [], {}
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices") or []:
                d = c.get("delta") or {}
                piece = (d.get("content") or "") + (d.get("reasoning_content") or "")
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(d.get("content") or "")
    total = time.perf_counter() - t0
    return {"ttft_s": ttft if ttft is not None else total, "total_s": total, "answer": "".join(parts),
            "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


def replay(url: str, args, script: list[dict] | None = None) -> list[dict]:
    """Play the conversation(s) against `url`. With `script` (the rows of an earlier configuration's replay), the
    model's answers are taken from it instead, so every configuration sends the same prompts, and only the turns
    in --sample-turns are sent (all when it is empty): the rest are history, not requests."""
    client = httpx.Client(timeout=args.timeout)
    answers = {(r["turn"], r["conversation"]): r["answer"] for r in script or [] if "turn" in r}
    sample = {int(t) for t in args.sample_turns.split(",") if t.strip()} if script is not None else set()
    model = client.get(f"{url}/v1/models").json()["data"][0]["id"]
    rngs = [random.Random(args.seed + c) for c in range(args.conversations)]
    convs = [[{"role": "system", "content": system_prompt(rng, args.system_words)},
              {"role": "user", "content": "Fix the failing test in the cache module. " + text(rng, 40)}]
             for rng in rngs]
    rows = []
    for turn in range(args.turns):
        for c, (rng, messages) in enumerate(zip(rngs, convs)):
            answer = answers.get((turn, c)) if script is not None else None
            if script is None or not sample or turn in sample:
                r = stream_turn(client, url, model, messages, args.max_tokens)
                r["turn"], r["conversation"] = turn, c
                if script is not None:  # same prompt as the scripted run: the same greedy answer is expected
                    r["same_answer"] = r["answer"] == answer
                    r["answer"] = answer
                rows.append(r)
                print(f"  turn {turn}{f' conversation {c}' if args.conversations > 1 else ''}: prompt "
                      f"{r['prompt_tokens']} tokens, cached {r['cached_tokens']}, TTFT {r['ttft_s']:.3f} s"
                      f"{'' if r.get('same_answer', True) else ' (answer differs from the first run)'}", flush=True)
                answer = r["answer"]
            messages.append({"role": "assistant", "content": answer or "ok"})
            messages.append({"role": "user",
                             "content": f"Tool output (tool_{turn % 12}):\n{text(rng, args.tool_words)}"})
    time.sleep(1.5)  # /v1/stats is a snapshot refreshed every 0.5 s
    stats = client.get(f"{url}/v1/stats").json().get("prefix_cache")
    if stats:
        rows.append({"prefix_cache": stats})
    return rows


def start_server(port: int, extra: list[str], log_path: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "moestream.cli", "serve", "--port", str(port), *extra]
    print("starting:", " ".join(shlex.quote(c) for c in cmd), flush=True)
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    deadline = time.time() + 900
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.terminate()
    raise SystemExit(f"the server did not become healthy in 900 s; see {log_path}")


def configurations(spec: str) -> list[tuple[str, list[str]]]:
    """"name=flags;name=flags" -> [(name, [flag, ...])]."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, _, flags = part.partition("=")
        out.append((name.strip(), shlex.split(flags)))
    return out


def run_local(args) -> dict:
    out, script = {}, None
    extra = shlex.split(args.serve_args)
    for name, flags in configurations(args.compare):
        proc = start_server(args.port, extra + flags, f"{args.log_prefix}_{name}.log")
        try:
            print(f"{name}:", flush=True)
            out[name] = replay(f"http://127.0.0.1:{args.port}", args, script)
            script = out[name] if script is None else script
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    return out


def table(out: dict, names: list[str]) -> str:
    """One row per (turn, conversation): prompt tokens, then cached tokens and TTFT of each configuration,
    and the last configuration's TTFT over each other's (the speed-up when the last is the cache-free one)."""
    runs = {n: {(r["turn"], r["conversation"]): r for r in out[n] if "turn" in r} for n in names}
    head = ["turn", "prompt tokens"] + [f"cached {n}" for n in names] + [f"TTFT {n} s" for n in names]
    head += [f"{names[-1]} / {n}" for n in names[:-1]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, first in runs[names[0]].items():
        rs = [runs[n].get(key) for n in names]
        turn = f"{key[0]}" if len({k[1] for k in runs[names[0]]}) == 1 else f"{key[0]}.{key[1]}"
        cells = [turn, str(first["prompt_tokens"])]
        cells += [str(r["cached_tokens"]) if r else "-" for r in rs]
        cells += [f"{r['ttft_s']:.3f}" if r else "-" for r in rs]
        last = rs[-1]
        cells += [f"{last['ttft_s'] / r['ttft_s']:.1f}x" if r and last else "-" for r in rs[:-1]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", default=None, help="measure this running server (one pass) instead of starting some")
    p.add_argument("--serve-args", default="", help="extra `moestream serve` arguments (e.g. --model-path ...)")
    p.add_argument("--port", type=int, default=19190)
    p.add_argument("--compare", default="cache=;no_cache=--disable-prefix-cache",
                   help="configurations to start, 'name=serve flags;...' (the last one is the baseline of the ratios)")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--conversations", type=int, default=1, help="agents taking turns, each with its own history")
    p.add_argument("--system-words", type=int, default=1500, help="system prompt + tools, in words (~1.3 tokens each)")
    p.add_argument("--tool-words", type=int, default=200, help="words of tool output added each turn")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens the model answers each turn")
    p.add_argument("--sample-turns", default="",
                   help="turns the later --compare configurations send (e.g. 0,8,16,23; all when empty): they replay "
                        "the first configuration's answers, so a long conversation is not prefilled whole every turn "
                        "by the cache-free baseline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--log-prefix", default="/tmp/agent_replay")
    p.add_argument("--out", default=None, help="write the per-turn figures as JSON here")
    args = p.parse_args()
    out = {"server": replay(args.server.rstrip("/"), args)} if args.server else run_local(args)
    out["args"] = vars(args)
    if not args.server:
        print(table(out, [n for n, _ in configurations(args.compare)]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

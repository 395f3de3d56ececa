"""`moestream chat`: a terminal chat, against a running server (--server URL) or in-process.

Reads one user message per stdin line and streams the reply. Commands: /reset (forget the
conversation), /exit (or end of input). Reasoning, when the model shows any, is printed dimmed.
"""
from __future__ import annotations

import json
import sys
from typing import Callable, Iterator

HELP = "Type a message and press Enter. /reset starts over, /exit quits."
_DIM, _RESET = "\033[2m", "\033[0m"


def run_chat(reply: Callable[[list[dict]], Iterator[tuple[str, str]]], stdin=None, stdout=None,
             system: str | None = None) -> int:
    """The read-eval-print loop; `reply(messages)` yields ("reasoning" | "content", text) pieces."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    tty = stdout.isatty()
    history: list[dict] = [{"role": "system", "content": system}] if system else []
    base = len(history)
    print(HELP, file=stdout, flush=True)
    while True:
        if tty:
            print("> ", end="", file=stdout, flush=True)
        line = stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        text = line.rstrip("\n")
        if text.strip() == "/reset":
            del history[base:]
            print("(conversation reset)", file=stdout, flush=True)
            continue
        if not text.strip():
            continue
        history.append({"role": "user", "content": text})
        answer = _print_reply(reply(history), stdout, tty)
        history.append({"role": "assistant", "content": answer})


def _print_reply(pieces: Iterator[tuple[str, str]], stdout, tty: bool) -> str:
    content: list[str] = []
    try:
        for kind, text in pieces:
            if kind == "reasoning":
                print(f"{_DIM}{text}{_RESET}" if tty else text, end="", file=stdout, flush=True)
            else:
                content.append(text)
                print(text, end="", file=stdout, flush=True)
    except Exception as e:  # a dropped connection should end this reply, not the chat
        print(f"\n[error: {e}]", file=stdout, flush=True)
    print(file=stdout, flush=True)
    return "".join(content)


# ---- against a server ------------------------------------------------------------------------
class ServerError(Exception):
    """The server could not be reached or refused the request; the message says which and why."""


def remote_reply(server: str, api_key: str | None = None, max_tokens: int = 512, temperature: float = 0.7):
    """Standard library only (urllib): `pip install moestream` has no HTTP client dependency."""
    base = server.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with open_url(f"{base}/models", headers, None, timeout=10.0) as r:
        model = json.load(r)["data"][0]["id"]

    def reply(messages: list[dict]) -> Iterator[tuple[str, str]]:
        body = {"model": model, "messages": messages, "stream": True, "max_tokens": max_tokens,
                "temperature": temperature}
        with open_url(f"{base}/chat/completions", headers, body, timeout=None) as r:
            for raw in r:
                line = raw.decode("utf-8").rstrip("\r\n")
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise ServerError(chunk["error"].get("message"))
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {})
                    if delta.get("reasoning_content"):
                        yield "reasoning", delta["reasoning_content"]
                    if delta.get("content"):
                        yield "content", delta["content"]

    return reply


def open_url(url: str, headers: dict, body: dict | None, timeout: float | None):
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={**headers, "Content-Type": "application/json"})
    try:
        return urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        raise ServerError(f"{url}: HTTP {e.code}: {_error_message(e)}" + (
            "; pass the server's key with --api-key or MOESTREAM_API_KEY" if e.code == 401 else "")) from None
    except urllib.error.URLError as e:
        raise ServerError(f"cannot reach {url}: {e.reason}; is the server running?") from None
    except OSError as e:  # timeouts, resets
        raise ServerError(f"cannot reach {url}: {e}") from None


def _error_message(e) -> str:
    try:
        body = json.loads(e.read())
        return body["error"]["message"]
    except Exception:  # not our JSON error body: the reason phrase is all there is
        return str(e.reason)


# ---- in-process ------------------------------------------------------------------------------
def local_reply(llm, max_tokens: int = 512, temperature: float = 0.7):
    """Replies from an in-process LLM through the step loop the server's engine process runs
    (`LLM.llm_engine`), its text split by the reasoning parser the server would pick for this template."""
    from ..core import MoestreamError, SamplingParams, next_request_id
    from ..scheduler.request import Request
    from .parsers import pick_reasoning_parser, prompt_opens_reasoning

    tok, engine = llm.tokenizer, llm.llm_engine
    parser_cls = pick_reasoning_parser("auto", tok.chat_template)

    def reply(messages: list[dict]) -> Iterator[tuple[str, str]]:
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
        opens = prompt_opens_reasoning(prompt)
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                reasoning_open=opens and parser_cls.name != "none")
        req = Request(next_request_id(), tok.encode(prompt), params)
        parser = parser_cls(starts_in_reasoning=opens)
        engine.add_request(req, keep_markup=True)  # the parser reads the <think> tags
        try:
            while req.finish_reason is None:
                for out in engine.step():
                    if out.request is req and out.error is not None:  # it failed alone: say so (_print_reply)
                        raise MoestreamError(out.error)
                    if out.request is req and out.text_delta:
                        yield from _pieces(*parser.feed(out.text_delta))
            yield from _pieces(*parser.finish())
        finally:
            engine.abort(req.id)  # Ctrl-C mid-reply frees its caches

    return reply


def _pieces(reasoning: str, content: str) -> Iterator[tuple[str, str]]:
    if reasoning:
        yield "reasoning", reasoning
    if content:
        yield "content", content


def main(server: str | None, model_path: str | None, engine_options: dict, api_key: str | None,
         max_tokens: int, temperature: float, system: str | None) -> int:
    from ..core import MoestreamError

    if server:
        try:
            reply = remote_reply(server, api_key, max_tokens, temperature)
        except ServerError as e:
            raise MoestreamError(str(e)) from None
        return run_chat(reply, system=system)
    from ..llm import LLM
    from .launch import resolve_model

    folder, _, _ = resolve_model(model_path)
    llm = LLM(folder, **engine_options)
    return run_chat(local_reply(llm, max_tokens, temperature), system=system)

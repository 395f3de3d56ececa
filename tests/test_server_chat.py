"""`moestream chat`'s loop: history, /reset, /exit, streaming pieces printed as they come."""
from __future__ import annotations

import io

from moestream.server.chat import run_chat


def test_chat_loop_history_reset_exit():
    seen = []

    def reply(messages):
        seen.append([dict(m) for m in messages])
        yield "reasoning", "(thinking)"
        yield "content", "Hi "
        yield "content", "there"

    out = io.StringIO()
    rc = run_chat(reply, stdin=io.StringIO("hello\nmore\n/reset\nfresh\n/exit\nnever\n"), stdout=out, system="sys")
    assert rc == 0
    assert [len(s) for s in seen] == [2, 4, 2]  # system+user, then +assistant+user, then after /reset
    assert seen[1][2] == {"role": "assistant", "content": "Hi there"}  # reasoning is not sent back
    assert seen[2] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "fresh"}]
    assert "(conversation reset)" in out.getvalue() and "Hi there" in out.getvalue()


def test_chat_survives_a_failed_reply():
    def reply(messages):
        raise RuntimeError("HTTP 503")
        yield  # pragma: no cover

    out = io.StringIO()
    assert run_chat(reply, stdin=io.StringIO("hello\n"), stdout=out) == 0
    assert "[error: HTTP 503]" in out.getvalue()


def test_local_reply_splits_reasoning_like_the_server(tmp_path):
    """In-process chat runs the engine's step loop with the server's markup-keeping text and reasoning
    parser: a scripted "<think>...</think>answer" comes back as reasoning and content pieces."""
    from moestream.demo import write_demo_checkpoint
    from moestream.llm import LLM
    from moestream.server.chat import local_reply

    llm = LLM(write_demo_checkpoint(tmp_path / "demo"), device="cpu", dtype="float32")
    tok = llm.tokenizer
    script = tok.encode("<think>\nlet me see\n</think>\n\nHi there") + [tok.eos_token_ids[0]]
    real, calls = llm.engine.forward, []

    def scripted(batch):  # one request, one sampling row a step: force the script's next token
        out = real(batch).clone()
        out[-1] = -1e4
        out[-1, script[len(calls)]] = 0.0
        calls.append(1)
        return out

    llm.engine.forward = scripted
    pieces = list(local_reply(llm, max_tokens=50, temperature=0.0)([{"role": "user", "content": "hello"}]))
    assert "".join(t for k, t in pieces if k == "reasoning").strip() == "let me see"
    assert "".join(t for k, t in pieces if k == "content") == "Hi there"
    assert len(calls) == len(script) and not llm.scheduler.has_work()


def test_local_reply_reports_a_request_that_failed_alone(tmp_path, monkeypatch):
    """The step loop ends a request whose own text fails (its detokenizer raised) with "error" instead of
    failing the step; in-process chat shows that error as it showed the step's exception before, rather
    than ending the reply as if it were complete."""
    from moestream.demo import write_demo_checkpoint
    from moestream.llm import LLM
    from moestream.server.chat import local_reply
    from moestream.tokenizer import IncrementalDetokenizer

    llm = LLM(write_demo_checkpoint(tmp_path / "demo"), device="cpu", dtype="float32")
    real, calls = IncrementalDetokenizer.add, []

    def flaky(self, tok):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("detokenizer broke")
        return real(self, tok)

    monkeypatch.setattr(IncrementalDetokenizer, "add", flaky)
    out = io.StringIO()
    assert run_chat(local_reply(llm, max_tokens=20, temperature=0.0), stdin=io.StringIO("hello\n"), stdout=out) == 0
    assert "[error: internal error: RuntimeError: detokenizer broke]" in out.getvalue()
    assert len(calls) == 2 and not llm.scheduler.has_work()

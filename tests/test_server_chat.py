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

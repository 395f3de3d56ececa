"""Front-end rules of issue 16 that need no engine: where the API key comes from, /v1/stats and
/metrics never waiting on the engine, a long prompt never stopping the event loop while the engine is busy,
and tools a chat template cannot render being refused."""
from __future__ import annotations

import asyncio
import time

import pytest
from fastapi.testclient import TestClient

from fake_engine import FakeEngine
from moestream.cli import api_key, build_parser
from moestream.core import MoestreamError
from moestream.demo_tokenizer import build_tokenizer
from moestream.server.app import create_app
from moestream.server.generation import ApiError, ServerState, render_chat
from moestream.server.metrics import Metrics
from moestream.server.parsers import NoReasoningParser, NoToolParser
from moestream.tokenizer import Tokenizer


def _serve_args(*extra: str):
    return build_parser().parse_args(["serve", *extra])


def test_api_key_sources(tmp_path, monkeypatch):
    monkeypatch.delenv("MOESTREAM_API_KEY", raising=False)
    assert api_key(_serve_args()) is None
    monkeypatch.setenv("MOESTREAM_API_KEY", "from-env")
    assert api_key(_serve_args()) == "from-env"
    f = tmp_path / "key"
    f.write_text("from-file\n")
    assert api_key(_serve_args("--api-key-file", str(f))) == "from-file"
    assert api_key(_serve_args("--api-key", "flag")) == "flag"
    f.write_text("\n")
    with pytest.raises(MoestreamError, match="empty"):
        api_key(_serve_args("--api-key-file", str(f)))
    with pytest.raises(MoestreamError, match="cannot read"):
        api_key(_serve_args("--api-key-file", str(tmp_path / "missing")))
    with pytest.raises(MoestreamError, match="not both"):
        api_key(_serve_args("--api-key", "a", "--api-key-file", str(f)))


@pytest.mark.parametrize("port", ["0", "99999", "http"])
def test_bad_port_is_an_argument_error(port, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--port", port])
    assert "--port" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d)
    return Tokenizer.from_pretrained(d)


class StuckEngine(FakeEngine):
    """An engine busy in a long step: stats are answered after a while."""

    calls = 0

    async def stats(self):
        StuckEngine.calls += 1
        if StuckEngine.calls > 1:
            await asyncio.sleep(30)
        return await super().stats()


def test_stats_and_metrics_never_wait_on_the_engine(tokenizer):
    state = ServerState(engine=StuckEngine(tokenizer), tokenizer=tokenizer, model_name="m",
                        tool_parser_cls=NoToolParser, reasoning_parser_cls=NoReasoningParser, metrics=Metrics("m"))
    with TestClient(create_app(state)) as http:  # with: runs the lifespan, i.e. the snapshot task
        deadline = time.time() + 5
        while not state.snapshot and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # the next refresh is now stuck in the engine
        t0 = time.perf_counter()
        s = http.get("/v1/stats").json()
        assert http.get("/metrics").status_code == 200
        assert time.perf_counter() - t0 < 2.0
        assert s["kv"]["total_pages"] == 8 and s["snapshot_age_s"] >= 0.9  # the last snapshot, honestly aged


class NoToolsTemplate:
    """A tokenizer whose chat template ignores `tools` (as SmolLM2's does)."""

    chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    def apply_chat_template(self, messages, tools=None, tokenize=False, add_generation_prompt=True, **kw):
        return "".join(m["content"] for m in messages)


def test_tools_a_template_ignores_are_refused():
    state = ServerState(engine=None, tokenizer=NoToolsTemplate(), model_name="m", tool_parser_cls=NoToolParser,
                        reasoning_parser_cls=NoReasoningParser)
    msgs = [{"role": "user", "content": "hi"}]
    assert render_chat(state, msgs, None, {}) == "hi"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(ApiError) as e:
        render_chat(state, msgs, tools, {})
    assert e.value.status == 400 and e.value.param == "tools"


def test_a_long_prompt_never_blocks_the_event_loop_while_the_engine_is_busy():
    """The engine reads its pipe between steps only. A message bigger than the pipe holds (a long prompt's
    ids) used to be written from the event loop, which stopped there, and every other client with it, until
    the engine's step ended; now a writer thread waits for the pipe and the message arrives whole."""
    import multiprocessing
    import threading

    from moestream.core import SamplingParams
    from moestream.server.engine_client import EngineClient
    from moestream.server.engine_proc import EngineArgs
    from moestream.server.messages import Abort, Add

    engine_end, client_end = multiprocessing.Pipe(duplex=False)  # nobody reads it yet: the engine is busy
    client = EngineClient(EngineArgs("unused"))
    client._to_engine, client.alive = client_end, True
    waited = []

    async def main():
        gen = client.generate("long", list(range(300_000)), SamplingParams())
        first = asyncio.ensure_future(gen.__anext__())
        t0 = time.perf_counter()
        for _ in range(10):
            await asyncio.sleep(0.01)  # the loop goes on serving
        waited.append(time.perf_counter() - t0)
        first.cancel()  # the client leaves: its Abort follows the Add
        await asyncio.gather(first, return_exceptions=True)
        await gen.aclose()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    thread.join(5)
    stuck = thread.is_alive()
    got = [engine_end.recv(), engine_end.recv()]  # the engine's step ends: it reads them, in order
    thread.join(5)
    assert not stuck and waited and waited[0] < 2.0
    assert isinstance(got[0], Add) and got[0].prompt_ids == list(range(300_000))
    assert isinstance(got[1], Abort) and got[1].rid == "long"

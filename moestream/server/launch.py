"""`moestream serve`: resolve the model, start the engine process, run uvicorn, stop both cleanly.

Shutdown on SIGINT/SIGTERM, at any moment:
- while the model loads: the engine process is terminated at once and serve returns;
- while serving: every request in flight ends with an error (streams get a final error event), uvicorn
  stops accepting and drains (at most a few seconds), the port closes, then the engine is told to stop
  (terminated, then killed, if it does not).
Exit status: 0 after a signal, 1 when the engine process died while serving (the front end does not
keep the port to answer 503 forever: a supervisor sees the exit and restarts the whole server).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from pathlib import Path

from ..core import ConfigError, MoestreamError

log = logging.getLogger("moestream.server")

DEMO_BANNER = """
==========================================================================================
  --model-path demo: serving the BUILT-IN DEMO model (tiny Qwen3.5-MoE, RANDOM WEIGHTS).
  Its replies are gibberish; it is here to try the API. Folder: {folder}
  Serve a real model with: moestream serve --model-path Qwen/Qwen3-30B-A3B
==========================================================================================
"""


def resolve_model(model_path: str | None, revision: str | None = None) -> tuple[Path, str, bool]:
    """(local folder, default served name, is_demo). No model path: the default model (SmolLM2);
    "demo": the random-weight MoE demo."""
    from ..models.checkpoint import DEFAULT_MODEL_NAME, DEMO_MODEL, resolve_model_path

    folder = resolve_model_path(model_path or None, revision)
    if not model_path:
        log.info("no --model-path: serving the default model %s from %s", DEFAULT_MODEL_NAME, folder)
        return folder, DEFAULT_MODEL_NAME, False
    if model_path == DEMO_MODEL:
        from ..demo import DEMO_NAME

        log.warning(DEMO_BANNER.format(folder=folder))
        return folder, DEMO_NAME, True
    name = model_path.rstrip("/") if "/" in model_path and not Path(model_path).expanduser().exists() \
        else Path(model_path).expanduser().resolve().name
    return folder, name, False


def check_port_free(host: str, port: int) -> None:
    """Fail in a second with a clear message instead of after loading the model."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise MoestreamError(f"cannot listen on {host}:{port}: {e.strerror}; is another server running? "
                                 "pick another --port") from None


def build_state(folder: Path, served_name: str, engine, api_key: str | None, tool_parser: str,
                reasoning_parser: str, limits=None, metrics_public: bool = False):
    from ..models.loader import load_tokenizer
    from .generation import Limits, ServerState
    from .metrics import Metrics
    from .parsers import pick_reasoning_parser, pick_tool_parser

    try:
        tokenizer = load_tokenizer(folder)
    except MoestreamError:
        raise
    except Exception as e:  # a corrupt tokenizer.json / template: one line, not a traceback
        raise ConfigError(f"cannot read the tokenizer in {folder}: {type(e).__name__}: {e}") from None
    template = tokenizer.chat_template if tokenizer is not None else None
    try:
        tool_cls = pick_tool_parser(tool_parser, template)
        reasoning_cls = pick_reasoning_parser(reasoning_parser, template)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    log.info("tool-call parser: %s, reasoning parser: %s (%s)", tool_cls.name, reasoning_cls.name,
             "from the chat template" if "auto" in (tool_parser, reasoning_parser) else "as asked")
    return ServerState(engine=engine, tokenizer=tokenizer, model_name=served_name, tool_parser_cls=tool_cls,
                       reasoning_parser_cls=reasoning_cls, api_key=api_key or None, metrics=Metrics(served_name),
                       limits=limits or Limits(), metrics_public=metrics_public)


class Interrupted(BaseException):
    """SIGINT/SIGTERM before serving began (while resolving or loading the model). A BaseException, like
    KeyboardInterrupt, so that no `except Exception` on the way swallows it."""

    def __init__(self, sig: int):
        super().__init__(signal.Signals(sig).name)
        self.sig = sig


def _raise_on_signal(sig, _frame):
    raise Interrupted(sig)


def serve(model_path: str | None, engine_options: dict, host: str = "127.0.0.1", port: int = 1919,
          served_model_name: str | None = None, api_key: str | None = None, tool_call_parser: str = "auto",
          reasoning_parser: str = "auto", decode_log_interval: int = 40, log_level: str = "info",
          limits=None, metrics_public: bool = False, header_timeout: float = 10.0) -> int:
    from .engine_client import EngineClient
    from .engine_proc import EngineArgs

    check_port_free(host, port)
    for sig in (signal.SIGINT, signal.SIGTERM):  # until serving starts, a signal ends start-up at once
        signal.signal(sig, _raise_on_signal)
    engine = None
    try:
        folder, default_name, is_demo = resolve_model(model_path, engine_options.get("revision"))
        engine = EngineClient(EngineArgs(str(folder), engine_options, decode_log_interval,
                                         logging.getLogger().getEffectiveLevel()))
        state = build_state(folder, served_model_name or default_name, engine, api_key, tool_call_parser,
                            reasoning_parser, limits, metrics_public)
        info = engine.start()
        # Our own handlers stay installed around uvicorn's: uvicorn re-raises the signal it caught once
        # it has shut down, and the default SIGTERM action would kill us before the engine is stopped.
        # One that comes before uvicorn installs its handlers is kept and honoured once it has.
        caught: list[int] = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda sig, _frame: caught.append(sig))
    except Interrupted as e:
        log.info("%s while starting: stopping", e)
        if engine is not None:
            engine.shutdown(timeout=0)
        return 0 if e.sig == signal.SIGTERM else 130
    try:
        log.info("engine ready (pid %d): %s, max_seq_len %d, KV %d tokens%s", info["pid"], info["architecture"],
                 info["max_seq_len"], info["kv_tokens"],
                 f" per rank, {info['tp_size']} tensor-parallel ranks" if info.get("tp_size", 1) > 1 else "")
        server = _make_server(state, engine, host, port, log_level, header_timeout, caught)
        log.info("serving %s on http://%s:%d%s", state.model_name, host, port,
                 " (random-weight demo)" if is_demo else "")
        server.run()
        if server.engine_died:
            log.error("exiting because the engine process died (restart the server)")
            return 1
        return 0 if server.started else 1
    finally:
        engine.shutdown(timeout=2.0)
        log.info("engine stopped; bye")


def _make_server(state, engine, host: str, port: int, log_level: str, header_timeout: float, caught: list[int]):
    import uvicorn

    from .app import create_app

    class Server(uvicorn.Server):
        engine_died = False

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if caught:  # SIGTERM/SIGINT between loading and now: stop as if it came now
                self.handle_exit(caught[0], None)

        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            # streams in flight end now with an error event instead of being cut at the drain timeout
            with contextlib.suppress(RuntimeError):
                asyncio.get_running_loop().call_soon_threadsafe(engine.fail_all, "the server is shutting down", 503)

    app = create_app(state, lifespan=_lifespan(engine))
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=3,
                            access_log=False, http=timed_h11(header_timeout))
    server = Server(config)

    def died():
        server.engine_died = True
        server.should_exit = True

    engine.on_death = died
    return server


def timed_h11(header_timeout: float):
    """uvicorn's h11 protocol, closing a connection whose request line and headers have not all arrived
    `header_timeout` seconds after it opened (or after its last response): uvicorn has no such limit."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11Protocol(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm_header_timer()

        def on_response_complete(self):
            super().on_response_complete()
            self._arm_header_timer()

        def _arm_header_timer(self):
            self.loop.call_later(header_timeout, self._header_deadline, self.cycle)

        def _header_deadline(self, cycle):
            if self.cycle is cycle and self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return TimedH11Protocol


def _lifespan(engine):
    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.attach(asyncio.get_running_loop())
        yield

    return lifespan

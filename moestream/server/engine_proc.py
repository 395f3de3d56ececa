"""The engine process: owns the model, the caches and the step loop (`engine/llm_engine.LLMEngine`, as
`LLM.generate` does); the HTTP front end talks to it through two one-way pipes carrying the dataclasses of
`server/messages.py` (Add / Abort / StatsQuery / Rebuild / Shutdown in; Ready or StartupError, then Outputs
/ Failed / Stats / Reply out).

Loop: pull every pending message, run one step, push the step's deltas as one message. A
rebuild (live resize of the KV pool and expert slot cache) runs between two steps, so nothing is admitted
while it runs.
The process ends with its parent: it polls the parent pid and the pipe (EOF), and on Linux asks the
kernel for SIGTERM when the parent dies, so no orphan keeps VRAM or a port. With --tp-size N this
process is rank 0 and starts ranks 1..N-1 (moestream.parallel); they end when it does, and it exits
when one of them dies.
"""
from __future__ import annotations

import collections
import logging
import os
import signal
import time
from dataclasses import dataclass, field

from ..core import die_with_parent
from .messages import (Abort, Add, Delta, Failed, Outputs, Ready, Rebuild, Reply, Shutdown, StartupError, Stats,
                       StatsQuery)

log = logging.getLogger("moestream.engine")


@dataclass(frozen=True)
class EngineArgs:
    model_dir: str
    engine_options: dict = field(default_factory=dict)
    decode_log_interval: int = 40
    log_level: int = logging.INFO


def engine_main(args: EngineArgs, inbox, outbox, parent_pid: int) -> None:
    """Entry point of the spawned engine process."""
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the front end stops us
    signal.signal(signal.SIGTERM, _exit_now)  # while loading there is nothing to finish: go at once
    if args.engine_options.get("tp_size", 1) > 1:
        import multiprocessing

        from ..parallel import exit_with_group

        # this process is rank 0 and spawns the others, which a daemonic process may not; it still
        # ends with the front end (the parent-death signal and the parent pid poll above)
        multiprocessing.current_process().daemon = False
        exit_with_group()
    try:
        loop = EngineLoop(args, outbox)
    except Exception as e:  # a bad model path/config must reach the user as one readable line
        # the front end prints the one line; the traceback is for --log-level debug (a corrupt folder
        # would otherwise bury the message under 20-30 lines of loader internals)
        log.debug("engine start-up failed", exc_info=True)
        outbox.send(StartupError(f"{type(e).__name__}: {e}" if not _is_user_error(e) else str(e)))
        return
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))  # serving: leave the loop cleanly
    outbox.send(Ready(loop.info()))
    try:
        loop.run(inbox, parent_pid, stop)
    finally:
        loop.llm.close()  # with --tp-size: stops the other ranks
        # Nothing is left to save; interpreter teardown (torch's) took seconds of CPU on a busy box,
        # which a SIGTERM'd server would spend waiting on us.
        logging.shutdown()
        os._exit(0)


def _exit_now(*_) -> None:
    raise SystemExit(0)


def _is_user_error(e: Exception) -> bool:
    from ..core import MoestreamError

    return isinstance(e, MoestreamError)


class EngineLoop:
    def __init__(self, args: EngineArgs, outbox):
        from ..llm import LLM

        self.args = args
        self.outbox = outbox
        self.llm = LLM(args.model_dir, **args.engine_options)
        self.llm_engine = self.llm.llm_engine
        self.scheduler = self.llm_engine.scheduler  # read for occupancy and failure isolation
        self.started = time.time()
        # (time, prefill tokens, decode tokens) of recent steps, for the sliding-window throughput.
        self.window: collections.deque = collections.deque()
        self.totals = {"prompt_tokens": 0, "generated_tokens": 0, "finished": 0, "aborted": 0, "failed": 0}
        self.decode_steps = 0
        self.interval = {"tokens": 0, "seconds": 0.0}
        self.rebuilds = {"count": 0, "refused": 0, "last": None}

    def info(self) -> dict:
        eng = self.llm.engine
        kv = self.scheduler.kv
        return {"max_seq_len": eng.max_seq_len, "kv_tokens": kv.num_pages * kv.page_size, "page_size": kv.page_size,
                "device": str(eng.device), "dtype": str(eng.dtype).replace("torch.", ""),
                "architecture": eng.cfg.architecture, "max_running_requests": eng.ecfg.max_running_requests,
                "vocab_size": eng.cfg.vocab_size, "expert_backend": getattr(eng.runtime, "name", "?"),
                "pid": os.getpid(), "tp_size": eng.ecfg.tp_size}

    # ---- the loop --------------------------------------------------------------------------
    def run(self, inbox, parent_pid: int, stop: dict) -> None:
        while not stop["now"]:
            if os.getppid() != parent_pid:
                log.warning("the front end is gone; engine exiting")
                return
            idle = not self.llm_engine.has_work()
            try:
                # Block briefly when idle (no busy loop); never block while requests are running.
                if inbox.poll(0.2 if idle else 0) and not self._drain(inbox):
                    break
            except (EOFError, OSError):
                log.warning("the front end closed the pipe; engine exiting")
                break
            if self.llm_engine.has_work():
                self._step()
        log.info("engine stopped")

    def _drain(self, inbox) -> bool:
        while inbox.poll(0):
            msg = inbox.recv()
            if isinstance(msg, Shutdown):
                return False
            if isinstance(msg, Add):
                self._add(msg)
            elif isinstance(msg, Abort):
                if self.llm_engine.abort(msg.rid):
                    self.totals["aborted"] += 1
            elif isinstance(msg, StatsQuery):
                self.outbox.send(Stats(msg.sid, self.stats()))
            elif isinstance(msg, Rebuild):
                self.outbox.send(Reply(msg.sid, **self._rebuild(msg)))
            else:
                log.error("unexpected message from the front end: %r", msg)
        return True

    def _rebuild(self, msg: Rebuild) -> dict:
        """Resize the KV pool and the expert slot cache now, between steps: {"data": report} or
        {"error", "status"} (400: a value this server cannot take, 409: it does not fit; nothing changed)."""
        from ..core import MoestreamError, RequestError

        try:
            report = self.llm_engine.resize_caches(msg.kv_tokens, msg.moe_slots)
        except MoestreamError as e:
            self.rebuilds["refused"] += 1
            log.warning("cache rebuild refused: %s", e)
            return {"error": str(e), "status": 400 if isinstance(e, RequestError) else 409}
        except Exception as e:  # a bug mid-way: the caches may be half-resized, say so loudly
            log.exception("cache rebuild failed")
            return {"error": f"internal error: {type(e).__name__}: {e}", "status": 500}
        plan = self.llm.engine.plan
        data = {**report, "plan": plan.as_dict(), "plan_text": plan.describe(), "info": self.info()}
        self.rebuilds["count"] += 1
        self.rebuilds["last"] = {k: v for k, v in data.items() if k not in ("plan", "plan_text", "info")}
        return {"data": data}

    def _add(self, msg: Add) -> None:
        from ..core import MoestreamError
        from ..scheduler.request import Request

        rid, params = msg.rid, msg.params
        try:
            params.validate()  # the front end validated it; a request that slipped past fails alone
            req = Request(rid, list(msg.prompt_ids), params, parent=msg.parent)
            self.llm_engine.add_request(req, keep_markup=msg.keep_markup)
        except MoestreamError as e:
            self.outbox.send(Failed(rid, str(e), 400))
            return
        except Exception as e:  # the front end validates first; whatever slips through fails this request only
            log.exception("could not add request %s", rid)
            self.totals["failed"] += 1
            self.outbox.send(Failed(rid, f"internal error: {type(e).__name__}: {e}", 500))
            return
        self.totals["prompt_tokens"] += len(req.prompt_ids)

    def _step(self) -> None:
        try:
            outputs = self.llm_engine.step()
        except Exception as e:  # OOM or a bug: find the request(s) it belongs to, keep serving the others
            self._step_failed(e)
            return
        items, failed = [], []
        for o in outputs:
            if o.error is not None:  # its own work failed: it alone ends, after the tokens it was sent before
                failed.append(Failed(o.request.id, o.error, 400 if o.refused else 500))
                continue
            reason = o.request.finish_reason if o.finished else None
            stop_str = getattr(o.request.detok, "matched_stop", None) if o.finished else None
            lp = [[o.new_token, o.logprobs[0], o.logprobs[1]]] if o.logprobs is not None else None
            items.append((o.request.id, Delta(o.text_delta, 1, reason, stop_str, lp, o.prompt_logprobs,
                                              o.request.cached_tokens or 0)))
            if o.finished:
                self.totals["finished"] += 1
        self.totals["generated_tokens"] += len(items)
        if items:
            self.outbox.send(Outputs(items))
        for msg in failed:
            self.totals["failed"] += msg.status == 500  # as _add counts them: a refusal is not a failure
            self.outbox.send(msg)
        self._account(self.llm_engine.last_step)

    def _step_failed(self, e: Exception) -> None:
        """A batch of several requests is retried one request at a time (the scheduler's suspects);
        a request that fails alone is the cause and fails with an error, nothing else does."""
        import torch

        oom = isinstance(e, torch.OutOfMemoryError)
        if oom and torch.cuda.is_available():
            torch.cuda.empty_cache()
        if len(self.scheduler.running) > 1:
            log.warning("step failed (%s: %s); retrying its %d requests one at a time", type(e).__name__, e,
                        len(self.scheduler.running))
            self.scheduler.isolate_running()
            return
        log.exception("step failed; failing the request that ran alone")
        for req in self.scheduler.abort_all():
            self.totals["failed"] += 1
            msg = ("out of memory while computing this request; retry with a shorter prompt or fewer "
                   "concurrent requests" if oom else f"internal error: {type(e).__name__}: {e}")
            self.outbox.send(Failed(req.id, msg, 503 if oom else 500))

    # ---- observability ---------------------------------------------------------------------
    def _account(self, st: dict) -> None:
        now = time.time()
        self.window.append((now, st.get("prefill_tokens", 0), st.get("decode", 0)))
        while self.window and now - self.window[0][0] > 5.0:
            self.window.popleft()
        if st.get("prefill_tokens"):
            self._log_prefill(st)
        elif st.get("decode"):
            self.decode_steps += 1
            self.interval["tokens"] += st["decode"]
            self.interval["seconds"] += st["seconds"]
            if self.decode_steps % max(self.args.decode_log_interval, 1) == 0:
                self._log_decode(st)

    def _usage(self) -> tuple[dict, str]:
        s = self.llm_engine.stats()
        extra = ""
        if self.scheduler.state.num_slots and self.llm.engine.cfg.linear_attention_layers:
            st = s["state"]
            extra = f"#state-slot: {st['used_slots']}/{st['total_slots']}, "
        return s, extra

    def _log_prefill(self, st: dict) -> None:
        s, extra = self._usage()
        tput = st["prefill_tokens"] / st["seconds"] if st["seconds"] else 0.0
        log.info("Prefill batch, #new-seq: %d, #new-token: %d, #decode-seq: %d, token usage: %.2f, %s"
                 "#running-req: %d, #queue-req: %d, input throughput (token/s): %.2f",
                 st.get("prefill_seqs", 0), st["prefill_tokens"], st.get("decode", 0), s["kv"]["usage"], extra,
                 s["running"], s["queued"], tput)

    def _log_decode(self, st: dict) -> None:
        s, extra = self._usage()
        iv = self.interval
        tput = iv["tokens"] / iv["seconds"] if iv["seconds"] else 0.0
        self.interval = {"tokens": 0, "seconds": 0.0}
        used_tokens = sum(r.num_tokens for r in self.scheduler.running)
        rt = self._runtime_stats() or {}
        # the recent window (last 64 decode steps) says what the cache does now; the total hides changes
        recent = rt.get("recent_hit_rate")
        hit = float(recent) if isinstance(recent, (int, float)) else _hit_rate(rt)
        hit_txt = f", expert hit rate: {hit:.2f}" if hit is not None else ""
        log.info("Decode batch, #running-req: %d, #token: %d, token usage: %.2f, %s#queue-req: %d, "
                 "gen throughput (token/s): %.2f%s", s["running"], used_tokens, s["kv"]["usage"], extra,
                 s["queued"], tput, hit_txt)

    def _runtime_stats(self) -> dict | None:
        rt = getattr(self.llm.engine, "runtime", None)
        try:
            return rt.stats() if rt is not None and hasattr(rt, "stats") else None
        except Exception:  # stats are advisory; a broken one must not stop serving
            log.debug("runtime.stats() failed", exc_info=True)
            return None

    def stats(self) -> dict:
        s = self.llm_engine.stats()
        span = (self.window[-1][0] - self.window[0][0]) if len(self.window) > 1 else 0.0
        span = max(span, 1.0)
        s["throughput"] = {"prefill_tps": sum(w[1] for w in self.window) / span,
                           "decode_tps": sum(w[2] for w in self.window) / span}
        s["totals"] = dict(self.totals)
        rt = self._runtime_stats()
        if rt is not None:
            s["experts"] = rt
            hit = _hit_rate(rt)
            if hit is not None:
                s["experts_hit_rate"] = hit
        plan = getattr(self.llm.engine, "plan", None)
        if plan is not None:
            s["memory_plan"] = plan if isinstance(plan, dict) else _plain(plan)
        s["cache_rebuilds"] = dict(self.rebuilds)
        graphs = getattr(self.llm.engine, "graphs", None)
        s["cuda_graphs"] = graphs.as_dict() if graphs is not None else None
        host = getattr(self.llm.engine, "host_memory", None)
        if host:
            from ..moe.hardware import process_memory

            s["host_memory"] = {"at_load": host, "now": process_memory()}
        s["uptime_s"] = time.time() - self.started
        return s


def _hit_rate(stats: dict | None) -> float | None:
    """The expert cache hit rate from runtime.stats(), in whichever shape the runtime reports it."""
    if not isinstance(stats, dict):
        return None
    if isinstance(stats.get("hit_rate"), (int, float)):
        return float(stats["hit_rate"])
    total = stats.get("total") if isinstance(stats.get("total"), dict) else {}
    hits, misses = total.get("hits"), total.get("misses")
    if isinstance(hits, (int, float)) and isinstance(misses, (int, float)) and hits + misses > 0:
        return hits / (hits + misses)
    return None


def _plain(obj):
    """A dataclass-like plan as JSON-able data (best effort; it is informational)."""
    import dataclasses

    if dataclasses.is_dataclass(obj):
        return {k: _plain(v) for k, v in dataclasses.asdict(obj).items()}
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj if isinstance(obj, (int, float, str, bool, type(None))) else str(obj)

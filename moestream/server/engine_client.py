"""The front end's handle on the engine process: spawn it, stream deltas back per request, abort.

One reader thread blocks on the engine's pipe and hands each message to the asyncio loop
(`call_soon_threadsafe`); every request has its own asyncio.Queue. Messages to the engine are pickled
where they are sent (the loop thread, or the main thread at shutdown) and written by one writer thread, in
order: the engine reads its pipe only between steps, and a write that fills the pipe (a long prompt, or
several) must not stop the event loop, and every other client with it, until the engine's step ends.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import os
import queue
import threading
from multiprocessing.reduction import ForkingPickler
from typing import AsyncIterator

from ..core import MoestreamError
from .engine_proc import EngineArgs, engine_main
from .messages import (Abort, Add, Delta, Failed, Outputs, Ready, Rebuild, Reply, Shutdown, StartupError, Stats,
                       StatsQuery)

log = logging.getLogger("moestream.server")


class EngineError(Exception):
    """A request the engine could not serve; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.message, self.status = message, status


_GONE = object()  # queue sentinel: the client disconnected


class EngineClient:
    def __init__(self, args: EngineArgs):
        self.args = args
        self.info: dict = {}
        self.alive = False
        self._queues: dict[str, asyncio.Queue] = {}
        self._waiters: dict[int, asyncio.Future] = {}  # stats and admin calls waiting for their reply
        self._ids = itertools.count()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # pickled messages for the writer thread
        self._writer_started = False
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._proc = None
        self.on_death = None  # called on the loop when the engine process dies while serving

    # ---- life cycle ------------------------------------------------------------------------
    def start(self) -> dict:
        """Spawn the engine and wait until its model is loaded (raises MoestreamError on failure)."""
        ctx = mp.get_context("spawn")  # fork would copy torch/CUDA state and the front end's threads
        to_engine_r, self._to_engine = ctx.Pipe(duplex=False)
        self._from_engine, from_engine_w = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=engine_main, name="moestream-engine", daemon=True,
                                 args=(self.args, to_engine_r, from_engine_w, os.getpid()))
        self._proc.start()
        to_engine_r.close()  # our copies: closing them lets each side see EOF when the other dies
        from_engine_w.close()
        msg = self._recv_startup()
        self.info, self.alive = msg.info, True
        return self.info

    def _recv_startup(self) -> Ready:
        while True:
            if self._from_engine.poll(0.5):
                try:
                    msg = self._from_engine.recv()
                except EOFError:
                    msg = None
                if not isinstance(msg, Ready):
                    self.shutdown()
                    raise MoestreamError("the engine failed to start: " + (
                        msg.message if isinstance(msg, StartupError) else "it exited (see the log above)"))
                return msg
            if not self._proc.is_alive():
                raise MoestreamError(f"the engine process exited during start-up (exit code {self._proc.exitcode})")

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start delivering engine messages into `loop` (call from inside the running loop)."""
        self._loop = loop
        threading.Thread(target=self._reader, name="moestream-engine-reader", daemon=True).start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def check_alive(self) -> bool:
        """Poll the process (the pipe's EOF is the fast path; this catches a hung-up pipe too)."""
        if self.alive and self._proc is not None and not self._proc.is_alive():
            log.error("the engine process exited (exit code %s)", self._proc.exitcode)
            self._engine_died()
        return self.alive

    def fail_all(self, message: str, status: int = 503) -> None:
        """End every request in flight with an error (on shutdown: streams get a final error event)."""
        for q in self._queues.values():
            q.put_nowait(EngineError(message, status))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the engine to stop, then make sure it did (terminate, then kill)."""
        proc, self.alive = self._proc, False
        if proc is None:
            return
        self._send(Shutdown())
        proc.join(timeout)
        if proc.is_alive():
            if timeout > 0:
                log.warning("engine did not stop in %.0f s; terminating it", timeout)
            proc.terminate()
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        self._proc = None

    # ---- requests --------------------------------------------------------------------------
    async def generate(self, rid: str, prompt_ids: list[int], params, keep_markup: bool = True,
                       parent: str | None = None) -> AsyncIterator[Delta]:
        """Deltas until the one with a finish_reason. Leaving early (client gone, error) aborts it."""
        if not self.alive:
            raise EngineError("the engine is not running", 503)
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = q
        finished = False
        try:
            self._send(Add(rid, list(prompt_ids), params, keep_markup, parent))
            while True:
                item = await q.get()
                if item is _GONE:
                    return
                if isinstance(item, EngineError):
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self.cancel(rid)

    def cancel(self, rid: str) -> None:
        """Abort now (frees the request's pages and slot) and wake its generator."""
        if self.alive:
            self._send(Abort(rid))
        q = self._queues.get(rid)
        if q is not None:
            q.put_nowait(_GONE)

    async def stats(self, timeout: float = 5.0) -> dict:
        return await self._call(StatsQuery, timeout)

    async def rebuild_caches(self, kv_tokens: int | None, moe_slots: int | str | None,
                             timeout: float = 600.0) -> dict:
        """Resize the engine's KV pool and expert slot cache between two steps; the report, or EngineError with
        the engine's reason and status (400 / 409: refused, nothing changed)."""
        data = await self._call(lambda sid: Rebuild(sid, kv_tokens, moe_slots), timeout)
        self.info = {**self.info, **data.get("info", {})}  # the front end checks prompts against the new pool
        return data

    async def _call(self, make, timeout: float) -> dict:
        """make(sid) -> the message; its Stats / Reply answer's data (a refusal raises EngineError)."""
        if not self.alive:
            raise EngineError("the engine is not running", 503)
        sid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._waiters[sid] = fut
        self._send(make(sid))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._waiters.pop(sid, None)

    # ---- plumbing --------------------------------------------------------------------------
    def _send(self, msg: Add | Abort | StatsQuery | Rebuild | Shutdown) -> None:
        """Queue msg for the engine; never blocks (the writer thread waits for the pipe instead)."""
        with self._lock:
            if not self._writer_started:
                self._writer_started = True
                threading.Thread(target=self._writer, name="moestream-engine-writer", daemon=True).start()
        self._outbox.put((ForkingPickler.dumps(msg), isinstance(msg, Shutdown)))

    def _writer(self) -> None:
        """Write the queued messages to the engine's pipe, in order, until Shutdown or a broken pipe (an
        engine gone is noticed by the reader, which fails its requests)."""
        while True:
            data, last = self._outbox.get()
            try:
                self._to_engine.send_bytes(data)
            except (OSError, ValueError):
                return
            if last:
                return

    def _reader(self) -> None:
        while True:
            try:
                msg = self._from_engine.recv()
            except (EOFError, OSError):
                break
            if not self._post(self._dispatch, msg):
                return
        if self.alive:
            log.error("the engine process died; failing its requests")
        if self._proc is not None:
            self._post(self._engine_died)  # (None: we shut it down ourselves)

    def _post(self, fn, *args) -> bool:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
            return True
        except RuntimeError:  # the loop closed: the server is shutting down
            return False

    def _dispatch(self, msg: Outputs | Failed | Stats | Reply) -> None:
        if isinstance(msg, Outputs):
            for rid, delta in msg.items:
                q = self._queues.get(rid)
                if q is not None:
                    q.put_nowait(delta)
        elif isinstance(msg, Failed):
            q = self._queues.get(msg.rid)
            if q is not None:
                q.put_nowait(EngineError(msg.message, msg.status))
        elif isinstance(msg, (Stats, Reply)):
            fut = self._waiters.get(msg.sid)
            if fut is None or fut.done():
                return
            if isinstance(msg, Reply) and msg.error is not None:
                fut.set_exception(EngineError(msg.error, msg.status))
            else:
                fut.set_result(msg.data)
        else:
            log.error("unexpected message from the engine: %r", msg)

    def _engine_died(self) -> None:
        was_alive, self.alive = self.alive, False
        if not was_alive:
            return
        self.fail_all("the engine process stopped", 503)
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(EngineError("the engine process stopped", 503))
        if self.on_death is not None:
            self.on_death()

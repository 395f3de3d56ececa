"""CPU-computed experts inside a decode step that never waits on the host (hybrid and cpu on a GPU).

The CPU can only compute a pair (token, expert) once it knows the route, which the GPU computes. The
grouped path (strategies.GroupedDecode) brings each layer's route to the host and back: one host
synchronisation per layer, so the step cannot be a CUDA graph and the launches cost more than the
experts. Here the step stays one graph; the GPU and one CPU worker thread meet in pinned host memory
that both address (unified addressing):

    post(layer)     one GPU program writes the layer's request into the layer's host slot: the T token
                    rows x, each pair's expert id (-1: computed on the GPU) and weight, T; then publishes
                    the step's sequence number in req[layer] (a system-scope release)
    worker          a CPU thread: for each MoE layer in order, waits until req[layer] == seq, computes
                    w * mlp_e(x[t]) for its pairs from the host banks into y[layer, p] (float32), then
                    writes done[layer] = seq
    collect(layer)  one GPU program per pair: a CPU pair's program polls done[layer] until it equals seq
                    (at most SPIN_LIMIT polls: then it raises the error flag and goes on), then copies its
                    row of y into the step's pair outputs; a GPU pair's program returns at once

The sequence number the kernels read is a device word the host sets before each step is launched (a fill
ordered in the stream before the step's work), so a replayed graph needs no counter of its own and a step may be
launched while the one before it still runs (overlapped decode): the worker serves its jobs in order, and
`finish_step` finishes the oldest step launched, not the newest. The caller posts before it stages or computes its own pairs:
PCIe copies, GPU pairs and CPU pairs overlap. Pair outputs from either side are summed in k order by
the caller (pairs.pair_sum), as fused sums them. A worker exception or a timeout fails the step:
`end_step` only records an event, and `finish_step` (called once the caller has waited for the step's
results, or by the next `begin_step`) waits for the worker and raises.

On a CPU device post/collect are torch code on the calling thread (same protocol, worker and
bookkeeping; the tests run it).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import numpy as np
import torch

from ..env import omp_release
from ..kernels import cpu_quant
from . import cpu_moe
from .pairs import triton, triton_ready
from .swiglu import swiglu

SPIN_LIMIT = 1 << 25  # polls of host memory (~0.5-1 us each) before a collect gives up: tens of seconds
WORKER_TIMEOUT_S = 120.0
INTERLEAVE_RESERVE = 4 << 30  # host memory left available beside the bridge's interleaved copies (MOESTREAM_BRIDGE_X8)
log = logging.getLogger("moestream")


class CpuBridge:
    def __init__(self, store, device: torch.device, max_pairs: int, threads: int = 0,
                 dtype: torch.dtype | None = None, hold: bool = False):
        """dtype: the activations' (default: the dense experts' dtype; compressed experts need it given).
        hold: on a GPU, the compiled worker's layer calls run on the kernels' pool held spinning for the whole step
        (cpu_quant.bridge_step; MOESTREAM_BRIDGE_POOL=0 turns it off). The `cpu` backend, whose worker computes
        every pair of every layer, asks for it: on the H100 host it decoded 49.1 tok/s against 46.1 without
        (benchmarks/RESULTS.md, 2026-12-05, fifteenth session); hybrid's split, whose CPU share is a few experts
        a layer beside the PCIe copies, measured its split step 18.6 ms held against 16.5 not, so it does not
        (MOESTREAM_BRIDGE_POOL=all holds it there too: `holds_pool`)."""
        self.store, self.device = store, device
        self.hold = hold
        self.threads = threads  # the worker's intra-op threads (0: torch's default for a new thread)
        self.layers = list(store.moe_layers)
        self.index = {layer: i for i, layer in enumerate(self.layers)}
        self.interleaved = self._interleave()  # bytes of interleaved copies made (MOESTREAM_BRIDGE_X8)
        L, H, P = len(self.layers), store.hidden, max_pairs
        if dtype is None:
            if store.fmt.quantized:
                raise ValueError("CpuBridge over compressed experts needs the activation dtype")
            dtype = store.bank(self.layers[0])["gate_up"].dtype
        pin = device.type == "cuda"
        self.hx = torch.zeros(L, P, H, dtype=dtype, pin_memory=pin)
        self.hids = torch.full((L, P), -1, dtype=torch.long, pin_memory=pin)
        self.hw = torch.zeros(L, P, dtype=torch.float32, pin_memory=pin)
        self.hy = torch.zeros(L, P, H, dtype=torch.float32, pin_memory=pin)
        self.hmeta = torch.zeros(L, 2, dtype=torch.long, pin_memory=pin)  # T, P of the request
        self.req = torch.zeros(L, dtype=torch.long, pin_memory=pin)
        self.done = torch.zeros(L, dtype=torch.long, pin_memory=pin)
        self.seq_h = torch.zeros(1, dtype=torch.long, pin_memory=pin)
        self.dseq = torch.zeros(1, dtype=torch.long, device=device)  # the step's sequence number the kernels read
        self.err = torch.zeros(1, dtype=torch.int32, pin_memory=pin)
        self._req, self._done, self._err = self.req.numpy(), self.done.numpy(), self.err.numpy()
        self.kernels = triton_ready(device)  # else torch on this thread (tests: either)
        self._ids, self._meta = self.hids.numpy(), self.hmeta.numpy()
        self.seq = 0
        self.failure: BaseException | None = None
        self.cpu_experts = np.zeros(L, dtype=np.int64)  # distinct experts the worker computed, per call summed
        self.cpu_seconds = np.zeros(L)  # the worker's time computing them
        self.kernel_seconds = np.zeros(L)  # of which inside the compiled layer call
        self.wait_seconds = np.zeros(L)  # the worker's time waiting for the GPU's request of the layer
        self.handoff_seconds = np.zeros(L)  # from seeing it to the layer call, and from the call to the answer
        # steps ended (their work launched) and not yet finished (finish_step), oldest first: (seq, blocking
        # event after the step's work, None on a CPU); two while an overlapped step is launched before the last is read
        self._pending: deque = deque()
        self._finished = 0  # the last job the worker finished (every job before it too)
        self._cv = threading.Condition()
        # its calls' (experts c, seconds t) summed for a line fit (moe/share.py): [calls, c, t, c^2, c t]
        self.fit = np.zeros(5)
        self._hw = self.hw.numpy()
        # the newest step whose requests not posted by now never will be (its work is done): a worker waiting for a
        # request of that step or an older one gives up (read by both worker loops)
        self._cancel = np.zeros(1, dtype=np.int64)
        self._tables: dict | bool | None = None  # the compiled worker's arguments (False: not for this store)
        self._calls: dict = {}
        self._calls_enabled = None
        self.mlp = PairMlp(P)
        self.qmlp = QuantPairMlp()
        self._jobs: queue.Queue = queue.Queue()
        self.omp_released = 0  # steps before which this thread's OpenMP team was freed (MOESTREAM_OMP_RELEASE)
        self._thread = threading.Thread(target=self._loop, name="moestream-cpu-bridge", daemon=True)
        self._thread.start()

    def _interleave(self) -> int:
        """MOESTREAM_BRIDGE_X8=1: every MoE layer's GGUF host banks get the 8-row interleaved copies the worker's
        kernels read (cpu_moe.interleave_layer), while host memory keeps INTERLEAVE_RESERVE available beside them;
        the bytes made."""
        from ..env import bridge_interleave
        from ..hardware import host_memory

        if not bridge_interleave() or not self.store.fmt.quantized or not cpu_moe.kernels_on():
            return 0
        t0, made = time.perf_counter(), 0
        room = (lambda n: host_memory()[1] - n >= INTERLEAVE_RESERVE)
        for layer in self.layers:
            made += cpu_moe.interleave_layer(self.store.bank(layer), self.store.fmt.for_layer(layer), room)
        log.info("moestream: cpu bridge: %.2f GiB of interleaved expert copies in %.1f s", made / (1 << 30),
                 time.perf_counter() - t0)
        return made

    # ---- host side, per step ---------------------------------------------------------------
    def begin_step(self, first: int = 0, keep: int = 0) -> None:
        """Before the step's work is launched: the earlier steps finished (finish_step) but the newest `keep` (1: an
        overlapped decode step launched before the last step is read), the new sequence number, and a job for the
        worker, which serves the layers from index `first` on in order (an MTP drafter pass calls only its block's
        layer, after the model's: the worker must not wait for layer 0)."""
        while len(self._pending) > keep:
            self.finish_step()
        if omp_release() and self.device.type == "cuda":  # this thread's OpenMP team off: the worker's spins again
            self.omp_released += int(cpu_quant.omp_release_team())
        self.seq += 1
        self.seq_h[0] = self.seq
        self.dseq.fill_(self.seq)  # in the stream: after the step before it, before this step's posts
        self._jobs.put((self.seq, first))

    def end_step(self) -> None:
        """After the step's work is launched: nothing waits here, so the caller queues the step's sampling
        behind it and the GPU does not idle while this thread wakes and the worker files its counts. The
        caller then calls finish_step once it has waited for the step's results (the next begin_step does,
        where nobody did)."""
        done = None
        if self.device.type == "cuda":
            # a blocking event: a thread waiting on it sleeps instead of spinning on a core the worker uses
            done = torch.cuda.Event(blocking=True)
            done.record(torch.cuda.current_stream(self.device))
        self._pending.append((self.seq, done))

    def wait_launched(self) -> None:
        """Sleep until the oldest ended step's GPU work is done (its blocking event). The caller's next read of the
        step's results would otherwise wait in a CUDA sync, which spins a core for the whole step (CUDA's default
        with fewer contexts than cores): on a host whose every core runs one of the worker's threads, that
        spinning thread halves one worker thread's share, and each fork/join of the worker's layer calls waits
        for it. (The oldest: an overlapped step launched after it is not waited for.)"""
        if self._pending and self._pending[0][1] is not None:
            self._pending[0][1].synchronize()

    def finish_step(self) -> bool:
        """The oldest ended step is complete: wait for its GPU work (done already when the caller has read the
        step's results), release the worker from requests of it that will not come, wait for the worker's job, raise
        a failure. False when no step was pending."""
        if not self._pending:
            return False
        seq, done = self._pending.popleft()
        if done is not None:
            done.synchronize()
        # every request of a finished step was posted; a worker still waiting for one belongs to a step that raised
        self._cancel[0] = max(int(self._cancel[0]), seq)
        with self._cv:
            if not self._cv.wait_for(lambda: self._finished >= seq, WORKER_TIMEOUT_S):
                raise RuntimeError("the CPU expert worker is stuck")
        if self._err[0] or self.failure is not None:
            exc, code = self.failure, int(self._err[0])
            self.failure, self._err[0] = None, 0
            why = f"{type(exc).__name__}: {exc}" if exc is not None else "no answer from the CPU expert worker"
            raise RuntimeError(f"CPU experts failed in this decode step ({why}; code {code})") from exc
        return True

    def close(self) -> None:
        self._pending.clear()
        self._cancel[0] = np.iinfo(np.int64).max
        self._jobs.put(None)
        self._thread.join(timeout=5)

    # ---- device side, per layer (recordable in a CUDA graph) --------------------------------
    def post(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor,
             cpu: torch.Tensor) -> None:
        """Publish the layer's request: x [T, H], topk_ids/topk_w [T, k], cpu [P] (nonzero: the worker's pair)."""
        i = self.index[layer]
        T, P = topk_ids.shape[0], topk_ids.numel()
        if P > self.hids.shape[1]:
            raise RuntimeError(f"a decode step of {P} (token, expert) pairs exceeds the CPU bridge's {self.hids.shape[1]}")
        ids, w = topk_ids.reshape(-1), topk_w.reshape(-1)
        if self.kernels:
            _post_kernel[(1,)](x.contiguous(), ids, w, cpu, self.hx[i], self.hids[i], self.hw[i], self.hmeta[i],
                               self.req[i:], self.dseq, T, T * x.shape[1], P, BLOCK=1024,
                               NB=triton.cdiv(T * x.shape[1], 1024), BLOCK_P=triton.next_power_of_2(P))
            return
        self.hx[i, :T].copy_(x)
        self.hids[i, :P].copy_(torch.where(cpu.bool(), ids.long(), -1))
        self.hw[i, :P].copy_(w.float())
        self._meta[i] = (T, P)
        self._req[i] = self.seq_h[0]

    def collect(self, layer: int, y: torch.Tensor, cpu: torch.Tensor) -> None:
        """Fill the CPU pairs' rows of y [P, H] (float32) once the worker has answered for this layer."""
        i = self.index[layer]
        P, H = y.shape
        if self.kernels:
            _collect_kernel[(P,)](y, cpu, self.hy[i], self.done[i:], self.dseq, self.err, H, SPIN_LIMIT,
                                  BLOCK=1024, NB=triton.cdiv(H, 1024))
            return
        mask = cpu.bool()
        if not bool(mask.any()):
            return
        seq, t0 = int(self.seq_h[0]), time.monotonic()
        while self._done[i] != seq:
            if time.monotonic() - t0 > WORKER_TIMEOUT_S:
                self._err[0] = 2
                return
            time.sleep(0)
        y[mask] = self.hy[i, :P][mask]

    # ---- the worker --------------------------------------------------------------------------
    def _loop(self) -> None:
        if self.threads:  # OpenMP's thread count is per calling thread: set it in the thread that computes
            torch.set_num_threads(self.threads)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            seq, first = job
            try:
                tables = self._c_tables()
                if tables is not None:
                    self._c_step(seq, tables, first)
                    continue
                for i, layer in enumerate(self.layers):
                    if i < first:
                        continue
                    t_wait = time.perf_counter()
                    if not self._wait_request(i, seq):
                        break
                    self.wait_seconds[i] += time.perf_counter() - t_wait
                    try:
                        if self.failure is None:
                            t0, n0 = time.perf_counter(), self.cpu_experts[i]
                            self._compute(i, layer)
                            dt = time.perf_counter() - t0
                            self.cpu_seconds[i] += dt
                            c = self.cpu_experts[i] - n0
                            if c:
                                self.fit += (1, c, dt, c * c, c * dt)
                    except BaseException as exc:  # noqa: BLE001 - reported by end_step, the GPU must go on
                        self.failure = exc
                        self._err[0] = 1
                    self._done[i] = seq
            finally:
                with self._cv:
                    self._finished = seq
                    self._cv.notify_all()

    def _c_tables(self) -> dict | None:
        """The compiled worker's arguments (kernels/cpu_quant.bridge_step) when every layer's experts are
        computed by the compiled layer call and MOESTREAM_BRIDGE_C is not 0; else None (the Python loop)."""
        from ..env import bridge_worker_in_c
        from ..kernels.cpu_quant import ACT_DTYPES

        if not bridge_worker_in_c() or not cpu_moe.kernels_on():
            return None
        if self._tables is None:
            calls = [self._layer_call(i, layer, self.store.fmt.for_layer(layer), self.store.bank(layer))
                     for i, layer in enumerate(self.layers)]
            if any(c is None for c in calls):
                self._tables = False
            else:
                L, P, H = self.hids.shape[0], self.hids.shape[1], self.store.hidden
                self._tables = {
                    "L": L, "P": P, "H": H, "I": calls[0].inter, "xdtype": ACT_DTYPES[self.hx.dtype],
                    "req": self.req.data_ptr(), "done": self.done.data_ptr(), "meta": self.hmeta.data_ptr(),
                    "ids": self.hids.data_ptr(), "hw": self.hw.data_ptr(), "hx": self.hx.data_ptr(),
                    "hy": self.hy.data_ptr(),
                    "wbase": np.ascontiguousarray(np.stack([c.base for c in calls]), dtype=np.int64),
                    "wstep": np.ascontiguousarray(np.stack([c.step for c in calls]), dtype=np.int64),
                    "wtype": np.ascontiguousarray(np.stack([c.tids for c in calls]), dtype=np.int64),
                    "lflags": np.array([int(c.round_mm) for c in calls], dtype=np.int64),
                    "experts": np.zeros(L, dtype=np.int64), "secs": np.zeros(L), "waits": np.zeros(2 * L),
                    "cancel": self._cancel,
                    "calls": calls}  # the owners of wbase's addresses (HF FP4 descriptors), for as long as these
        return self._tables or None

    def holds_pool(self) -> bool:
        """Whether this step's compiled layer calls run on the kernels' pool held spinning for the step: on a GPU,
        the `cpu` backend's by default, hybrid's too under MOESTREAM_BRIDGE_POOL=all, neither under =0."""
        from ..env import bridge_pool

        mode = bridge_pool()
        return self.device.type == "cuda" and (mode == "all" or (self.hold and mode == "1"))

    def _c_step(self, seq: int, t: dict, first: int = 0) -> None:
        """One decode step's layers (from index `first`) in one compiled call (the interpreter released
        throughout), then its counters into the per-layer statistics."""
        from ..env import bridge_ahead
        from ..kernels.cpu_quant import _LAYER_ERRORS, bridge_step

        for k in ("experts", "secs", "waits"):
            t[k][:] = 0
        rc = bridge_step(seq, t, WORKER_TIMEOUT_S, first, hold_pool=self.holds_pool(), ahead=bridge_ahead())
        c, s = t["experts"], t["secs"]
        self.cpu_experts += c
        self.cpu_seconds += s
        self.kernel_seconds += s
        self.wait_seconds += t["waits"][0::2]
        self.handoff_seconds += t["waits"][1::2]
        on = c > 0
        c, s = c[on].astype(np.float64), s[on]
        self.fit += (len(c), c.sum(), s.sum(), (c * c).sum(), (c * s).sum())
        if rc in (0, -4):  # -4: the step ended before posting every layer (it raised); nothing to report
            return
        why = "no request from the GPU in time" if rc == -5 else _LAYER_ERRORS.get(rc, f"error {rc}")
        self.failure = RuntimeError(f"the compiled CPU expert worker failed: {why}")
        self._err[0] = 1

    def _wait_request(self, i: int, seq: int) -> bool:
        while self._req[i] != seq:
            if self._cancel[0] >= seq:
                return False
            time.sleep(0)  # lets the launching thread have the interpreter
        return True

    def _layer_call(self, i: int, layer: int, fmt, bank: dict):
        """The layer's cpu_moe.LayerCall (built at its first call), or None where the compiled kernels do not
        compute it (then PairMlp / QuantPairMlp). Re-checked when the kernels are switched off or on."""
        on = cpu_moe.kernels_on()
        if on != self._calls_enabled:
            self._calls, self._calls_enabled = {}, on
        if i not in self._calls:
            self._calls[i] = cpu_moe.LayerCall(bank, fmt, self.hx.dtype) if on and cpu_moe.ready(fmt, self.hx, bank) \
                else None
        return self._calls[i]

    def _compute(self, i: int, layer: int) -> None:
        T, P = (int(v) for v in self._meta[i])
        ids = self._ids[i, :P]
        pairs = np.flatnonzero(ids >= 0)
        if not len(pairs):
            return
        order = pairs[np.argsort(ids[pairs], kind="stable")]  # the worker's pairs grouped by expert
        experts, starts = np.unique(ids[order], return_index=True)
        bank = self.store.bank(layer)
        fmt = self.store.fmt.for_layer(layer)
        call = self._layer_call(i, layer, fmt, bank)
        if call is not None:  # one compiled call: x rows and outputs stay in the host slots
            t0 = time.perf_counter()
            call(self.hx[i, :T], experts, np.append(starts, len(order)), order // (P // T),
                 self._hw[i][order], order, self.hy[i])
            self.kernel_seconds[i] += time.perf_counter() - t0
            self.cpu_experts[i] += len(experts)
            return
        groups = list(zip(experts.tolist(), starts.tolist(), np.append(starts[1:], len(order)).tolist()))
        with torch.inference_mode():
            idx = torch.from_numpy(order)
            xs = self.hx[i].index_select(0, idx // (P // T))
            if fmt.quantized:
                yd = self.qmlp(xs, groups, bank, fmt)
            else:
                yd = self.mlp(xs, groups, bank["gate_up"], bank["down"])
            self.hy[i].index_copy_(0, idx, yd.float().mul_(self.hw[i].index_select(0, idx)[:, None]))
        self.cpu_experts[i] += len(groups)


class PairMlp:
    """The experts' MLP over pairs grouped by expert: xs [n, H] (rows of one expert contiguous), groups
    [(expert, first row, end row)] -> [n, H] in the weights' dtype, with the pair kernels' arithmetic:
    gate/up and down outputs rounded to the weights' dtype, the activation in float32, h rounded to the
    weights' dtype. The GEMMs run one after another, each over the calling thread's intra-op threads
    (benchmarks/cpu_experts.py: on the 16-core H200 host this reads 33.5 GB/s of experts at bs=1, where
    experts side by side on single-threaded Python threads read 11-18)."""

    def __init__(self, rows: int):
        self.rows = rows
        self._work: dict[str, torch.Tensor] = {}

    def __call__(self, xs, groups, gate_up, down) -> torch.Tensor:
        n, I2, H = xs.shape[0], gate_up.shape[1], down.shape[1]
        gu, h, yd = self._scratch(n, I2, H, gate_up.dtype)
        for e, r0, r1 in groups:
            torch.mm(xs[r0:r1], gate_up[e].t(), out=gu[r0:r1])
        g, u = gu.float().chunk(2, dim=-1)
        swiglu(g, u, out=h)  # cast on write
        for e, r0, r1 in groups:
            torch.mm(h[r0:r1], down[e].t(), out=yd[r0:r1])
        return yd

    def _scratch(self, n: int, I2: int, H: int, dtype: torch.dtype):
        w = self._work
        if "gu" not in w or w["gu"].shape[1] != I2 or w["gu"].dtype != dtype:
            w.update(gu=torch.empty(self.rows, I2, dtype=dtype), h=torch.empty(self.rows, I2 // 2, dtype=dtype),
                     y=torch.empty(self.rows, H, dtype=dtype))
        return w["gu"][:n], w["h"][:n], w["y"][:n]


class QuantPairMlp:
    """PairMlp for compressed experts, read in their stored format from the host bank (quant.qlinear: the
    CPU kernels where built, else tile decoders), with the quantized pair kernels' arithmetic: gate/up in
    float32, h rounded to the activations' dtype, the down projection in float32."""

    def __call__(self, xs, groups, bank, fmt) -> torch.Tensor:
        from ..quant import qlinear

        y = torch.empty(xs.shape[0], xs.shape[1], dtype=torch.float32)
        for e, r0, r1 in groups:
            rows = {name: a[e] for name, a in bank.items()}
            xe = xs[r0:r1].float()
            g, u = (qlinear(xe, *fmt.weight(rows, proj)) for proj in ("gate", "up"))
            h = swiglu(g, u, xs.dtype).float()
            y[r0:r1] = qlinear(h, *fmt.weight(rows, "down"))
        return y


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _post_kernel(x_ptr, ids_ptr, w_ptr, cpu_ptr, hx_ptr, hids_ptr, hw_ptr, meta_ptr, req_ptr, seq_ptr, T, TH, P,
                     BLOCK: tl.constexpr, NB: tl.constexpr, BLOCK_P: tl.constexpr, ATOMIC: tl.constexpr = True):
        for j in range(NB):  # constexpr trip counts (NB = cdiv(TH, BLOCK)): also what the interpreter runs
            offs = j * BLOCK + tl.arange(0, BLOCK)
            m = offs < TH
            tl.store(hx_ptr + offs, tl.load(x_ptr + offs, mask=m), mask=m)
        p = tl.arange(0, BLOCK_P)
        pm = p < P
        ids = tl.load(ids_ptr + p, mask=pm, other=0).to(tl.int64)
        cpu = tl.load(cpu_ptr + p, mask=pm, other=0)
        tl.store(hids_ptr + p, tl.where(cpu != 0, ids, -1), mask=pm)
        tl.store(hw_ptr + p, tl.load(w_ptr + p, mask=pm, other=0.0).to(tl.float32), mask=pm)
        two = tl.arange(0, 2)
        tl.store(meta_ptr + two, tl.where(two == 0, tl.zeros([2], dtype=tl.int64) + T, P))
        tl.debug_barrier()
        seq = tl.load(seq_ptr, volatile=True)
        if ATOMIC:
            tl.atomic_xchg(req_ptr, seq, sem="release", scope="sys")
        else:  # a system-scope fence, then a plain store (for platforms without atomics to host memory)
            seq = tl.inline_asm_elementwise("fence.sc.sys;\n\tmov.b64 $0, $1;", "=l,l", [seq], dtype=tl.int64,
                                            is_pure=False, pack=1)
            tl.store(req_ptr, seq)

    @triton.jit
    def _collect_kernel(y_ptr, cpu_ptr, hy_ptr, done_ptr, seq_ptr, err_ptr, H, SPIN, BLOCK: tl.constexpr,
                        NB: tl.constexpr):
        p = tl.program_id(0)
        if tl.load(cpu_ptr + p) != 0:
            seq = tl.load(seq_ptr, volatile=True)
            n = tl.load(err_ptr, volatile=True) * SPIN  # a step already failed: do not wait again
            while (tl.load(done_ptr, volatile=True) != seq) & (n < SPIN):
                n += 1
            if n >= SPIN:
                tl.store(err_ptr, 2)
            for j in range(NB):
                offs = j * BLOCK + tl.arange(0, BLOCK)
                m = offs < H
                tl.store(y_ptr + p * H + offs, tl.load(hy_ptr + p * H + offs, mask=m, volatile=True), mask=m)

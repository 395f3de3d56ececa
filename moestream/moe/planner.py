"""Memory planner: a pure function (model sizes, hardware, engine options, measured bandwidths) -> plan.

One budget: `--gpu-memory-gb` if given, else `--memory-ratio` x free device memory (on a CPU-only
machine: x available host memory). From it come, in this order: dense weights, linear-state pool,
workspace, a KV reserve, the prefill double buffer, expert slots (or every expert, for fused), and the
rest goes to KV up to what the requests can use. The plan is printed at start-up (`describe`) and
served as a dict (`as_dict`, in /v1/stats and `llm.stats()`).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

from ..core import ConfigError
from ..env import prefill_rows
from .runtime import RuntimeOptions

GiB = 1 << 30
KV_RESERVE_TOKENS = 8192  # KV kept for requests before expert slots take the rest of the budget
PREFILL_MAX_ROWS = 64  # rows per half of the prefill double buffer: enough to overlap, small in VRAM
PREFILL_CHUNK_FLOOR = 256  # prompt tokens per step the planner may lower --chunked-prefill-size to before refusing
# prompt tokens per step kept while snapshots and running requests shrink (Engine._plan_fitting): a streamed prefill
# chunk reads every expert of the model over PCIe whatever its length (18 GiB for the Qwen3.6 Q4_K_M file), so a
# 32k-token prompt in 256-token chunks moves 128 x that; the workspace a chunk token needs is ~0.1 MiB
PREFILL_CHUNK_KEEP = 1024
# KV tokens below which a plan that fits is still too small to be useful while it could hold fewer requests' state
# instead (the engine's fit halves --max-running-requests then: engine.Engine._plan_fitting)
USEFUL_KV_TOKENS = 4096
HYBRID_MIN_CPU_SHARE = 0.25  # auto picks hybrid when CPU expert GB/s >= this x pinned PCIe GB/s
# ... and its cache would hold at least this share of the experts; below it auto picks cpu. A cache that small hits
# little, and the split's PCIe copies take host memory bandwidth from the CPU experts: on H100 hosts at 4.16 GiB
# (Qwen3.6 Q4_K_M, 19 slots of 10,240) hybrid decoded 43.1 tok/s where cpu decoded 48.1 in the same run, the CPU
# experts at 28 GB/s beside the copies against 44 alone (benchmarks/RESULTS.md, 2026-12-06, twenty-first session)
HYBRID_MIN_RESIDENCY = 0.02
# ... and at most this share; above it auto picks offload. A cache that holds most of the experts leaves a batch-1
# layer call one or two misses, fewer than the CPU's call (its fixed cost is 70-130 us, one or two experts' PCIe
# time) pays for, while every miss the split leaves to the CPU stays out of the cache: same run on an H100 host,
# Qwen3.6 Q8_0 at 22.84 GiB (57 % of the experts cached), offload 118.8 / 115.4 tok/s against hybrid 88.8 / 91.5
# (its cache hit 0.62 against offload's 0.80), and at 11.68 / 8.5 GiB (22 / 12 %) hybrid the faster (2026-12-07,
# thirty-first session); the Q4_K_M file at 11.30 GiB (~47 %) tied (74.6 / 74.4, 84.9 / 85.9: 2026-12-06)
HYBRID_MAX_RESIDENCY = 0.45
# Under a --gpu-memory-gb cap on a GPU, kept free beyond the CUDA context: what the running engine holds
# outside the plan's items (recorded decode graphs' pool, prefill temporaries beyond the workspace, kernel
# modules and library handles loaded after start-up). Measured on the H200 (2026-12-03, Qwen3.6-shaped Q8_0,
# offload at 22.84 GiB): 0.28 GiB allocated beyond the plan + 0.14 GiB outside torch beyond the context +
# 0.07 GiB torch cache = 0.49 GiB.
# That was the whole of it at every cap until the 2.22 GiB cap of llama.cpp's -ncmoe 40 run was refused: of the 0.49
# GiB, the 0.14 outside torch (modules and handles) does not shrink with the cap, the rest (graph pool, prefill
# temporaries, allocator cache) follows the pools and prefill chunks a cap allows. At 4 GiB (edge_memory.py, same
# day, Q4_K_M offload) the process used 0.02 GiB beyond the plan's items and the context once warm. So: the full
# CAP_HEADROOM from CAP_HEADROOM_FULL_AT up, below it CAP_MODULES plus the torch-side share scaled with the cap
# (cap_headroom).
CAP_HEADROOM = 512 << 20
CAP_MODULES = 144 << 20
CAP_HEADROOM_FULL_AT = 4 << 30
PIN_HEADROOM = 0.10  # host RAM left unpinned (at least 4 GiB) for the OS and the rest of the process


@dataclass(frozen=True)
class ModelSizes:
    num_moe_layers: int
    num_experts: int
    top_k: int
    expert_bytes: int
    dense_bytes: int
    kv_bytes_per_token: int
    state_bytes: int
    workspace_bytes: int
    wanted_kv_tokens: int  # what the configured requests can use
    min_kv_tokens: int  # below this nothing useful runs
    # every expert at its own layer's size (a Q4_K_M file: Q4_K and Q6_K layers); 0: total_experts slot rows.
    # Slot and prefill rows hold any layer's expert, so they are expert_bytes (the largest layer's) each.
    bank_bytes: int = 0

    @property
    def total_experts(self) -> int:
        return self.num_moe_layers * self.num_experts

    @property
    def banks(self) -> int:
        """Bytes of every expert's bank (host banks; fused experts on the device)."""
        return self.bank_bytes or self.total_experts * self.expert_bytes


@dataclass(frozen=True)
class Hardware:
    device: str  # "cpu" | "cuda"
    name: str
    free_bytes: int  # free device memory before loading (CPU: available host memory)
    host_total_bytes: int
    host_available_bytes: int
    physical_cores: int
    # GPU memory this process holds outside torch's allocator once the CUDA context and the math libraries'
    # handles exist (measured by probe_hardware); `--gpu-memory-gb` caps the process, so the plan's budget
    # is the cap less this. 0 on a CPU.
    context_bytes: int = 0


@dataclass(frozen=True)
class Bandwidths:
    """From `moestream bench bw` (GB/s; 0 = not measured)."""

    pcie_pinned_gbs: float = 0.0
    pcie_pageable_gbs: float = 0.0
    cpu_expert_gbs: float = 0.0
    host_read_gbs: float = 0.0
    gpu_expert_gbs: float = 0.0

    @classmethod
    def from_profile(cls, profile: dict | None) -> "Bandwidths | None":
        if not profile:
            return None
        return cls(**{k: float(profile.get(k) or 0.0) for k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class PlanBytes:
    budget: int  # what the plan splits: the cap (or memory-ratio share) less the CUDA context
    dense: int
    state: int
    workspace: int
    experts_device: int
    prefill_buffer: int
    kv: int
    host_banks: int
    pin_budget: int
    # CUDA context (measured) + runtime headroom (cap_headroom), outside the budget: counted against
    # --gpu-memory-gb only
    context: int = 0
    headroom: int = 0  # the runtime headroom part of `context`


@dataclass(frozen=True)
class MoePlan:
    backend: str
    reason: str
    device: str
    cache_slots: int
    total_experts: int
    prefill_slots: int
    cpu_threads: int
    prefetch: bool
    hybrid_fetch_fraction: float
    kv_tokens: int
    bytes: PlanBytes
    pcie_gbs: float = 0.0  # pinned host-to-device, from the bench profile (0: not measured)
    prefill_chunk: int = 0  # tokens per prefill chunk the workspace is sized for (--chunked-prefill-size or less)
    running_requests: int = 0  # requests whose state (KV reserve, linear state) the plan holds at once

    @property
    def residency(self) -> float:
        """Share of all routed experts that can be on the device at once."""
        if not self.total_experts:
            return 1.0
        return 1.0 if self.backend == "fused" else self.cache_slots / self.total_experts

    def as_dict(self) -> dict:
        return {**asdict(self), "residency": self.residency}

    def runtime_options(self) -> RuntimeOptions:
        return RuntimeOptions(cache_slots=self.cache_slots, prefill_slots=self.prefill_slots,
                              cpu_threads=self.cpu_threads, prefetch=self.prefetch,
                              hybrid_fetch_fraction=self.hybrid_fetch_fraction, pcie_gbs=self.pcie_gbs)

    def _prefill_words(self) -> str:
        if self.prefill_slots or self.backend != "cpu" or self.device != "cuda":
            return f"2x{self.prefill_slots}"
        return "none (prefill chunks' experts on the CPU threads too)"

    def describe(self) -> str:
        b, g = self.bytes, (lambda n: f"{n / GiB:.2f}")
        return "\n".join([
            f"expert plan: backend {self.backend} ({self.reason})",
            f"  expert slots {self.cache_slots} of {self.total_experts} ({100 * self.residency:.1f}% resident), "
            f"prefill buffer {self._prefill_words()}, prefetch {'on' if self.prefetch else 'off'}, "
            f"cpu threads {self.cpu_threads}, hybrid fetch share {self.hybrid_fetch_fraction:.2f}, "
            f"running requests {self.running_requests}",
            f"  {self.device} budget {g(b.budget)} GiB: dense {g(b.dense)} + experts {g(b.experts_device)} + "
            f"prefill {g(b.prefill_buffer)} + KV {g(b.kv)} ({self.kv_tokens} tokens) + state {g(b.state)} + "
            f"workspace {g(b.workspace)} (prefill chunks of {self.prefill_chunk} tokens)" + (
                f"; CUDA context + runtime headroom {g(b.context)} GiB outside it ({g(b.context - b.headroom)} + "
                f"{g(b.headroom)})" if b.context else ""),
            f"  host expert banks {g(b.host_banks)} GiB, pin budget {g(b.pin_budget)} GiB",
        ])


# ---- the recipe ------------------------------------------------------------------------------
def plan_memory(m: ModelSizes, hw: Hardware, e, bw: "Bandwidths | Callable[[], Bandwidths] | None" = None) -> MoePlan:
    """e: an EngineConfig (moe_backend, moe_cache_size/rate, memory_ratio, gpu_memory_gb, num_tokens,
    moe_cpu_threads, moe_prefetch, pin_budget_gb). bw: the measured bandwidths, or a function that measures them,
    called only when auto has to weigh hybrid against offload."""
    if hw.device == "cpu":  # the budget is host RAM too: say so before splitting it
        check_host_memory(m, hw, e.moe_backend)
    budget = _budget(hw, e)
    free = budget - m.dense_bytes - m.state_bytes - m.workspace_bytes
    if free <= 0:
        g = (lambda n: f"{n / GiB:.2f}")
        capped = e.gpu_memory_gb is not None and hw.device != "cpu"
        whence = (f" (the {e.gpu_memory_gb:g} GiB cap less the CUDA context {g(hw.context_bytes)} GiB and runtime "
                  f"headroom {g(_headroom(hw, e))} GiB)" if capped else "")
        raise ConfigError(
            f"the {hw.device} budget of {g(budget)} GiB{whence} does not cover dense weights "
            f"({g(m.dense_bytes)} GiB), state pool ({g(m.state_bytes)} GiB) and workspace "
            f"({g(m.workspace_bytes)} GiB): raise --gpu-memory-gb or --memory-ratio, "
            "or lower --max-running-requests / --chunked-prefill-size")
    if hw.device == "cpu":
        free -= m.banks  # host banks live in the same memory
    if callable(bw):  # measured on demand (no saved profile): only where auto must weigh hybrid against offload
        bw = bw() if _weighs_hybrid(m, hw, e, free) else None
    backend, reason = choose_backend(m, hw, e, bw, free)
    if hw.device != "cpu":
        check_host_memory(m, hw, backend)
    slots, prefill = _expert_rows(m, hw, e, backend, free)
    expert_dev = m.banks if backend == "fused" and hw.device == "cuda" else 0
    expert_dev += slots * m.expert_bytes
    kv_tokens = _kv_tokens(m, e, free - expert_dev - 2 * prefill * m.expert_bytes)
    host = m.banks
    return MoePlan(
        backend=backend, reason=reason, device=hw.device, cache_slots=slots, total_experts=m.total_experts,
        prefill_slots=prefill, cpu_threads=e.moe_cpu_threads or hw.physical_cores, prefetch=e.moe_prefetch == "on",
        hybrid_fetch_fraction=_fetch_fraction(bw), kv_tokens=kv_tokens,
        bytes=PlanBytes(budget=budget, dense=m.dense_bytes, state=m.state_bytes, workspace=m.workspace_bytes,
                        experts_device=expert_dev + (host if hw.device == "cpu" else 0),
                        prefill_buffer=2 * prefill * m.expert_bytes, kv=kv_tokens * m.kv_bytes_per_token,
                        host_banks=host if backend != "fused" or hw.device == "cpu" else 0,
                        pin_budget=_pin_budget(hw, e, host) if backend != "fused" else 0,
                        context=hw.context_bytes + _headroom(hw, e) if _headroom(hw, e) else 0,
                        headroom=_headroom(hw, e)),
        pcie_gbs=bw.pcie_pinned_gbs if bw is not None else 0.0, prefill_chunk=e.chunked_prefill_size,
        running_requests=e.max_running_requests)


def plan_fitting_chunk(sizes_for: Callable, hw: Hardware, e, bw: Bandwidths | None = None):
    """plan_memory for the options e, or, where their budget cannot hold the prefill workspace of
    --chunked-prefill-size tokens next to the rest, the plan for halved chunks (down to PREFILL_CHUNK_FLOOR tokens)
    before refusing with the first error. sizes_for(options) -> ModelSizes (the workspace follows the chunk).
    Returns (plan, the options it was made for: e itself, or e with the smaller chunk)."""
    try:
        return plan_memory(sizes_for(e), hw, e, bw), e
    except ConfigError as err:
        first = err
    chunk = e.chunked_prefill_size
    while chunk > PREFILL_CHUNK_FLOOR:
        chunk = max(PREFILL_CHUNK_FLOOR, chunk // 2)
        smaller = e.replace(chunked_prefill_size=chunk)
        try:
            return plan_memory(sizes_for(smaller), hw, smaller, bw), smaller
        except ConfigError:
            continue
    raise first


def host_need(m: ModelSizes, hw: Hardware, backend: str) -> dict[str, int]:
    """Host RAM a plan needs, by item: the dense weights (built in host memory, then moved to a GPU) and the
    expert banks wherever they live in host memory (every backend on a CPU; all but fused on a GPU). A bank
    mapped from the checkpoint file counts too: one that does not stay resident is read from disk at each use."""
    need = {"dense weights": m.dense_bytes}
    if hw.device == "cpu" or backend != "fused":
        need["expert banks"] = m.banks
    return need


def check_host_memory(m: ModelSizes, hw: Hardware, backend: str) -> None:
    """One readable line, before anything is allocated, when host RAM cannot hold what the plan needs."""
    need = host_need(m, hw, backend)
    total = sum(need.values())
    if total > hw.host_available_bytes:
        g = (lambda n: f"{n / GiB:.2f} GiB" if n >= GiB // 10 else f"{n / 2**20:.1f} MiB")
        parts = " + ".join(f"{k} {g(v)}" for k, v in need.items())
        raise ConfigError(
            f"host RAM cannot hold this model: it needs {g(total)} ({parts}) but {g(hw.host_available_bytes)} "
            f"of {g(hw.host_total_bytes)} is available; free host memory, use a smaller quantization"
            + (", or --moe-backend fused on a GPU that holds every expert" if hw.device != "cpu" else ""))


def cap_headroom(cap_bytes: int) -> int:
    """GPU memory kept free beyond the CUDA context under a cap of cap_bytes (see CAP_HEADROOM): CAP_HEADROOM from
    CAP_HEADROOM_FULL_AT up; below it CAP_MODULES plus the torch-side rest scaled with the cap."""
    share = min(max(cap_bytes, 0), CAP_HEADROOM_FULL_AT) / CAP_HEADROOM_FULL_AT
    return CAP_MODULES + int((CAP_HEADROOM - CAP_MODULES) * share)


def _headroom(hw: Hardware, e) -> int:
    """The runtime headroom this plan keeps (only under --gpu-memory-gb on a GPU)."""
    if e.gpu_memory_gb is None or hw.device == "cpu":
        return 0
    return cap_headroom(int(e.gpu_memory_gb * GiB))


def _budget(hw: Hardware, e) -> int:
    if e.gpu_memory_gb is not None:
        cap = int(e.gpu_memory_gb * GiB)
        # the cap is the whole process's GPU memory (what nvidia-smi shows): the context comes off it
        return cap if hw.device == "cpu" else min(cap - hw.context_bytes - _headroom(hw, e), hw.free_bytes)
    return int(e.memory_ratio * hw.free_bytes)


def _weighs_hybrid(m: ModelSizes, hw: Hardware, e, free: int) -> bool:
    """auto on a GPU for experts that do not fit: the case choose_backend decides by the bandwidths."""
    return (e.moe_backend == "auto" and hw.device != "cpu" and m.total_experts > 0
            and m.banks + _kv_reserve(m, e) * m.kv_bytes_per_token > free)


def choose_backend(m: ModelSizes, hw: Hardware, e, bw: Bandwidths | None, free: int) -> tuple[str, str]:
    if e.moe_backend != "auto":
        return e.moe_backend, "asked for with --moe-backend"
    if m.total_experts == 0:
        return "fused", "dense model: no routed experts"
    if hw.device == "cpu":
        return "fused", "CPU device: experts are computed in place from host memory, a cache would only copy"
    need = m.banks + _kv_reserve(m, e) * m.kv_bytes_per_token
    if need <= free:
        return "fused", f"all {m.total_experts} experts ({need / GiB:.2f} GiB with KV reserve) fit the budget"
    if bw is None or not bw.pcie_pinned_gbs:
        return "offload", "experts do not fit; no bench profile (run `moestream bench bw` to let auto weigh hybrid)"
    share = bw.cpu_expert_gbs / bw.pcie_pinned_gbs
    if share >= HYBRID_MIN_CPU_SHARE:
        fast = (f"CPU experts run at {bw.cpu_expert_gbs:.1f} GB/s, {share:.2f}x pinned PCIe "
                f"({bw.pcie_pinned_gbs:.1f} GB/s)")
        try:
            slots = _expert_rows(m, hw, e, "hybrid", free)[0]
        except ConfigError:  # not even one layer's top-k of slots
            slots = 0
        if slots < HYBRID_MIN_RESIDENCY * m.total_experts:
            return "cpu", (f"experts do not fit; {fast}; the budget leaves hybrid {slots} cache slots "
                           f"({slots / m.total_experts:.1%} of the experts): every expert on the CPU")
        if slots > HYBRID_MAX_RESIDENCY * m.total_experts:
            return "offload", (f"experts do not fit; {fast}, but the cache holds {slots / m.total_experts:.0%} of the "
                               "experts: a layer call misses too few for a CPU call to pay beside PCIe")
        return "hybrid", f"experts do not fit; {fast}"
    return "offload", (f"experts do not fit; CPU experts ({bw.cpu_expert_gbs:.1f} GB/s) add little to pinned "
                       f"PCIe ({bw.pcie_pinned_gbs:.1f} GB/s)")


def _expert_rows(m: ModelSizes, hw: Hardware, e, backend: str, free: int) -> tuple[int, int]:
    """(cache slots, prefill rows per half)."""
    if backend == "fused" or m.total_experts == 0:
        if backend == "fused" and hw.device == "cuda" and m.banks > free:
            raise ConfigError(
                f"--moe-backend fused needs {m.banks / GiB:.2f} GiB for experts but the "
                f"budget leaves {max(free, 0) / GiB:.2f} GiB: use --moe-backend offload, hybrid or cpu")
        return 0, 0
    top = min(m.num_experts, PREFILL_MAX_ROWS, e.prefill_rows_cap or PREFILL_MAX_ROWS)
    if backend == "cpu":
        return 0, (_cpu_prefill_rows(m, e, free, top) if hw.device == "cuda" else 0)
    reserve = _kv_reserve(m, e) * m.kv_bytes_per_token
    room = free - reserve - 2 * top * m.expert_bytes
    small = (e.moe_cache_size is None and e.moe_cache_rate is None and room < m.top_k * m.expert_bytes
             and e.chunked_prefill_size <= PREFILL_CHUNK_FLOOR)
    if small:
        # a small budget, the prefill chunk already at its floor: before the slots, KV for one useful context (or the
        # explicit --max-seq-len-override's whole request: never traded for slots) and a prefill buffer of top-k
        # rows, not the full reserve and 64 rows' room
        keep = max(USEFUL_KV_TOKENS, e.max_seq_len_override or 0) * m.kv_bytes_per_token
        room = free - min(reserve, keep) - 2 * min(m.top_k, top) * m.expert_bytes
    slots = _cache_slots(m, e, room)
    # the rows `room` set aside (2 x top, or top-k where small): a prefill round streams that many experts, and a
    # chunk streams every expert of the model in rounds of it (slots // 4 here left small budgets 8-15 rows and gave
    # the rest of the reserve to KV beyond the asked context)
    prefill = max(min(prefill_rows() or (0 if small else top), top), min(m.top_k, top))
    need = (slots + 2 * prefill) * m.expert_bytes + m.min_kv_tokens * m.kv_bytes_per_token
    if hw.device == "cuda" and need > free:
        raise ConfigError(
            f"{slots} expert slots + prefill buffer need {need / GiB:.2f} GiB but the budget leaves "
            f"{max(free, 0) / GiB:.2f} GiB: lower --moe-cache-size/--moe-cache-rate or raise --gpu-memory-gb")
    return slots, prefill


def _cpu_prefill_rows(m: ModelSizes, e, free: int, top: int) -> int:
    """Rows per half of the cpu backend's prefill double buffer on a GPU: prefill chunks' experts run on the device
    through it (64 rows, or MOESTREAM_PREFILL_ROWS), streamed over PCIe. It is a speed trade only, so the KV reserve
    comes first: where the budget cannot hold both, top-k rows, and where not even those, none (a chunk's experts
    are computed on the CPU threads like a decode step's, in host memory: no device expert buffer at all)."""
    room = free - _kv_reserve(m, e) * m.kv_bytes_per_token
    want = max(min(prefill_rows() or top, top), min(m.top_k, top))
    for rows in (want, min(m.top_k, top)):
        if 2 * rows * m.expert_bytes <= room:
            return rows
    return 0


def _cache_slots(m: ModelSizes, e, room: int) -> int:
    total, k = m.total_experts, m.top_k
    if e.moe_cache_size is not None:
        slots, what = e.moe_cache_size, f"--moe-cache-size {e.moe_cache_size}"
    elif e.moe_cache_rate is not None:
        slots, what = math.ceil(e.moe_cache_rate * total), f"--moe-cache-rate {e.moe_cache_rate} ({math.ceil(e.moe_cache_rate * total)} slots)"
    else:
        slots = max(room, 0) // m.expert_bytes
        if slots < k:
            raise ConfigError(
                f"the budget leaves room for {slots} expert slots, fewer than one layer's top-k ({k}): raise "
                "--gpu-memory-gb/--memory-ratio, lower --num-tokens or --chunked-prefill-size, or use --moe-backend cpu")
        return min(slots, total)
    if slots < k:
        raise ConfigError(f"{what} is below one layer's top-k ({k}): a decode step needs {k} experts of a layer "
                          f"on the device at once; use at least {k} slots or --moe-backend cpu")
    return min(slots, total)


def _kv_reserve(m: ModelSizes, e) -> int:
    """KV tokens set aside before expert slots are sized: an explicit --num-tokens is honoured first; else
    KV_RESERVE_TOKENS, or one whole request of an explicit --max-seq-len-override when that is longer (a server
    started for 32k-token prompts must hold one, not give its KV to expert slots)."""
    if e.num_tokens is not None:
        return e.num_tokens
    return min(m.wanted_kv_tokens, max(KV_RESERVE_TOKENS, e.max_seq_len_override or 0))


def _kv_tokens(m: ModelSizes, e, room: int) -> int:
    if e.num_tokens is not None:
        tokens = e.num_tokens
    elif m.kv_bytes_per_token == 0:
        tokens = m.wanted_kv_tokens
    else:
        tokens = min(m.wanted_kv_tokens, max(room, 0) // m.kv_bytes_per_token)
    if tokens * m.kv_bytes_per_token > max(room, 0) or tokens < m.min_kv_tokens:
        raise ConfigError(
            f"the budget leaves {max(room, 0) / GiB:.2f} GiB for KV, not enough for {max(tokens, m.min_kv_tokens)} "
            "tokens: lower --num-tokens, --moe-cache-size or --max-running-requests, or raise --gpu-memory-gb")
    return tokens


def _fetch_fraction(bw: Bandwidths | None) -> float:
    if bw is None or not bw.pcie_pinned_gbs or not bw.cpu_expert_gbs:
        return 0.5  # no measurement: split evenly
    return bw.pcie_pinned_gbs / (bw.pcie_pinned_gbs + bw.cpu_expert_gbs)


def _pin_budget(hw: Hardware, e, host_bytes: int) -> int:
    if hw.device != "cuda":
        return 0
    if e.pin_budget_gb is not None:
        return int(e.pin_budget_gb * GiB)
    headroom = max(4 * GiB, int(PIN_HEADROOM * hw.host_total_bytes))
    # the prefix cache's host tier is pinned too (kvcache.HostPool, this rank's share)
    tier = int(e.prefix_cache_host_gb * GiB) // e.tp_size if e.prefix_cache else 0
    return max(0, min(host_bytes, hw.host_available_bytes - headroom - tier))


def bank_bytes(fmt, hidden: int, inter: int, layers, num_experts: int) -> int:
    """Bytes of every expert of `layers` at its own layer's size: a per-layer format (moe/formats.LayeredGGUFFormat)
    sums each layer's type; any other format is one size (its slot row)."""
    row = fmt.bytes_per_expert(hidden, inter)
    own = dict(getattr(fmt, "per_layer", ()) or ())
    return num_experts * sum(own[layer].bytes_per_expert(hidden, inter) if layer in own else row for layer in layers)


def model_sizes(cfg, e, dense_bytes: int, max_seq_len: int, kv_bytes_per_token: int,
                state_bytes: int, expert_bytes: int, banks: int = 0) -> ModelSizes:
    """ModelSizes from a ModelConfig and EngineConfig (pure arithmetic)."""
    wanted = e.num_tokens or min(max(max_seq_len, 4096) * e.max_running_requests, 1 << 17)
    # activations of one prefill chunk (hidden, attention, expert intermediates) in fp32, plus slack
    per_token = 8 * cfg.hidden_size + 3 * cfg.top_k * cfg.moe_intermediate_size + 2 * cfg.num_experts
    workspace = (256 << 20) + e.chunked_prefill_size * per_token * 4
    return ModelSizes(
        num_moe_layers=cfg.num_moe_layers, num_experts=cfg.num_experts, top_k=cfg.top_k, expert_bytes=expert_bytes,
        dense_bytes=dense_bytes, kv_bytes_per_token=kv_bytes_per_token, state_bytes=state_bytes,
        workspace_bytes=workspace, wanted_kv_tokens=max(wanted, e.page_size),
        min_kv_tokens=min(max(wanted, e.page_size), e.page_size * 2), bank_bytes=banks)

"""`moestream bench bw`: the bandwidths the planner weighs, measured on this machine.

host_read_gbs        reading host memory (a sum over a buffer larger than the caches)
pcie_pinned_gbs      host -> device copies of expert-sized rows from pinned memory (CUDA only)
pcie_pageable_gbs    the same from pageable memory (CUDA only)
pcie_kernel          what the decode path moves instead (CUDA with Triton only): the same pinned rows read by the
                     GPU's own loads (moe/pairs.stage_experts, the staging kernel offload and hybrid run; the fetch
                     kernels read the same way), every expert in one launch ("all_gbs") and two a launch, a batch-1
                     layer call's misses ("two_gbs", launch and ramp included), with the µs of such a call. Where
                     it falls well below pcie_pinned_gbs, the misses cross PCIe slower than the copy engine could
concurrent           host reads by the CPU threads while pinned host -> device copies run (CUDA only): the two
                     rates at once and their sum. Where the sum is near host_read_gbs, the host's memory (not
                     each bus) is the limit, and hybrid's PCIe copies take bandwidth from its CPU experts
cpu_expert_gbs       expert weight bytes per second the CPU path gets through at bs=1: the bridge's layer call
                     (moe/cpu_moe.LayerCall) over rotating experts, compute.CpuExperts where the kernels do not
                     read the bank; at most host_read_gbs (cpu_expert_measured_gbs: before that cap)
gpu_expert_gbs       the same for the device path (compute.DeviceExperts; CUDA only)

Experts are stored in `--expert-format` (`expert_format`): dense (bf16, the default: the --dtype) or a
compressed format (fp8, nvfp4, mxfp4, q4_k, q8_0, any GGUF type), with random valid weights. Every
rate counts the bytes the experts occupy in that format, i.e. the bytes that are read and copied.

Results go to a JSON profile (default `$XDG_CACHE_HOME/moestream/benchbw.json`) that the engine reads
for `--moe-backend auto` and the hybrid split. Profiles are keyed by device name: one measured on
another GPU is ignored.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import torch

from ..core import ConfigError
from ..hardware import device_name, physical_cores
from .compute import CpuExperts, DeviceExperts, RouteGroups, WeightRef
from .formats import PROJS, ExpertFormat, HFExpertFormat, dense_format, gguf_expert_format, hf_expert_format
from .store import page_locked_zeros

log = logging.getLogger("moestream.bench")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def default_profile_path() -> Path:
    from ..env import cache_dir

    return cache_dir() / "benchbw.json"


def load_profile(device: torch.device, path: Path | None = None) -> dict | None:
    """The saved profile if it was measured on this device, else None (with a log line saying why)."""
    p = path or default_profile_path()
    if not p.is_file():
        return None
    try:
        prof = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        log.warning("ignoring unreadable bench profile %s: %s", p, e)
        return None
    if prof.get("device_name") != device_name(device):
        log.info("bench profile %s was measured on %r, not %r: ignored", p, prof.get("device_name"),
                 device_name(device))
        return None
    return prof


def _best_time(fn, iters: int, sync) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def host_read_gbs(mib: int, iters: int) -> float:
    buf = torch.ones(mib << 18, dtype=torch.float32)  # mib MiB
    t = _best_time(lambda: buf.sum(), iters, lambda: None)
    return buf.numel() * 4 / t / 1e9


def h2d_gbs(bank: dict, experts: int, device: torch.device, pinned: bool, iters: int) -> float:
    """Copy `experts` expert rows, one copy per array per expert, as the offload miss path does."""
    # page-locked at exactly their size (store.page_locked_zeros), not blocks of torch's pinned host allocator, which
    # rounds to powers of two and keeps them for the process: the engine's load-time probe runs this too
    src = {k: (page_locked_zeros(v.shape, v.dtype).copy_(v) if pinned else v) for k, v in bank.items()}
    dst = {k: torch.empty_like(v, device=device) for k, v in bank.items()}

    def run():
        for e in range(experts):
            for k in src:
                dst[k][e].copy_(src[k][e], non_blocking=True)

    t = _best_time(run, iters, lambda: torch.cuda.synchronize(device))
    return experts * sum(v[0].numel() * v.element_size() for v in bank.values()) / t / 1e9


def concurrent_gbs(device: torch.device, mib: int = 512, copy_mib: int = 256, copies: int = 24) -> dict:
    """Host memory read by the CPU threads (a sum, as host_read_gbs) while pinned host -> device copies of copy_mib
    MiB each run (queued at once, `copies` of them: ~0.1 s on a PCIe 5 card): {"cpu_gbs", "pcie_gbs", "sum_gbs"},
    each rate over the copies' own time (the CPU sums until the last copy is done)."""
    buf = torch.ones(mib << 18, dtype=torch.float32)
    src = page_locked_zeros((copy_mib << 20,), torch.uint8)
    dst = torch.empty(copy_mib << 20, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)  # warm: the copy engine and the first touch of both buffers
    buf.sum()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(copies):
        dst.copy_(src, non_blocking=True)
    end.record()
    parts = buf.view(8, -1)  # summed an eighth at a time: the CPU's last sum overruns the copies by little
    sums, t0 = 0, time.perf_counter()
    while not end.query():
        parts[sums % 8].sum()
        sums += 1
    cpu_s = time.perf_counter() - t0
    end.synchronize()
    pcie_s = start.elapsed_time(end) / 1e3
    cpu = sums * parts[0].numel() * 4 / cpu_s / 1e9
    pcie = copies * (copy_mib << 20) / pcie_s / 1e9
    return {"cpu_gbs": round(cpu, 2), "pcie_gbs": round(pcie, 2), "sum_gbs": round(cpu + pcie, 2)}


HF_FORMATS = {"fp8": "fp8_block", "fp8_block": "fp8_block", "fp8_channel": "fp8_channel",
              "fp8_tensor": "fp8_tensor", "nvfp4": "nvfp4", "mxfp4": "mxfp4"}
DENSE_FORMATS = ("bf16", "dense")


def expert_format(name: str, dtype: torch.dtype, hidden: int, inter: int) -> ExpertFormat:
    """--expert-format: bf16/dense (dense in `dtype`), an HF quantization (fp8, nvfp4, ...) or a GGUF type."""
    from ..quant import GGUF_FORMATS, QuantFormatError, get_format

    key = name.lower()
    if key in DENSE_FORMATS:
        return dense_format(dtype)
    try:
        if key in HF_FORMATS:
            qfmt = get_format(HF_FORMATS[key])
            dtypes = {}
            for proj, shape in _logical(hidden, inter).items():
                for part, (_, dt) in qfmt.part_specs(shape).items():
                    dtypes[f"{proj}.{part}"] = dt
            return hf_expert_format(qfmt, dtypes, hidden, inter)
        if key.upper() in GGUF_FORMATS:
            for shape in _logical(hidden, inter).values():
                GGUF_FORMATS[key.upper()].check_shape(shape)
            return gguf_expert_format({p: key.upper() for p in PROJS}, hidden, inter)
    except QuantFormatError as e:
        raise ConfigError(f"--expert-format {name}: {e}") from None
    gguf = [t.lower() for t in GGUF_FORMATS if t.lower() not in (*HF_FORMATS, *DENSE_FORMATS, "f32", "f16")]
    raise ConfigError(f"unknown --expert-format {name!r}: use bf16, {', '.join(HF_FORMATS)} or a GGUF type "
                      f"({', '.join(gguf)})")


def _logical(hidden: int, inter: int) -> dict[str, tuple[int, int]]:
    return {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}


def make_bank(fmt: ExpertFormat, experts: int, hidden: int, inter: int) -> dict[str, torch.Tensor]:
    """Host bank of `experts` random experts stored in `fmt` (array name -> [experts, ...])."""
    if not fmt.quantized:
        return {k: torch.randn((experts, *s), dtype=torch.float32).to(fmt.dtype) for k, s in fmt.shapes(hidden, inter).items()}
    from ..quant import gguf_format
    from ..quant.synthetic import random_raw

    bank = {}
    for i, (proj, shape) in enumerate(_logical(hidden, inter).items()):
        q = fmt.qfmt if isinstance(fmt, HFExpertFormat) else gguf_format(dict(fmt.types)[proj])
        raw = random_raw(q, (experts, *shape), seed=i)
        parts = {proj: raw} if isinstance(raw, torch.Tensor) else {f"{proj}.{k}": v for k, v in raw.items()}
        for name, t in parts.items():
            bank[name] = t.contiguous().view(torch.uint8).reshape(experts, -1)
    want = fmt.shapes(hidden, inter)
    got = {k: tuple(v.shape[1:]) for k, v in bank.items()}
    if got != want:
        raise RuntimeError(f"bench bank layout {got} != format layout {want}")
    return bank


def _optional(measure, *args):
    """A secondary measurement: its failure is one warning line and a null in the profile, not a failed bench."""
    try:
        return measure(*args)
    except Exception as e:  # noqa: BLE001 - reported, the other rates stand
        log.warning("bench bw: %s not measured (%s: %s)", measure.__name__, type(e).__name__, e)
        return None


def kernel_h2d(bank: dict, experts: int, device: torch.device, iters: int) -> dict | None:
    """Pinned expert rows read into device rows by the staging kernel (pairs.stage_experts): every expert in one
    launch, and two a launch (a batch-1 layer call's misses). None where the kernel does not run (no Triton)."""
    from .pairs import stage_experts, triton_ready

    if not triton_ready(device):
        return None
    src = {k: page_locked_zeros(v.shape, v.dtype).copy_(v) for k, v in bank.items()}
    dst = {k: torch.empty_like(v, device=device) for k, v in bank.items()}
    ids = torch.arange(experts, device=device)
    row = sum(v[0].numel() * v.element_size() for v in bank.values())
    sync = lambda: torch.cuda.synchronize(device)  # noqa: E731
    every = torch.tensor(experts, device=device)
    t_all = _best_time(lambda: stage_experts(src, dst, ids, ids, every), iters, sync)
    if experts < 2:
        return {"all_gbs": experts * row / t_all / 1e9, "two_gbs": None, "two_call_us": None}
    two = torch.tensor(2, device=device)
    calls = [ids[i:i + 2] for i in range(0, experts - 1, 2)]

    def pairs():
        for c in calls:
            stage_experts(src, dst, c, c, two)

    t_two = _best_time(pairs, iters, sync)
    return {"all_gbs": experts * row / t_all / 1e9, "two_gbs": 2 * len(calls) * row / t_two / 1e9,
            "two_call_us": t_two / len(calls) * 1e6}


def expert_gbs(bank: dict, top_k: int, hidden: int, dtype, device: torch.device, iters: int, cpu: CpuExperts | None,
               fmt: ExpertFormat | None = None):
    """Weight bytes (as stored) per second of one bs=1 layer call over top_k experts."""
    x = torch.randn(1, hidden, dtype=dtype, device=device)
    ids = torch.arange(top_k, device=device).view(1, top_k)
    w = torch.full((1, top_k), 1.0 / top_k, dtype=dtype, device=device)
    groups = RouteGroups.of(ids)
    refs = {e: WeightRef(bank, e, fmt if fmt is not None and fmt.quantized else None) for e in range(top_k)}
    if cpu is not None and (call := _bridge_call(bank, fmt, x, top_k)) is not None:
        fn, sync = call, (lambda: None)  # noqa: E731
    elif cpu is not None:
        fn = lambda: cpu.submit(x, w, groups, refs).result()  # noqa: E731
        sync = lambda: None  # noqa: E731
    else:
        gpu = DeviceExperts()
        fn = lambda: gpu.compute(x, w, groups, refs)  # noqa: E731
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    t = _best_time(fn, iters, sync)
    return top_k * sum(v[0].numel() * v.element_size() for v in bank.values()) / t / 1e9


def _bridge_call(bank: dict, fmt, x: torch.Tensor, k: int):
    """One bs=1 layer call over the bank's first k experts as the cpu / hybrid backends' bridge makes it
    (moe/cpu_moe.LayerCall: the compiled layer kernel, 16-bit banks included, h rounded to x's dtype), or None
    where the kernels do not read this bank (then the CPU path is compute.CpuExperts's)."""
    from . import cpu_moe

    fmt = fmt if fmt is not None and fmt.quantized else None  # None: a 16-bit bank
    if not cpu_moe.ready(fmt, x, bank):
        return None
    call = cpu_moe.LayerCall(bank, fmt, x.dtype)
    E = call.num_experts
    # each call the next k experts of the bank (a decode step's layers read distinct experts, from memory: the same
    # k every call would be read from the CPU's last-level cache)
    sets = [np.sort((np.arange(k) + i * k) % E).astype(np.int64) for i in range(max(1, E // k))]
    starts = np.arange(k + 1, dtype=np.int64)
    rows, dst, weights = np.zeros(k, dtype=np.int64), np.arange(k, dtype=np.int64), np.full(k, 1.0 / k, np.float32)
    out = torch.empty(k, x.shape[1], dtype=torch.float32)
    turn = [0]

    def one():
        turn[0] += 1
        return call(x, sets[turn[0] % len(sets)], starts, rows, weights, dst, out)

    return one


def run_bench(device: torch.device, hidden: int = 2048, inter: int = 512, dtype: str = "bfloat16",
              experts: int = 32, top_k: int = 8, host_mib: int = 512, iters: int = 5, cpu_threads: int = 0,
              expert_format_name: str = "bf16") -> dict:
    dt = DTYPES[dtype]
    fmt = expert_format(expert_format_name, dt, hidden, inter)
    bank = make_bank(fmt, experts, hidden, inter)
    cuda = device.type == "cuda"
    cpu = CpuExperts(cpu_threads)
    k = min(top_k, experts)
    res = {
        "device_name": device_name(device), "device": device.type, "dtype": dtype, "expert_format": fmt.name,
        "geometry": {"hidden": hidden, "inter": inter, "experts": experts, "top_k": k},
        "expert_bytes": fmt.bytes_per_expert(hidden, inter), "cpu_threads": cpu.threads,
        "physical_cores": physical_cores(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "host_read_gbs": host_read_gbs(host_mib, iters),
        "pcie_pinned_gbs": h2d_gbs(bank, experts, device, True, iters) if cuda else None,
        "pcie_pageable_gbs": h2d_gbs(bank, experts, device, False, iters) if cuda else None,
        "pcie_kernel": _optional(kernel_h2d, bank, experts, device, iters) if cuda else None,
        "concurrent": concurrent_gbs(device) if cuda else None,
        "cpu_expert_gbs": expert_gbs(bank, k, hidden, dt, torch.device("cpu"), iters, cpu, fmt),
        "gpu_expert_gbs": (expert_gbs({n: v.to(device) for n, v in bank.items()}, k, hidden, dt, device, iters, None, fmt)
                           if cuda else None),
    }
    cpu.close()
    # a decode step's CPU experts come from memory: a rate above the host's read is the last-level cache's
    res["cpu_expert_measured_gbs"] = res["cpu_expert_gbs"]
    res["cpu_expert_gbs"] = min(res["cpu_expert_gbs"], res["host_read_gbs"])
    res["recommended"] = recommend(res)
    return res


QUICK_READ_MIB = 128  # quick_bandwidths' host read: past any last-level cache, ~10 ms to sum


def quick_bandwidths(device: torch.device, fmt: ExpertFormat, hidden: int, inter: int, top_k: int, dtype: torch.dtype,
                     cpu_threads: int = 0, iters: int = 3):
    """What `--moe-backend auto` weighs when no `bench bw` profile was saved for this device: pinned PCIe and the
    CPU experts' rate, measured in well under a second on 2 x top_k random experts stored in the model's own expert
    format (a full profile measures 32 and repeats more). Returns planner.Bandwidths (host read and GPU experts not
    measured: 0)."""
    from .planner import Bandwidths

    per_layer = getattr(fmt, "per_layer", None)
    if per_layer:  # per-layer GGUF types (Q4_K_M): the largest layer format, the one most layers' misses move
        fmt = max((f for _, f in per_layer), key=lambda f: f.bytes_per_expert(hidden, inter))
    experts = 2 * top_k
    bank = make_bank(fmt, experts, hidden, inter)
    cpu = CpuExperts(cpu_threads)
    try:
        cpu_gbs = expert_gbs(bank, top_k, hidden, dtype, torch.device("cpu"), iters, cpu, fmt)
        # so few experts stay in the CPU's last-level cache; a decode step reads its experts from memory
        cpu_gbs = min(cpu_gbs, host_read_gbs(QUICK_READ_MIB, iters))
    finally:
        cpu.close()
    pcie = h2d_gbs(bank, experts, device, True, iters) if device.type == "cuda" else 0.0
    return Bandwidths(pcie_pinned_gbs=pcie, cpu_expert_gbs=cpu_gbs)


def recommend(res: dict) -> str:
    """The backend `auto` would pick for a model whose experts do not fit the device."""
    from .planner import Bandwidths, HYBRID_MIN_CPU_SHARE

    if res.get("device") != "cuda":
        return "fused (CPU device: experts are computed in place)"
    bw = Bandwidths.from_profile(res)
    share = bw.cpu_expert_gbs / bw.pcie_pinned_gbs if bw.pcie_pinned_gbs else 0.0
    return "hybrid" if share >= HYBRID_MIN_CPU_SHARE else "offload"


def format_table(res: dict) -> str:
    rows = [("host memory read", res["host_read_gbs"]), ("H2D pinned (expert rows)", res["pcie_pinned_gbs"]),
            ("H2D pageable (expert rows)", res["pcie_pageable_gbs"]), ("CPU experts (bs=1)", res["cpu_expert_gbs"]),
            ("GPU experts (bs=1)", res["gpu_expert_gbs"])]
    g = res["geometry"]
    lines = [f"device {res['device_name']}, expert {g['hidden']}x{g['inter']} stored as {res.get('expert_format', res['dtype'])} "
             f"({res['expert_bytes'] / 2**20:.2f} MiB; GB/s count these bytes), activations {res['dtype']}, "
             f"top-k {g['top_k']}, cpu threads {res['cpu_threads']}",
             f"{'measure':<28}{'GB/s':>10}"]
    lines += [f"{name:<28}{('n/a' if v is None else f'{v:.2f}'):>10}" for name, v in rows]
    kern = res.get("pcie_kernel")
    if kern:
        two = (f"  (two experts a launch, as a batch-1 layer call's misses: {kern['two_gbs']:.2f} GB/s, "
               f"{kern['two_call_us']:.0f} us a call)") if kern["two_gbs"] else ""
        lines.append(f"{'H2D by the staging kernel':<28}{kern['all_gbs']:>10.2f}{two}")
    both = res.get("concurrent")
    if both:
        lines.append(f"{'host read + H2D at once':<28}{both['sum_gbs']:>10.2f}  (CPU {both['cpu_gbs']:.2f} + PCIe "
                     f"{both['pcie_gbs']:.2f}: what hybrid's CPU experts and PCIe copies can share)")
    from .planner import HYBRID_MAX_RESIDENCY, HYBRID_MIN_RESIDENCY

    where = (f" (where its cache would hold {HYBRID_MIN_RESIDENCY:.0%}-{HYBRID_MAX_RESIDENCY:.0%} of the experts; "
             "offload above, cpu below)" if res["recommended"] == "hybrid" else "")
    lines.append(f"auto would choose (experts not fitting the device): {res['recommended']}{where}")
    return "\n".join(lines)


def save_profile(res: dict, path: Path | None = None) -> Path:
    p = Path(path) if path else default_profile_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=2))
    tmp.replace(p)  # atomic: a reader never sees half a profile
    return p

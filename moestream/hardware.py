"""The one module that probes this machine: host RAM, physical cores, CPU feature flags (the instruction sets
the CPU kernels build for) and the device's name. Every other module asks here instead of reading /proc,
sysfs or sysconf itself (moe/hardware.py turns these facts into the planner's `Hardware`)."""
from __future__ import annotations

import os
from functools import lru_cache

import torch


def host_memory() -> tuple[int, int]:
    """(total, available) host RAM in bytes, from /proc/meminfo (sysconf fallback)."""
    try:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                info[key] = int(value.split()[0]) * 1024
        return info["MemTotal"], info.get("MemAvailable", info["MemFree"])
    except (OSError, KeyError, ValueError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total // 2


def allowed_cpus() -> list[int]:
    """The logical CPUs this process may run on (its affinity; every CPU where affinity is unknown)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return list(range(os.cpu_count() or 1))


def sibling_groups(cpus: list[int]) -> list[tuple[int, ...]]:
    """The CPUs grouped by physical core (from sysfs; one group per CPU where it cannot be read)."""
    groups: dict[str, list[int]] = {}
    for c in sorted(cpus):
        try:
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list") as f:
                key = f.read().strip()
        except OSError:
            key = str(c)
        groups.setdefault(key, []).append(c)
    return [tuple(g) for g in sorted(groups.values())]


def physical_cores() -> int:
    """Physical cores this process may run on (SMT siblings counted once)."""
    return max(1, len(sibling_groups(allowed_cpus())))


@lru_cache(maxsize=None)
def _cpuinfo_flags() -> frozenset | None:
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return None


def cpu_flags() -> frozenset:
    """The CPU feature flags of /proc/cpuinfo (empty where it cannot be read)."""
    return _cpuinfo_flags() or frozenset()


@lru_cache(maxsize=None)
def cpu_has_native(dtype) -> bool:
    """Whether this CPU multiplies `dtype` natively (AVX512-BF16 / AMX-BF16, AVX512-FP16 / AMX-FP16)."""
    flags = _cpuinfo_flags()
    if flags is None:
        return True  # unknown CPU: keep torch's own kernel
    want = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}
    return any(flag in flags for flag in want.get(dtype, ()))


WIDEN_MIN_ROWS = 16  # rows from which a 16-bit GEMM on such a CPU is faster in float32 (kernels/linear.py)


def widen_gemm(x, w_dtype) -> bool:
    """Whether a GEMM of activations x with `w_dtype` weights should run in float32: x on a CPU without
    native multiplies of that 16-bit dtype (cpu_has_native), and at least WIDEN_MIN_ROWS rows of x."""
    return (x.device.type == "cpu" and w_dtype in (torch.bfloat16, torch.float16)
            and x.numel() >= WIDEN_MIN_ROWS * x.shape[-1] and not cpu_has_native(w_dtype))


def device_name(device: torch.device) -> str:
    """The GPU's name (torch.cuda.get_device_name), "cpu" for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"

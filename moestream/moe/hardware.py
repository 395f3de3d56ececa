"""What the planner needs to know about this machine (measured once, before allocating): the facts of
moestream/hardware.py plus the GPU's free memory and CUDA context; and this process's memory (RSS, madvise)."""
from __future__ import annotations

import torch

from ..hardware import device_name, host_memory, physical_cores
from .planner import Hardware


def process_memory() -> dict[str, int]:
    """This process's host memory in bytes: resident set now (`rss`; `rss_anon`: its own memory, `rss_file`:
    pages of mapped files, e.g. expert banks mapped from the checkpoint, which the kernel can drop and
    re-read; `rss_shmem`: shared memory — CUDA's pinned host allocations, and a checkpoint on tmpfs such as
    /dev/shm) and its peak (`peak_rss`), from /proc/self/status; getrusage's peak elsewhere."""
    keys = {"VmRSS": "rss", "VmHWM": "peak_rss", "RssAnon": "rss_anon", "RssFile": "rss_file", "RssShmem": "rss_shmem"}
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in keys:
                    out[keys[key]] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        out = {"rss": peak, "peak_rss": peak}
    return out


def release_pages(addr: int, nbytes: int) -> int:
    """Drop this process's resident pages of a FILE MAPPING within [addr, addr + nbytes) (the whole pages inside
    it), read-only shared or private with pages never written: RSS falls, the bytes stay in the file and are
    read again if touched. Never call it on other memory (madvise(MADV_DONTNEED) zeroes anonymous pages and
    the written pages of a private mapping). Returns the bytes released (0 where madvise is unavailable)."""
    import mmap

    return madvise(addr, nbytes, MADV_DONTNEED, mmap.PAGESIZE)


MADV_DONTNEED, MADV_HUGEPAGE = 4, 14


def madvise(addr: int, nbytes: int, advice: int, align: int) -> int:
    """madvise(advice) on the whole `align`-byte units inside [addr, addr + nbytes); the bytes advised, 0 where
    there are none, madvise is unavailable or the kernel refuses."""
    import ctypes

    lo, hi = -(-addr // align) * align, (addr + nbytes) // align * align
    if hi <= lo:
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return hi - lo if libc.madvise(lo, hi - lo, advice) == 0 else 0
    except (OSError, AttributeError):
        return 0


CONTEXT_MAX = 2 << 30  # a larger figure means other processes share the GPU: theirs is not ours to count


def cuda_context_bytes(device: torch.device) -> int:
    """GPU memory in use outside torch's caching allocator after the CUDA context, cuBLAS and a first
    GEMM exist: the process's fixed cost, which `--gpu-memory-gb` (a cap on the whole process) must cover.
    Measured as device-wide used memory less torch's reserved bytes, so another process's memory on the
    same GPU would count too: the figure is capped at CONTEXT_MAX (contexts take 0.3-1.5 GiB)."""
    with torch.device(device):
        a = torch.ones(64, 64, dtype=torch.bfloat16)
        (a @ a).sum().item()  # loads cuBLAS(Lt) and its workspace
        del a
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    used = total - free - torch.cuda.memory_reserved(device)
    return int(min(max(used, 0), CONTEXT_MAX))


def probe_hardware(device: torch.device) -> Hardware:
    total, avail = host_memory()
    context = 0
    if device.type == "cuda":
        context = cuda_context_bytes(device)
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device)  # torch's cache is ours to reuse
    else:
        free = avail
    return Hardware(device=device.type, name=device_name(device), free_bytes=int(free), host_total_bytes=total,
                    host_available_bytes=avail, physical_cores=physical_cores(), context_bytes=context)

"""What the planner needs to know about this machine (measured once, before allocating)."""
from __future__ import annotations

import os

import torch

from .compute import physical_cores
from .planner import Hardware


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


def probe_hardware(device: torch.device) -> Hardware:
    total, avail = host_memory()
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        name = torch.cuda.get_device_name(device)
    else:
        free, name = avail, "cpu"
    return Hardware(device=device.type, name=name, free_bytes=int(free), host_total_bytes=total,
                    host_available_bytes=avail, physical_cores=physical_cores())

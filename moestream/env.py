"""The one module that reads the environment (DESIGN.md §2)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """moestream's cache folder: $XDG_CACHE_HOME/moestream, else ~/.cache/moestream."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moestream"


def triton_enabled() -> bool:
    """MOESTREAM_TRITON=0 turns the Triton kernels off (dequantization in moestream.quant, RMSNorm and the
    Gated DeltaNet decode step in layers/triton_ops.py): the torch reference paths run instead."""
    return os.environ.get("MOESTREAM_TRITON", "1") != "0"


def cpu_gemms() -> str:
    """MOESTREAM_CPU_GEMMS: how the CPU expert worker of hybrid/cpu decode on a GPU runs its experts' GEMMs:
    "threads" (default: experts side by side on single-threaded Python threads) or "omp" (one after another,
    each over torch's intra-op threads)."""
    v = os.environ.get("MOESTREAM_CPU_GEMMS", "threads")
    if v not in ("threads", "omp"):
        raise ValueError(f"MOESTREAM_CPU_GEMMS must be threads or omp, got {v!r}")
    return v

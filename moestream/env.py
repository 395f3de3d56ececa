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


"""`linear(x, w)`: F.linear, except for 16-bit weights on a CPU without native 16-bit GEMMs.

There torch's bf16/fp16 GEMM runs at a fraction of float32's speed (measured on an AVX2 machine:
~21 GFLOP/s at any batch against 117-173 GFLOP/s for float32 at 64-512 rows). For 16 or more rows
(prefill, larger decode batches) the weight is widened to float32 a block of rows at a time (at most
WIDEN_BLOCK_BYTES of float32 at once, so a vocabulary head never doubles in memory), multiplied in
float32 and the result rounded back to the activations' dtype: the same products accumulated in
float32 as the 16-bit kernel does, rounded once. Below 16 rows the GEMM is bound by reading the
weight, where the 16-bit kernel reads half the bytes, so it stays as it is. float32 activations against 16-bit
weights (a CPU's routed experts kept in the checkpoint's bf16 / f16 while the model computes in float32) take
the widened path at any row count.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..hardware import widen_gemm

WIDEN_BLOCK_BYTES = 64 << 20


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias), float32 inside where 16-bit GEMMs are slow (module docstring)."""
    if x.dtype == w.dtype and not widen_gemm(x, w.dtype):
        return F.linear(x, w, bias)
    n, k = w.shape
    xf = x.reshape(-1, k).float()
    out = torch.empty(xf.shape[0], n, dtype=x.dtype)
    step = max(1, WIDEN_BLOCK_BYTES // (4 * k))
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        y = xf @ w[r0:r1].float().t()
        if bias is not None:
            y += bias[r0:r1].float()
        out[:, r0:r1] = y
    return out.reshape(*x.shape[:-1], n)


class Linear(nn.Linear):
    """nn.Linear whose forward is `linear` (same parameters, same state-dict names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

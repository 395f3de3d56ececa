"""RMSNorm variants used by the Qwen3 families."""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from . import triton_ops


class RMSNorm(nn.Module):
    """y = x / rms(x) * scale, computed in fp32.

    zero_centered=True stores w with scale = 1 + w (Qwen3.5); otherwise scale = w (Qwen3).
    Qwen3.5 multiplies in fp32 and casts last; Qwen3 casts the normalised x first, then multiplies
    (the order matters in bf16, so each follows its reference).
    """

    def __init__(self, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.zero_centered = zero_centered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if triton_ops.enabled(x):
            return triton_ops.rms_norm(x, self.weight, self.eps, self.zero_centered)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual [T, dim] -> (norm(residual + x), residual + x): the decoder's residual add, fused
        into the norm's kernel on CUDA."""
        if triton_ops.enabled(x) and x.dim() == 2 and x.is_contiguous() and residual.is_contiguous() \
                and residual.dtype == x.dtype:
            return triton_ops.add_rms_norm(x, residual, self.weight, self.eps, self.zero_centered)
        h = residual + x
        return self(h), h


class GatedRMSNorm(nn.Module):
    """RMSNorm of the Gated DeltaNet output, then multiplied by silu(gate). Shape [..., dim]."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor, dest: torch.Tensor | None = None) -> torch.Tensor:
        """dest [G] (optional): x [..., G, dim]'s rows g written to rows dest[g] of the output (same shape)."""
        if triton_ops.enabled(x):
            return triton_ops.rms_norm(x, self.weight, self.eps, False, gate, dest)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = (self.weight * xf.to(dtype) * F.silu(gate.float())).to(dtype)
        if dest is None:
            return y
        out = torch.empty_like(y)
        out[..., dest.long(), :] = y
        return out

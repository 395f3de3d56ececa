"""Rotary position embedding (neox layout, optionally on the first `rotary_dim` channels only)."""
from __future__ import annotations

import torch


class Rotary:
    """Precomputed cos/sin tables; `apply(q, k, positions)` rotates q [T, Hq, D] and k [T, Hk, D]."""

    def __init__(self, rotary_dim: int, theta: float, max_positions: int, device, dtype):
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        # The reference computes cos/sin in fp32 and casts them to the activation dtype.
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)
        self.rotary_dim = rotary_dim
        self.max_positions = max_positions

    def apply(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin, self.rotary_dim), _rotate(k, cos, sin, self.rotary_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rd: int) -> torch.Tensor:
    xr, xp = x[..., :rd], x[..., rd:]
    half = rd // 2
    rot = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    out = xr * cos + rot * sin
    return torch.cat([out, xp], dim=-1) if xp.shape[-1] else out

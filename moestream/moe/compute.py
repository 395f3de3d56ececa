"""Routed-expert computation, torch reference (every backend must agree with it).

x [T, H], topk_ids [T, k], topk_w [T, k]; gate_up [N, 2I, H], down [N, H, I] where N indexes either
experts (fused) or cache slots (offload: pass `index` mapping expert id -> slot).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def route_groups(topk_ids: torch.Tensor):
    """Sort the (token, k) pairs by expert. Returns (experts hit, counts, token rows, k positions) on CPU
    lists/tensors so the loop below runs once per expert hit."""
    flat = topk_ids.flatten()
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    k = topk_ids.shape[1]
    return experts.tolist(), counts.tolist(), order // k, order % k


def expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """SwiGLU MLP of one expert: x [n, H], gate_up [2I, H], down [H, I]."""
    g, u = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, down)


def moe_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, index: dict[int, int] | None = None,
                  only: set[int] | None = None) -> torch.Tensor:
    """Sum over each token's experts of w * mlp_e(x). `only` restricts to a subset of expert ids."""
    out = torch.zeros_like(x)
    experts, counts, rows, pos = route_groups(topk_ids)
    start = 0
    for e, n in zip(experts, counts):
        r, p = rows[start:start + n], pos[start:start + n]
        start += n
        if only is not None and e not in only:
            continue
        i = e if index is None else index[e]
        y = expert_mlp(x[r], gate_up[i], down[i]) * topk_w[r, p, None]
        out.index_add_(0, r, y.to(out.dtype))
    return out

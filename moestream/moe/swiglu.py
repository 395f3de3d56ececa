"""The experts' SwiGLU, written once: y = down @ (silu(gate @ x) * (up @ x)).

    swiglu(g, u, dtype, out)          h = silu(g) * u, the activation of every torch path (the grouped loop and
                                      ExpertFormat.expert_mlp, the pair and quantized-pair torch references, the
                                      CPU bridge's PairMlp / QuantPairMlp, the model's dense and shared MLPs);
                                      `dtype`: where a path rounds h before the down projection (the pair paths
                                      round it to the activations' dtype)
    expert_mlp(x, gate_up, down)      one dense expert through kernels.linear's GEMMs (the grouped path)
    reference(x, gate, up, down)      the oracle the expert kernels are tested against (Triton pairs and
                                      quantized pairs, the grouped GEMMs, the compiled CPU layer call, the
                                      bridge): dense weights, float64 arithmetic by default, h rounded to
                                      `h_dtype` where the kernel under test rounds it
    reference_pairs(x, topk_w, ids, gate, up, down)
                                      the pair contract's oracle: y[p] = w[p] * reference(x[p // k], expert
                                      ids[p]) for every (token, k) pair p = t * k + j
The Triton and C kernels (moe/pairs.py, qpairs.py, grouped.py, kernels/cpu) compute the same expression in
registers; their rounding points are documented where they are written.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.linear import linear


def swiglu(g: torch.Tensor, u: torch.Tensor, dtype: torch.dtype | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(g) * u in the inputs' dtype, then rounded to `dtype` (None: not rounded); `out`: written there
    (cast on write, as rounding to its dtype)."""
    if out is not None:
        return torch.mul(F.silu(g), u, out=out)
    h = F.silu(g) * u
    return h if dtype is None else h.to(dtype)


def expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """SwiGLU MLP of one dense expert: x [n, H], gate_up [2I, H], down [H, I] (kernels.linear's GEMMs)."""
    g, u = linear(x, gate_up).chunk(2, dim=-1)
    return linear(swiglu(g, u), down)


def reference(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
              h_dtype: torch.dtype | None = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """One expert on x [n, H] from dense gate [I, H], up [I, H], down [H, I], computed in `dtype`; h rounded
    to h_dtype first where given (then back to `dtype`). Returns [n, H] in `dtype`."""
    xd = x.to(dtype)
    h = swiglu(xd @ gate.to(dtype).T, xd @ up.to(dtype).T)
    if h_dtype is not None:
        h = h.to(h_dtype).to(dtype)
    return h @ down.to(dtype).T


def reference_pairs(x: torch.Tensor, topk_w: torch.Tensor, ids: torch.Tensor, gate: torch.Tensor,
                    up: torch.Tensor, down: torch.Tensor, h_dtype: torch.dtype | None = None,
                    dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """[T * k, H] in `dtype`, on the CPU: pair p = t * k + j is w[t, j] * reference(x[t]) of expert ids[t, j],
    from stacked dense banks gate/up [E, I, H], down [E, H, I]. Summing each token's k rows (`.view(T, k, H)
    .sum(1)`) gives the layer's output."""
    k = ids.shape[1]
    flat, xs, w = ids.reshape(-1).cpu(), x.cpu(), topk_w.reshape(-1).cpu().to(dtype)
    out = torch.empty(flat.numel(), x.shape[1], dtype=dtype)
    for e in torch.unique(flat).tolist():
        p = torch.nonzero(flat == e).flatten()
        y = reference(xs[p // k], gate[e].cpu(), up[e].cpu(), down[e].cpu(), h_dtype, dtype)
        out[p] = y * w[p, None]
    return out


def split_gate_up(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked gate_up [..., 2I, H] (rows [0, I) gate, [I, 2I) up) -> (gate, up) views."""
    return gate_up.chunk(2, dim=-2)

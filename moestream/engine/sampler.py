"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds."""
from __future__ import annotations

import torch

from ..core import SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.seed is None or params.greedy:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(int(params.seed))
    return g


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row [V] of fp32 logits -> tempered, filtered logits (-inf outside the kept set)."""
    x = logits / p.temperature
    if p.top_k > 0 and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.min_p > 0.0:
        probs = torch.softmax(x, -1)
        x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        cum = torch.softmax(sorted_x, -1).cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
        drop = (cum - torch.softmax(sorted_x, -1)) >= p.top_p
        x = x.scatter(0, order, sorted_x.masked_fill(drop, float("-inf")))
    return x


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """logits [B, V] fp32 -> one token id per row."""
    out = torch.argmax(logits, dim=-1)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = torch.softmax(filter_logits(logits[i], p), -1)
        out[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
    return out.tolist()

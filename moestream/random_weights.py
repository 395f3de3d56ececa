"""Random weights, by one rule of what each parameter is (`param_role`: a norm scale, Gated DeltaNet's
A_log and dt_bias, or a matrix drawn from a normal distribution), with two recipes for the values:

- `random_weights`: a model and expert store filled in memory (benchmarks of full-size shapes without
  files: `load_weights` with no folder). Cheap to draw at any size.
- `demo_tensor`: one tensor of the built-in demo checkpoint (`demo.py` writes them to a safetensors file),
  deterministic per name and scaled so that the tiny model's logits are well spread.
"""
from __future__ import annotations

import math
import zlib

import torch


def param_role(name: str) -> str:
    """"norm" (an RMSNorm scale), "gated_norm" (Gated DeltaNet's output norm, which scales by w, not 1 + w),
    "A_log", "dt_bias", or "matrix"."""
    if name.endswith("norm.weight") and "linear_attn" not in name:
        return "norm"
    if name.endswith("linear_attn.norm.weight"):
        return "gated_norm"
    if name.endswith("A_log"):
        return "A_log"
    if name.endswith("dt_bias"):
        return "dt_bias"
    return "matrix"


@torch.no_grad()
def random_weights(model: torch.nn.Module, store, cfg, seed: int = 0, std: float = 0.02) -> None:
    """Sane random weights for `model` and its `moe.ExpertStore` (cfg: the ModelConfig): identity norms,
    N(0, std) matrices, GDN decay parameters in range.
    Routed experts: one random layer bank copied (rolled by layer) into every layer, because drawing
    tens of GB of random numbers would dominate a benchmark's start-up; routing stays per-layer
    random because routers are drawn independently."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    gens: dict = {}  # one generator per device: drawing on the GPU keeps start-up short at full size

    def randn(shape, device):
        if device not in gens:
            gens[device] = torch.Generator(device=device).manual_seed(seed)
        return torch.randn(shape, generator=gens[device], device=device)

    for name, p in model.named_parameters():
        role = param_role(name)
        if role == "norm":
            p.fill_(0.0 if cfg.norm_zero_centered else 1.0)
        elif role in ("gated_norm", "dt_bias"):
            p.fill_(1.0)
        elif role == "A_log":
            p.copy_(torch.empty(p.shape).uniform_(0.0, 2.0, generator=g).log1p())
        else:
            p.copy_(randn(p.shape, p.device) * std)
    pool: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(store.moe_layers):
        for name, bank in store.banks.items():
            layer_bank = bank[layer]
            if name not in pool:
                pool[name] = (torch.randn(layer_bank.shape, generator=g) * std).to(layer_bank.dtype)
            src = torch.roll(pool[name], shifts=i, dims=0) if i else pool[name]
            store.put_stacked(layer, name, src, f"random:{name}")


def demo_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Deterministic per-tensor values, scaled so that logits are well spread (greedy output is stable)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    role = param_role(name)
    if role == "A_log":
        return (torch.rand(shape, generator=g) * 1.9 + 0.1).log()  # per-step decay spans ~0.1..0.97
    if role == "dt_bias":
        return torch.rand(shape, generator=g) * 2 - 1
    if role != "matrix":
        # Qwen3.5 RMSNorms scale by (1 + w) and start at 0; the gated norm in linear_attn scales by w.
        ident = 1.0 if role == "gated_norm" else 0.0
        return torch.randn(shape, generator=g) * 0.1 + ident
    fan_in = math.prod(shape[1:])
    std = 0.5 if name.endswith(("mlp.gate.weight", "lm_head.weight")) else 1.6 / math.sqrt(fan_in)
    return torch.randn(shape, generator=g) * std

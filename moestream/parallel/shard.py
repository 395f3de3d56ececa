"""Shard a loaded model in place for one tensor-parallel rank (Megatron-style column/row parallel).

Per rank r of n:
- attention: query heads [r*H/n, (r+1)*H/n) and kv heads likewise (the GQA groups stay whole); the
  Qwen3.5 q_proj rows are [query | gate] per head, so a head's 2*D rows move together; o_proj keeps
  the matching columns and all-reduces its output;
- Gated DeltaNet: key heads and value heads likewise (a value head's key head stays on its rank);
  in_proj_qkv and conv1d take the q, k and v channels of the local heads from each section, in_proj_z,
  in_proj_a/b, A_log and dt_bias the local value heads; out_proj all-reduces;
- dense MLP and shared expert: gate/up rows (column parallel), down columns (row parallel); the MLP
  all-reduces its down_proj output, the MoE block all-reduces once its routed + shared partial sum
  (routed experts are sharded by intermediate dimension in the expert store, see parallel/experts.py);
  routers, norms and shared_expert_gate are replicated;
- embedding and lm_head: vocab rows [r*Vp, (r+1)*Vp), Vp = ceil(V/n), zero-padded; the embedding
  masks ids it does not hold and all-reduces, lm_head all-gathers the logits.
Forward code needs no change: the layers read their (now local) head counts from their attributes.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn
import torch.nn.functional as F

from ..config import ModelConfig
from ..core import ConfigError
from ..kernels.linear import linear
from ..layers.attention import Attention
from ..layers.gdn import GatedDeltaNet
from ..models.qwen_moe import MLP, QwenMoeModel, SparseMoeBlock


def check_divisible(cfg: ModelConfig, n: int) -> None:
    """Every sharded width must split evenly over n ranks; one ConfigError listing what does not."""
    dims = {}
    if cfg.full_attention_layers:
        dims.update({"num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads})
    if cfg.linear_attention_layers:
        dims.update({"linear_num_key_heads": cfg.linear_num_key_heads,
                     "linear_num_value_heads": cfg.linear_num_value_heads})
    if any(cfg.moe_layers):
        dims["moe_intermediate_size"] = cfg.moe_intermediate_size
        if cfg.shared_expert_intermediate_size:
            dims["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    if not all(cfg.moe_layers):
        dims["intermediate_size"] = cfg.intermediate_size
    bad = [f"{k} {v}" for k, v in dims.items() if v % n]
    if bad:
        raise ConfigError(f"--tp-size {n} must divide the model's {', '.join(bad)}")


def local_config(cfg: ModelConfig, n: int) -> ModelConfig:
    """The ModelConfig of one rank's shard: what its layers, pools and memory plan are sized from."""
    def div(v: int) -> int:
        return v // n

    return dataclasses.replace(
        cfg, num_heads=div(cfg.num_heads), num_kv_heads=div(cfg.num_kv_heads), vocab_size=-(-cfg.vocab_size // n),
        linear_num_key_heads=div(cfg.linear_num_key_heads), linear_num_value_heads=div(cfg.linear_num_value_heads),
        moe_intermediate_size=div(cfg.moe_intermediate_size), intermediate_size=div(cfg.intermediate_size),
        shared_expert_intermediate_size=div(cfg.shared_expert_intermediate_size))


def meta_model(cfg: ModelConfig, dtype: torch.dtype) -> QwenMoeModel:
    """Shapes only (no memory): what the planner counts as one rank's dense bytes."""
    with torch.device("meta"):
        return QwenMoeModel(cfg).to(dtype)


# ---- row-parallel outputs and vocab-parallel ends ------------------------------------------------
class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W_local^T): the input columns of this rank, the output summed."""

    def __init__(self, weight: torch.Tensor, tp):
        super().__init__()
        self.weight = _param(weight)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(linear(x, self.weight))


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + Vp) of the table; ids held by another rank give zeros before the all-reduce."""

    def __init__(self, weight: torch.Tensor, tp):
        super().__init__()
        self.per_rank = -(-weight.shape[0] // tp.size)
        self.start = tp.rank * self.per_rank
        self.weight = _param(_vocab_rows(weight, self.start, self.per_rank))
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(h.masked_fill_(outside.unsqueeze(-1), 0))


class ParallelLMHead(nn.Module):
    """Logits of this rank's vocab rows, all-gathered to the full [T, V] on every rank."""

    def __init__(self, weight: torch.Tensor, tp):
        super().__init__()
        self.vocab_size = weight.shape[0]
        per_rank = -(-self.vocab_size // tp.size)
        self.weight = _param(_vocab_rows(weight, tp.rank * per_rank, per_rank))
        self.tp = tp

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(linear(h, self.weight))[..., :self.vocab_size]


# ---- the recipe ---------------------------------------------------------------------------------
@torch.no_grad()
def shard_model(model: QwenMoeModel, tp) -> QwenMoeModel:
    check_divisible(model.cfg, tp.size)
    for layer in model.layers:
        if layer.kind == "linear_attention":
            _shard_gdn(layer.linear_attn, tp)
        else:
            _shard_attention(layer.self_attn, tp)
        if isinstance(layer.mlp, SparseMoeBlock):
            if layer.mlp.shared_expert is not None:
                _shard_mlp(layer.mlp.shared_expert, tp, reduce=False)
            # routed (from the runtime) + gated shared expert: partial sums, reduced once
            layer.mlp.register_forward_hook(lambda module, args, out: tp.all_reduce(out))
        else:
            _shard_mlp(layer.mlp, tp, reduce=True)
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight, tp)
    model.lm_head = ParallelLMHead(model.lm_head.weight, tp)
    return model


def _shard_attention(a: Attention, tp) -> None:
    r, n = tp.rank, tp.size
    h, hk, D = a.num_heads // n, a.num_kv_heads // n, a.head_dim
    per_head = D * (2 if a.output_gate else 1)  # Qwen3.5: [query (D) | gate (D)] rows per head
    _rows(a.q_proj, slice(r * h * per_head, (r + 1) * h * per_head))
    _rows(a.k_proj, slice(r * hk * D, (r + 1) * hk * D))
    _rows(a.v_proj, slice(r * hk * D, (r + 1) * hk * D))
    a.o_proj = RowParallelLinear(a.o_proj.weight[:, r * h * D:(r + 1) * h * D], tp)
    a.num_heads, a.num_kv_heads = h, hk


def _shard_gdn(g: GatedDeltaNet, tp) -> None:
    r, n = tp.rank, tp.size
    hk, hv = g.hk // n, g.hv // n
    kl, vl = hk * g.dk, hv * g.dv
    # in_proj_qkv rows and conv channels: [q (key_dim) | k (key_dim) | v (value_dim)], heads in order
    chans = torch.cat([torch.arange(r * kl, (r + 1) * kl), g.key_dim + torch.arange(r * kl, (r + 1) * kl),
                       2 * g.key_dim + torch.arange(r * vl, (r + 1) * vl)]).to(g.in_proj_qkv.weight.device)
    _rows(g.in_proj_qkv, chans)
    g.conv1d.weight = _param(g.conv1d.weight[chans])
    g.conv1d.in_channels = g.conv1d.out_channels = g.conv1d.groups = 2 * kl + vl
    _rows(g.in_proj_z, slice(r * vl, (r + 1) * vl))
    heads = slice(r * hv, (r + 1) * hv)
    _rows(g.in_proj_a, heads)
    _rows(g.in_proj_b, heads)
    g.A_log = _param(g.A_log[heads])
    g.dt_bias = _param(g.dt_bias[heads])
    g.out_proj = RowParallelLinear(g.out_proj.weight[:, r * vl:(r + 1) * vl], tp)
    g.hk, g.hv, g.key_dim, g.value_dim, g.conv_dim = hk, hv, kl, vl, 2 * kl + vl


def _shard_mlp(m: MLP, tp, reduce: bool) -> None:
    i = m.gate_proj.out_features // tp.size
    part = slice(tp.rank * i, (tp.rank + 1) * i)
    _rows(m.gate_proj, part)
    _rows(m.up_proj, part)
    if reduce:
        m.down_proj = RowParallelLinear(m.down_proj.weight[:, part], tp)
    else:
        m.down_proj.weight = _param(m.down_proj.weight[:, part])
        m.down_proj.in_features = i


def _rows(lin: nn.Linear, rows) -> None:
    lin.weight = _param(lin.weight[rows])
    lin.out_features = lin.weight.shape[0]


def _vocab_rows(weight: torch.Tensor, start: int, count: int) -> torch.Tensor:
    out = weight.new_zeros((count, weight.shape[1]))
    part = weight[start:start + count]
    out[:part.shape[0]] = part
    return out


def _param(t: torch.Tensor) -> nn.Parameter:
    # a copy, so the full tensor the slice came from is freed
    return nn.Parameter(t.clone(memory_format=torch.contiguous_format), requires_grad=False)

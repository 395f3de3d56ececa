"""Qwen3-MoE (Qwen3MoeForCausalLM), Qwen3.5/3.6-MoE (Qwen3_5Moe*) and the dense Llama / Qwen3 models.

One decoder serves all: the config switches the token mixer per layer (GQA attention or Gated
DeltaNet), the attention output gate, q/k norms, zero-centred norms and dense vs MoE MLP per layer.

Plain reference-style model code; parameter names are the HF checkpoint names without the prefix.
Routed experts are not parameters here: each MoE block asks the expert runtime (`moe/`) to compute
them, so where they live is not the model's business.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..env import shared_down_fused
from ..batch import ForwardBatch
from ..layers.attention import Attention
from ..layers.gdn import GatedDeltaNet
from ..kernels.linear import Linear, linear
from ..layers import triton_ops
from ..layers.norm import RMSNorm
from ..layers.rotary import Rotary
from ..moe.swiglu import swiglu


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, normalize: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.top_k, self.normalize = top_k, normalize

    def forward(self, x):
        """x [T, H] -> (topk ids [T, k], topk weights [T, k] in x.dtype, logits [T, E])."""
        return self.route(linear(x, self.weight))

    def route(self, logits):
        """logits [T, E] (a view of a fused GEMM's product is fine) -> as forward."""
        if triton_ops.enabled(logits) and triton_ops.route_topk_ok(logits, self.top_k):
            ids, w = triton_ops.route_topk(logits, self.top_k, self.normalize)  # one launch, not ~6
        else:
            ids, w = triton_ops.route_topk_torch(logits, self.top_k, self.normalize)
        return ids, w, logits


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.gate = Router(cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.norm_topk_prob)
        self.shared_expert = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)
        self.runtime = None  # set by the engine: an ExpertRuntime
        # models/fuse.py: [router |] shared gate_proj | up_proj | shared_expert_gate in one GEMM, and then the block
        # adds the decoder's residual itself (forward(x, residual)) inside its combine
        self.shared_in = None
        self.router_rows = 0  # E when the router's rows lead shared_in (the router then reads a view of them)
        self.takes_residual = False

    def forward(self, x, residual=None):
        """x [T, H] -> routed + gated shared expert [T, H] (+ residual when given: fused blocks only)."""
        if self.shared_in is not None:
            return self._fused_forward(x, residual)
        ids, w, _ = self.gate(x)
        ids = self.runtime.routed(self.layer, x, ids)
        y = self.runtime.forward(self.layer, x, ids, w)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y if residual is None else residual + y

    def _fused_forward(self, x, residual, next_norm=None):
        """One GEMM: [router logits (E, if fused) | shared gate (I) | shared up (I) | shared-expert gate (1)].
        With next_norm (an RMSNorm; fused blocks with a residual only): returns (h, next_norm(h))."""
        out = self.shared_in(x)
        e = self.router_rows
        ids, w, _ = self.gate.route(out[:, :e]) if e else self.gate(x)
        ids = self.runtime.routed(self.layer, x, ids)
        gu = out[:, e:]  # [T, 2I + 1]
        inter = self.shared_in.sizes[-2]
        # down(silu(gate) * up), launched where it hides best (on the GPU while the CPU computes cpu / hybrid's pairs)
        y, shared = self.runtime.forward_beside(self.layer, x, ids, w, lambda: self._shared_down(gu, inter))
        gate = gu[:, 2 * inter:]
        if next_norm is None:
            return triton_ops.gated_combine(y, shared, gate, residual)
        if triton_ops.gated_combine_norm_ok(y, shared, residual):
            return triton_ops.gated_combine_norm(y, shared, gate, residual, next_norm.weight, next_norm.eps,
                                                 next_norm.zero_centered)
        h = triton_ops.gated_combine(y, shared, gate, residual)
        return h, next_norm(h)


    def _shared_down(self, gu, inter: int):
        """The shared expert's down(silu(gate) * up) of the fused GEMM's columns gu; MOESTREAM_SHARED_DOWN=1: in one
        launch where its kernel takes the call (env.shared_down_fused)."""
        down = self.shared_expert.down_proj
        if shared_down_fused() and type(down) is Linear and down.bias is None \
                and triton_ops.shared_down_ok(gu, inter, down.weight):
            return triton_ops.shared_down(gu, inter, down.weight)
        return down(triton_ops.silu_mul(gu, inter))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        mtp = layer >= cfg.num_layers  # an MTP block's layer: full attention with the MoE
        self.kind = "full_attention" if mtp else cfg.layer_types[layer]
        eps, zc = cfg.rms_norm_eps, cfg.norm_zero_centered
        if self.kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                                             cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                                             cfg.linear_conv_kernel, eps)
        else:
            self.self_attn = Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, eps,
                                       cfg.attn_output_gate, zc, cfg.qk_norm)
        moe = mtp or cfg.moe_layers[layer]
        self.mlp = SparseMoeBlock(cfg, layer) if moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, zc)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, zc)


class MTPBlock(nn.Module):
    """Qwen3.5/3.6 multi-token prediction (checkpoint names `mtp.*`): fc over [norm(embedding of token
    t+1); norm(the main model's final hidden state at t)], one full-attention decoder layer with its MoE
    (layer id num_layers + i), a final norm; the main model's embedding and lm_head are shared. Its row at
    position t predicts token t+2."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H, eps, zc = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_zero_centered
        self.fc = Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(H, eps, zc)
        self.pre_fc_norm_hidden = RMSNorm(H, eps, zc)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in cfg.mtp_layer_ids)
        self.norm = RMSNorm(H, eps, zc)


class QwenMoeModel(nn.Module):
    """Embedding, decoder layers, final norm and lm_head; forward returns logits of selected rows.
    mtp: also the checkpoint's MTP block (speculative decoding's drafter, `draft`)."""

    def __init__(self, cfg: ModelConfig, mtp: bool = False):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_zero_centered)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary: Rotary | None = None
        self.caches = None  # set by the engine: object with kv (KVPool) and state (StatePool)
        # model layer index -> index into the KV pool / the state pool
        self.kv_layer = {l: i for i, l in enumerate(cfg.full_attention_layers)}
        self.state_layer = {l: i for i, l in enumerate(cfg.linear_attention_layers)}
        self.mtp = MTPBlock(cfg) if mtp and cfg.mtp_num_layers else None
        if self.mtp is not None:  # the MTP layers' K/V follow the main model's layers in the KV pool
            n = len(self.kv_layer)
            self.kv_layer.update({l: n + i for i, l in enumerate(cfg.mtp_layer_ids)})
        self.hidden: torch.Tensor | None = None  # batch.extra["keep_hidden"]: the last forward's final hidden
        self.cpu_decode = None  # models/cpu_decode.CpuDecodePlan, made at the first CPU decode step

    def decoder_layers(self) -> list[DecoderLayer]:
        return list(self.layers) + (list(self.mtp.layers) if self.mtp is not None else [])

    def moe_blocks(self):
        return [layer.mlp for layer in self.decoder_layers() if isinstance(layer.mlp, SparseMoeBlock)]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        plan = self._cpu_plan(batch)
        if plan is not None:  # a CPU decode step: compiled calls (the whole step, the stack, or one per layer)
            logits = plan.logits(batch)
            if logits is not None:
                return logits
            return self.lm_head(plan.forward(batch)[batch.logits_index]).float()
        h = self.embed_tokens(batch.input_ids)
        normed = None
        for i in range(len(self.layers)):
            h, normed = self._layer(i, h, normed, batch)
        if batch.extra.get("keep_hidden"):  # the MTP drafter reads every row's final hidden state
            self.hidden = self.norm(h)
            return self.lm_head(self.hidden[batch.logits_index]).float()
        h = self.norm(h[batch.logits_index])
        return self.lm_head(h).float()

    def prepare_cpu_decode(self) -> None:
        """Make the CPU decode plan now (the engine, once the caches and rotary tables are in place on a CPU): its
        interleaved weight copies are then what every request reads, the first prompt's prefill included, so a
        request's floats do not depend on whether a decode step ran before it."""
        if self.cpu_decode is None:
            from .cpu_decode import CpuDecodePlan

            self.cpu_decode = CpuDecodePlan(self)

    def _cpu_plan(self, batch: ForwardBatch):
        if batch.input_ids.device.type != "cpu" or not batch.is_decode or "verify_n" in batch.extra:
            return None  # (a verify step laid out as decode rows: its rows of a request are sequential)
        self.prepare_cpu_decode()
        return self.cpu_decode if self.cpu_decode.usable(batch, self.norm.weight.dtype) else None

    @torch.inference_mode()
    def draft(self, batch: ForwardBatch, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        """The MTP block on a flat batch: batch.input_ids [T] are the tokens at position + 1, hidden [T, H]
        the final hidden states at the positions (the main model's, or the block's own for a further draft);
        writes the block's K/V at batch.positions. Returns logits of batch.logits_index rows; self.hidden
        becomes the block's normed output at those rows, in that order (the MLP and its experts run for them only:
        a pass over a verify step's rows drafts from each request's last row). With no logits rows, every row's
        output (nothing drafts from it). step picks the layer (step % number of layers)."""
        m = self.mtp
        e = m.pre_fc_norm_embedding(self.embed_tokens(batch.input_ids))
        x = m.fc(torch.cat([e, m.pre_fc_norm_hidden(hidden.to(e.dtype))], dim=-1))
        layer = m.layers[step % len(m.layers)]
        j = self.kv_layer[self.cfg.num_layers + step % len(m.layers)]
        a = layer.self_attn(layer.input_layernorm(x), batch, self.caches.kv.k[j], self.caches.kv.v[j], self.rotary)
        a, x = layer.post_attention_layernorm.add_forward(a, x)
        rows = batch.logits_index
        if rows.numel():  # the other rows' K/V are written above; their outputs feed nothing: no experts for them
            a, x = a[rows], x[rows]
        x = x + layer.mlp(a)
        self.hidden = m.norm(x)
        return self.lm_head(self.hidden if rows.numel() else self.hidden[rows]).float()

    def _layer(self, i: int, h: torch.Tensor, normed, batch: ForwardBatch):
        """Decoder layer i: h [T, H] -> (h, this layer's output already normed by layer i+1's input norm, or
        None). normed: layer i's input norm of h when the previous layer's MoE combine computed it."""
        layer = self.layers[i]
        x = layer.input_layernorm(h) if normed is None else normed
        if layer.kind == "linear_attention":
            j = self.state_layer[i]
            x = layer.linear_attn(x, batch, self.caches.state.conv[j], self.caches.state.rec[j])
        else:
            j = self.kv_layer[i]
            x = layer.self_attn(x, batch, self.caches.kv.k[j], self.caches.kv.v[j], self.rotary)
        x, h = layer.post_attention_layernorm.add_forward(x, h)  # h = h + x, x = norm(h)
        if not getattr(layer.mlp, "takes_residual", False):
            return h + layer.mlp(x), None
        # residual added in the MoE combine, which also norms the result for the next layer
        nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else None
        out = layer.mlp._fused_forward(x, h, nxt)
        return out if nxt is not None else (out, None)

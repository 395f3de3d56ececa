"""CPU decode steps with one compiled call per decoder layer (kernels/cpu/decode.cpp).

On a CPU-only machine a decode step of a small model spends more time dispatching ~20 torch operations per
layer than in its matmuls. `CpuDecodePlan` describes each decoder layer once — the addresses and types of its
stored weights (GGUF bytes or 16-bit rows), norm vectors, head shapes, rotary tables, its cache pools — and a
decode step then runs the layer in one call: a full-attention layer's norm, q|k|v projection, q/k norms,
rotary, KV write, attention, output gate, o_proj with the residual add and the post-attention norm (and a
dense MLP with its residual add) in `ms_decode_layer`; a Gated DeltaNet layer's norm, in-projections, conv
window, q/k L2 norms, gates, recurrent-state update (float32 state pools, in place), gated RMSNorm, out_proj,
residual add and post-attention norm in `ms_gdn_decode`. A MoE block after such a layer is one
`ms_moe_decode` call (router, top-k, the routed experts' pairs in one kernel, the shared expert — unfused, or
models/fuse.py's [router | shared gate | up | shared_expert_gate] GEMM with its own down projection — and the
residual add) where the expert runtime computes every expert on this CPU from host banks (fused or cpu on a
CPU-only machine, no routing tap); the route goes back to the runtime's statistics. Layers or blocks the
kernels cannot read stay on the per-op path. Used when every condition holds (`CpuDecodePlan.usable`): CPU
tensors, float32 activations, a float32 or float16 KV pool (--kv-cache-dtype), a decode step (one new token
per sequence) with the compiled kernels on (not a prefill step), no hidden-state keeping (MTP). `MOESTREAM_CPU_DECODE_LAYER=0` turns it off.
The products are the per-op path's own kernels (ms_qmatmul / ms_moe_layer, float rows where it multiplies
float rows); norms, rotary, softmax and the recurrence sum in another order, so logits agree to float32
rounding (tests/test_cpu_decode.py).

Q4_K, Q4_0, Q4_1 and Q6_K weights the plan reads (attention / Gated DeltaNet projections, dense MLPs, and routed experts
where the host holds their copy beside the file's bytes: `_Repack.experts`) are copied once, when the plan is
built, into the kernels' 8-row interleaved layouts
(kernels/cpu_quant.repack_x8): a one-row product shares each block's bookkeeping among 8 rows and needs no
horizontal sums, several times fewer instructions where a small model's step is compute-bound. The copy is host
memory beside the checkpoint's own bytes; once made, the per-op and prefill paths read it too (QuantLinear.x8,
moe/cpu_moe.attach_x8) and the file's bytes of a copied matrix are left alone. It is skipped, with one
log line, where the host's available memory would drop under REPACK_RESERVE, and `MOESTREAM_CPU_REPACK=0` turns it
off. Its products differ from the GGUF layout's in float summation order only (the integer sums are the same).
"""
from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from ..env import cpu_decode_layer_enabled, cpu_repack_enabled
from ..hardware import host_memory
from ..kernels import cpu_quant
from ..kernels.linear import Linear
from ..layers.attention import Attention
from ..layers.norm import RMSNorm
from ..layers.quant_linear import FusedQuantLinear, QuantEmbedding, QuantLinear
from ..quant.base import CPU_FLOAT_KERNEL_MAX_ROWS, FLOAT_KERNEL_TYPES
from .fuse import FusedLinear

# slots of the layer description: the same order as decode.cpp's D_* enum
_FIELDS = ["H", "NH", "NKV", "HD", "RD", "FLAGS", "IN_NORM", "POST_NORM", "Q_NORM", "K_NORM", "NSEG",
           *[f"SEG{i}" for i in range(9)], "WO", "TO", "SO", "KC", "VC", "COS", "SIN", "MLP_I",
           "WG", "TG", "WU", "TU", "WD", "TD"]
D = {name: i for i, name in enumerate(_FIELDS)}
# slots of a MoE block's description: decode.cpp's X_* enum
_MOE_FIELDS = ["H", "E", "K", "NORMALIZE", "I", "RW", "RT", "RS", "TABLE", "TG", "TU", "TD",
               "SI", "SG", "STG", "SU", "STU", "SD", "STD", "SGATE", "FW", "FT", "FS", "FROUTER", "SDS"]
M = {name: i for i, name in enumerate(_MOE_FIELDS)}
# slots of a Gated DeltaNet layer's description: decode.cpp's G_* enum
_GDN_FIELDS = ["H", "HK", "HV", "DK", "DV", "KW", "FLAGS", "IN_NORM", "POST_NORM", "NSEG",
               *[f"SEG{i}" for i in range(12)], "WO", "TO", "SO", "CONV_W", "A_LOG", "DT_BIAS", "NORM_W", "CONV", "REC"]
G = {name: i for i, name in enumerate(_GDN_FIELDS)}
F_ZERO_CENTERED, F_OUT_GATE, F_KV_F16, F_OUT_TILED, F_KV_FP8 = 1, 2, 4, 8, 16


def tiled_heads(hk: int, hv: int, dv: int) -> torch.Tensor:
    """The input order of an out_proj whose value heads are tiled (head j = r * hk + k is the model's k * rep + r):
    F_OUT_TILED's, and models/gguf_loader's in_perm for such a layer."""
    j = torch.arange(hv)
    head = (j % hk) * (hv // hk) + j // hk
    return (head[:, None] * dv + torch.arange(dv)[None, :]).reshape(-1)
KV_DTYPES = (torch.float32, torch.float16, torch.float8_e4m3fn)  # the KV pools ms_decode_layer reads and writes
_KV_FLAG = {torch.float16: F_KV_F16, torch.float8_e4m3fn: F_KV_FP8}
# dense weights by dtype: ggml type ids (0, float32, is decode.cpp's own loop; the others ms_qmatmul's)
_DENSE = {torch.float32: 0, torch.bfloat16: cpu_quant.TYPES["BF16"], torch.float16: cpu_quant.TYPES["F16"]}


log = logging.getLogger("moestream")
REPACK_RESERVE = 2 << 30  # host memory left available after a plan's interleaved copies, or none are made


class _Repack:
    """The 8-row interleaved copies of 4-bit weights a plan's descriptions point at, one per source matrix (a layer's
    routed experts: one per projection) kept alive with the plan. Routed experts are copied only where the host
    keeps room for the copy beside the file's own bytes (which prefill and the other paths go on reading): they are
    most of a MoE model's bytes."""

    def __init__(self):
        self.arrays: dict[tuple[int, int, int], np.ndarray] = {}
        self.nbytes = 0
        self.refused = False
        self.by_id = {cpu_quant.TYPES[name]: name for name in cpu_quant.X8_TYPES}

    def _room(self, nbytes: int) -> bool:
        if not self.refused and host_memory()[1] - nbytes < REPACK_RESERVE:
            self.refused = True
            log.info("moestream: CPU decode keeps 4-bit weights in their GGUF layout: an interleaved copy would "
                     "leave under %.1f GiB of host memory available", REPACK_RESERVE / (1 << 30))
        return not self.refused

    def weight(self, w: tuple[int, int, int], rows: int, k: int) -> tuple[int, int, int]:
        """A Q4_K / Q4_0 / Q4_1 / Q6_K matrix's fields (address, type, row stride) as its interleaved copy's; others (and
        shapes the layout cannot take) as they are."""
        addr, tid, stride = w
        name = self.by_id.get(tid)
        if not cpu_quant.x8_fits(name, rows, k):
            return w
        key, (xt, row_bytes) = (addr, rows, k), cpu_quant.X8_TYPES[name]
        if key not in self.arrays:
            if not self._room(rows * row_bytes(k)):
                return w
            self.arrays[key] = cpu_quant.repack_x8(addr, rows, k, stride, name)[0]
            self.nbytes += self.arrays[key].nbytes
        return self.arrays[key].ctypes.data, xt, row_bytes(k)

    def experts(self, ptrs: np.ndarray, types: tuple, hidden: int, inter: int,
                arrays: tuple | None = None) -> tuple[np.ndarray, tuple]:
        """A layer's expert table (addresses [E, 3] of every expert's gate / up / down, their type ids) with each
        Q4_K / Q4_0 / Q4_1 / Q6_K projection read from interleaved copies (one array of all E experts' rows a projection;
        the table has one type a projection, so all of them or none), where available host memory less the copy
        keeps REPACK_RESERVE beside as many bytes as the file holds of it; others as they are (nothing copied: the
        table itself). arrays: the bank's gate / up / down tensors, on which each copy is recorded
        (moe/cpu_moe.attach_x8) so the layer's other calls (prefill) read it too."""
        out, tids = ptrs, list(types)
        for j, (rows, k) in enumerate(((inter, hidden), (inter, hidden), (hidden, inter))):
            name = self.by_id.get(int(types[j]))
            if not cpu_quant.x8_fits(name, rows, k):
                continue
            key, (xt, row_bytes) = (int(ptrs[0, j]), len(ptrs) * rows, k), cpu_quant.X8_TYPES[name]
            stride = cpu_quant.row_bytes(name, k)
            per = rows * row_bytes(k)
            if key not in self.arrays:
                if not self._room(len(ptrs) * (per + rows * stride)):
                    break
                from ..moe.cpu_moe import attach_x8, interleave_projection

                arr = self.arrays[key] = interleave_projection(ptrs[:, j], name, rows, k)[0]
                self.nbytes += arr.nbytes
                if arrays is not None:
                    attach_x8(arrays[j], arr, name, per)
            out = out.copy() if out is ptrs else out
            out[:, j] = self.arrays[key].ctypes.data + per * np.arange(len(ptrs))
            tids[j] = xt
        return out, tuple(tids)


_REPACK: _Repack | None = None  # set while a plan is being built with repacking on


def _weight(lin, mlp: bool = False, perm_ok: bool = False) -> tuple[int, int, int] | None:
    """(address, ggml type, row stride in bytes) of a projection the kernels read, or None (mlp: for
    ms_moe_layer, which reads no float32 rows; perm_ok: the caller handles a QuantLinear's in_perm). While a plan is built with repacking on, a Q4_K / Q4_0 / Q4_1 / Q6_K
    matrix's fields are its interleaved copy's."""
    if type(lin) in (QuantLinear, FusedQuantLinear) and lin.type_id is not None and lin.raw.device.type == "cpu" \
            and not lin.float_activations and (lin.in_perm is None or perm_ok):
        w = lin.raw.data_ptr(), lin.type_id, lin.raw.stride(0)
        if _REPACK is None:
            return w
        got = _REPACK.weight(w, lin.out_features, lin.in_features)
        if got != w:  # the module's own calls (prefill) read the copy too
            lin.x8 = (_REPACK.arrays[w[0], lin.out_features, lin.in_features],) + got
        return got
    w = getattr(lin, "weight", None)
    if type(lin) in (Linear, FusedLinear) and lin.bias is None and w is not None and w.dtype in _DENSE \
            and w.device.type == "cpu" and w.is_contiguous() and not (mlp and w.dtype == torch.float32):
        return w.data_ptr(), _DENSE[w.dtype], w.stride(0) * w.element_size()
    return None


def _dense(w: torch.Tensor, types=_DENSE) -> tuple[int, int, int] | None:
    """(address, ggml type, row stride in bytes) of a 2-D CPU weight tensor, or None."""
    if w.dim() != 2 or w.dtype not in types or w.device.type != "cpu" or not w.is_contiguous():
        return None
    return w.data_ptr(), types[w.dtype], w.stride(0) * w.element_size()


def _moe_desc(block, cfg) -> tuple[np.ndarray, object] | None:
    """(description, what its table points into) of a MoE block ms_moe_decode computes, or None: the runtime computes
    every routed expert on this CPU from host banks the kernels read, a router of float32/16-bit rows (or rows
    leading the fused GEMM), and no shared expert, an unfused one, or models/fuse.py's fused one (shared_in:
    [router |] shared gate | up | shared_expert_gate as one GEMM, the down projection its own)."""
    from .qwen_moe import SparseMoeBlock

    if type(block) is not SparseMoeBlock or block.runtime is None:
        return None
    table = block.runtime.host_layer_table(block.layer)
    fused = block.shared_in is not None
    router = None if fused and block.router_rows else _dense(block.gate.weight)
    if table is None or (router is None and not (fused and block.router_rows)):
        return None
    ptrs, types, inter, arrays = table
    if _REPACK is not None:  # the table's own array is kept too: HF FP4's descriptors live in its buffer
        ptrs, types = _REPACK.experts(ptrs, types, cfg.hidden_size, inter, arrays)
    d = np.zeros(len(_MOE_FIELDS), dtype=np.int64)
    d[[M["H"], M["E"], M["K"], M["NORMALIZE"], M["I"]]] = (cfg.hidden_size, block.gate.weight.shape[0],
                                                          block.gate.top_k, int(block.gate.normalize), inter)
    if router is not None:
        d[[M["RW"], M["RT"], M["RS"]]] = router
    d[M["TABLE"]] = ptrs.ctypes.data
    d[[M["TG"], M["TU"], M["TD"]]] = types
    shared = _fused_shared_fields(block, d) if fused else _shared_fields(block, d)
    return (d, (table[0], ptrs)) if shared else None


def _shared_fields(block, d: np.ndarray) -> bool:
    """An unfused shared expert's slots (none: nothing to write); False if the kernels cannot compute it."""
    if block.shared_expert is None:
        return True
    sh = _mlp_fields(block.shared_expert)
    gate = _dense(block.shared_expert_gate.weight, {torch.float32: 0})
    if sh is None or gate is None or type(block.shared_expert_gate) is not Linear:
        return False
    d[M["SI"]] = sh[0]
    d[[M["SG"], M["STG"], M["SU"], M["STU"], M["SD"], M["STD"]]] = [v for w in sh[1] for v in w[:2]]
    d[M["SGATE"]] = gate[0]
    return True


def _fused_shared_fields(block, d: np.ndarray) -> bool:
    """The fused block's slots: shared_in (its GEMM through decode.cpp's matmul, as the per-op path's float or
    int8-activation product) and the shared down projection; False if either is a weight the kernels lack."""
    f, sizes = block.shared_in, block.shared_in.sizes
    down = _weight(block.shared_expert.down_proj)
    w = _weight(f)
    e = block.router_rows
    if w is None or down is None or sizes[-1] != 1 or sizes[-2] != sizes[-3] or len(sizes) != 3 + (e > 0) \
            or (e and e != d[M["E"]]):
        return False
    d[[M["FW"], M["FT"], M["FS"]]] = w
    d[M["FROUTER"]] = int(e > 0)
    d[M["SI"]] = sizes[-2]
    d[[M["SD"], M["STD"], M["SDS"]]] = down
    return True


def _norm(m) -> int | None:
    """Address of an RMSNorm's float32 weight; 0 for no norm; None if unusable."""
    if isinstance(m, nn.Identity):
        return 0
    if type(m) is RMSNorm and m.weight.dtype == torch.float32 and m.weight.is_contiguous():
        return m.weight.data_ptr()
    return None


def _segments(a: Attention) -> list[tuple[int, int, int]] | None:
    if a.qkv_proj is not None:
        w = _weight(a.qkv_proj)
        return [w] if w is not None else None
    ws = [_weight(p) for p in (a.q_proj, a.k_proj, a.v_proj)]
    return None if any(w is None for w in ws) else ws


def _attention_desc(layer, cfg, rotary) -> np.ndarray | None:
    a = layer.self_attn
    segs, wo = _segments(a), _weight(a.o_proj)
    norms = [_norm(m) for m in (layer.input_layernorm, layer.post_attention_layernorm, a.q_norm, a.k_norm)]
    if type(a) is not Attention or segs is None or wo is None or None in norms or not norms[0] or not norms[1]:
        return None
    rms = [m for m in (layer.input_layernorm, layer.post_attention_layernorm, a.q_norm, a.k_norm) if type(m) is RMSNorm]
    if len({(m.eps, m.zero_centered) for m in rms}) != 1 or rms[0].eps != cfg.rms_norm_eps:
        return None  # the kernel takes one eps and one norm style per layer
    d = np.zeros(len(_FIELDS), dtype=np.int64)
    d[[D["H"], D["NH"], D["NKV"], D["HD"], D["RD"]]] = (cfg.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim,
                                                        rotary.rotary_dim)
    d[D["FLAGS"]] = (F_ZERO_CENTERED if layer.input_layernorm.zero_centered else 0) | (F_OUT_GATE if a.output_gate else 0)
    d[[D["IN_NORM"], D["POST_NORM"], D["Q_NORM"], D["K_NORM"]]] = norms
    d[D["NSEG"]] = len(segs)
    for i, seg in enumerate(segs):
        d[D["SEG0"] + 3 * i:D["SEG0"] + 3 * i + 3] = seg
    d[[D["WO"], D["TO"], D["SO"]]] = wo
    d[[D["COS"], D["SIN"]]] = (rotary.cos.data_ptr(), rotary.sin.data_ptr())
    return d


def _f32(t: torch.Tensor) -> int | None:
    """Address of a contiguous float32 CPU tensor, or None."""
    ok = t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
    return t.data_ptr() if ok else None


def _gdn_in_proj(g) -> list[tuple[int, int, int]] | None:
    """The weight fields of a GatedDeltaNet's in-projections: fused [qkv | z | b | a] (models/fuse.py) or four."""
    if g.in_proj is not None:
        sizes = getattr(g.in_proj, "sizes", None)
        w = _weight(g.in_proj)
        return [w] if w is not None and tuple(sizes) == (g.conv_dim, g.value_dim, g.hv, g.hv) else None
    ws = [_weight(p) for p in (g.in_proj_qkv, g.in_proj_z, g.in_proj_b, g.in_proj_a)]
    return None if None in ws else ws


def _gdn_desc(layer, state) -> tuple[np.ndarray, np.ndarray] | None:
    """(description, [norm eps, gated norm eps]) of a Gated DeltaNet layer ms_gdn_decode computes, or None:
    projections the kernels read, float32 conv / gate / norm vectors, float32 CPU state pools."""
    from ..layers.gdn import GatedDeltaNet
    from ..layers.norm import GatedRMSNorm

    g, a, b = layer.linear_attn, layer.input_layernorm, layer.post_attention_layernorm
    if type(g) is not GatedDeltaNet or type(g.norm) is not GatedRMSNorm or g.kernel < 2 or g.hv % g.hk \
            or g.out_dest is not None \
            or g.conv1d.bias is not None or type(a) is not RMSNorm or type(b) is not RMSNorm \
            or (a.eps, a.zero_centered) != (b.eps, b.zero_centered) or state is None or state.conv is None \
            or _f32(state.conv) is None or _f32(state.rec) is None:
        return None
    segs, wo = _gdn_in_proj(g), _weight(g.out_proj, perm_ok=True)
    ptrs = [_f32(t) for t in (a.weight, b.weight, g.conv1d.weight, g.A_log, g.dt_bias, g.norm.weight)]
    perm = getattr(g.out_proj, "in_perm", None)
    tiled = perm is not None
    if segs is None or wo is None or None in ptrs or (tiled and not torch.equal(perm, tiled_heads(g.hk, g.hv, g.dv))):
        return None
    d = np.zeros(len(_GDN_FIELDS), dtype=np.int64)
    d[[G["H"], G["HK"], G["HV"], G["DK"], G["DV"], G["KW"]]] = (a.weight.shape[0], g.hk, g.hv, g.dk, g.dv, g.kernel)
    d[G["FLAGS"]] = (F_ZERO_CENTERED if a.zero_centered else 0) | (F_OUT_TILED if tiled else 0)
    d[[G["IN_NORM"], G["POST_NORM"], G["CONV_W"], G["A_LOG"], G["DT_BIAS"], G["NORM_W"]]] = ptrs
    d[G["NSEG"]] = len(segs)
    for i, seg in enumerate(segs):
        d[G["SEG0"] + 3 * i:G["SEG0"] + 3 * i + 3] = seg
    d[[G["WO"], G["TO"], G["SO"]]] = wo
    return d, np.array([a.eps, g.norm.eps], dtype=np.float64)


def _mlp_fields(mlp) -> tuple | None:
    """(I, [gate, up, down weight fields]) of a dense MLP the kernel computes, or None."""
    from .qwen_moe import MLP

    if type(mlp) is not MLP:
        return None
    ws = [_weight(p, mlp=True) for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
    return None if any(w is None for w in ws) else (mlp.gate_proj.out_features, ws)


_IO_FIELDS = ["EMB_W", "EMB_T", "EMB_S", "EMB_N", "TOKENS", "HEAD_W", "HEAD_T", "HEAD_S", "HEAD_N", "LOGITS"]
IO = {name: i for i, name in enumerate(_IO_FIELDS)}  # decode.cpp's IO_* enum (ms_decode_logits)


def _io_fields(model) -> tuple[np.ndarray, bool] | None:
    """(ms_decode_logits' embedding and head fields, whether the head takes only a few rows) when the embedding and
    the vocabulary head are ones its kernels compute as the per-op path does; else None."""
    e, head = model.embed_tokens, model.lm_head
    io = np.zeros(len(_IO_FIELDS), dtype=np.int64)
    if type(e) is QuantEmbedding and e.type_id is not None and e.raw.device.type == "cpu" and e.raw.stride(1) == 1 \
            and e.fmt.type_name not in ("IQ4_XS", "IQ3_S") and cpu_quant.supports(e.fmt.type_name):
        io[[IO["EMB_W"], IO["EMB_T"], IO["EMB_S"], IO["EMB_N"]]] = (e.raw.data_ptr(), e.type_id, e.raw.stride(0),
                                                                    e.num_embeddings)
    elif type(e) is nn.Embedding and _f32(e.weight) is not None and e.weight.dim() == 2:
        io[[IO["EMB_W"], IO["EMB_T"], IO["EMB_S"], IO["EMB_N"]]] = (e.weight.data_ptr(), 0, e.weight.stride(0) * 4,
                                                                    e.weight.shape[0])
    else:
        return None
    if type(head) is not QuantLinear or head.type_id is None or head.raw.device.type != "cpu" \
            or not cpu_quant.supports(head.fmt.type_name):
        return None
    t = -head.type_id if head.float_activations else head.type_id  # minus: rows against float32 activations
    io[[IO["HEAD_W"], IO["HEAD_T"], IO["HEAD_S"], IO["HEAD_N"]]] = (head.raw.data_ptr(), t, head.raw.stride(0),
                                                                    head.out_features)
    return io, head.float_activations or head.fmt.type_name in FLOAT_KERNEL_TYPES


class CpuDecodePlan:
    """Per layer: a description for ms_decode_layer (an attention layer, with or without its dense MLP) or for
    ms_gdn_decode (a Gated DeltaNet layer), or None (per-op path); `kinds` says which."""

    def __init__(self, model):
        self.model = model
        cfg, rot = model.cfg, model.rotary
        self.descs: list[np.ndarray | None] = []
        self.kinds: list[str | None] = []  # "attention", "gdn" or None (per-op)
        self.fd: list[np.ndarray | None] = []  # a GDN layer's [norm eps, gated norm eps]
        self.has_mlp: list[bool] = []
        self.moe: list[np.ndarray | None] = []  # ms_moe_decode descriptions of the blocks after compiled layers
        self._keep: list = []
        self._runtimes: list = []
        ok = rot is not None and rot.cos.dtype == torch.float32 and rot.cos.is_contiguous()
        state = getattr(model.caches, "state", None)
        global _REPACK
        self.repack = _REPACK = _Repack() if cpu_repack_enabled() and cpu_quant.available() else None
        try:
            self._describe(model, cfg, rot, ok, state)
        finally:
            _REPACK = None
        if self.repack is not None and self.repack.nbytes:
            log.info("moestream: CPU decode reads %.1f MiB of 4-bit weights as 8-row interleaved copies",
                     self.repack.nbytes / (1 << 20))
        # the described MoE blocks: (layer index, block), their layer ids in the runtime's book
        self._blocks = [(i, layer.mlp) for i, layer in enumerate(model.layers) if self.moe[i] is not None]
        self._moe_idx = [i for i, _ in self._blocks]
        self._moe_layers = [block.layer for _, block in self._blocks]
        self.eps = np.array([cfg.rms_norm_eps], dtype=np.float64)
        self.stack = self._stack_arrays(model)
        self.io = _io_fields(model) if self.stack is not None else None  # the whole step in one call
        st, k = self.stack, max(1, cfg.top_k)
        if st is not None:  # the stack call's fixed arguments, as addresses (the arrays are kept in self.stack)
            self._stack_head = (len(self.descs), st["kinds"].ctypes.data, st["descs"].ctypes.data,
                                st["fds"].ctypes.data, st["moes"].ctypes.data, k)
            self._stack_tail = (st["final"], st["final_eps"].ctypes.data, st["final_zc"])
            self._stack_failed = st["failed"].ctypes.data
        self._hx: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # logits(): scratch rows by batch size
        self._kv = None  # the KV pool tensors the descriptions point into (a resized pool gets new ones)
        self._state = None  # the same for the linear-attention state pool
        self.steps = 0  # decode steps run through the plan
        self.stack_steps = 0  # of which in one ms_decode_stack call

    def _describe(self, model, cfg, rot, ok: bool, state) -> None:
        """Every layer's description (and its MoE block's)."""
        for layer in model.layers:
            d, fd, kind = self._layer_desc(layer, cfg, rot, ok, state)
            mlp = _mlp_fields(layer.mlp) if kind == "attention" else None
            if mlp is not None:
                I, ws = mlp
                d[D["MLP_I"]] = I
                d[[D["WG"], D["TG"], D["WU"], D["TU"], D["WD"], D["TD"]]] = [v for w in ws for v in w[:2]]
            self.descs.append(d)
            self.kinds.append(kind)
            self.fd.append(fd)
            self.has_mlp.append(mlp is not None)
            moe = _moe_desc(layer.mlp, cfg) if d is not None and mlp is None else None
            self.moe.append(moe[0] if moe else None)
            self._keep.append(moe[1] if moe else None)  # the expert table the description points into
            self._runtimes.append(layer.mlp.runtime if moe else None)  # whose table it is

    @staticmethod
    def _layer_desc(layer, cfg, rot, rot_ok: bool, state) -> tuple:
        """(description, GDN eps array or None, kind) of one decoder layer; (None, None, None) stays per-op."""
        if layer.kind == "full_attention" and rot_ok:
            d = _attention_desc(layer, cfg, rot)
            return (d, None, "attention") if d is not None else (None, None, None)
        if layer.kind == "linear_attention":
            g = _gdn_desc(layer, state)
            return (g[0], g[1], "gdn") if g is not None else (None, None, None)
        return None, None, None

    def _stack_arrays(self, model) -> dict | None:
        """ms_decode_stack's per-layer arrays (kinds, description / eps / MoE description addresses) and the
        final norm's, when every decoder layer is compiled and every MLP is in its layer's call or a compiled MoE
        block (the whole stack in one call); else None (one call per layer, torch where a part is not compiled)."""
        n = len(self.descs)
        if n == 0 or any(d is None for d in self.descs) \
                or any(not self.has_mlp[i] and self.moe[i] is None for i in range(n)):
            return None
        final = _norm(model.norm)
        if not final:
            return None
        fds = [self.fd[i] if self.kinds[i] == "gdn" else self.eps for i in range(n)]
        addr = lambda arrays: np.array([0 if a is None else a.ctypes.data for a in arrays], dtype=np.int64)  # noqa: E731
        return {"kinds": np.array([2 if k == "gdn" else 1 for k in self.kinds], dtype=np.int64),
                "descs": addr(self.descs), "fds": addr(fds), "moes": addr(self.moe),
                "final": final, "final_eps": np.array([model.norm.eps], dtype=np.float64),
                "final_zc": int(model.norm.zero_centered), "failed": np.zeros(1, dtype=np.int64)}

    @property
    def layers(self) -> int:
        return sum(d is not None for d in self.descs)

    def usable(self, batch, h_dtype: torch.dtype) -> bool:
        kv = self.model.caches.kv
        return (self.layers > 0 and batch.is_decode and not batch.prompt and not batch.extra.get("keep_hidden")
                and "decode_kv_index" not in batch.extra and h_dtype == torch.float32 and kv.k is not None
                and kv.k.dtype in KV_DTYPES and kv.k.device.type == "cpu" and cpu_decode_layer_enabled()
                and cpu_quant.available())

    def _point_at(self, kv, state) -> None:
        """Write this layer's pool addresses into the descriptions (again after a pool was replaced)."""
        if self._kv is None or self._kv[0] is not kv.k or self._kv[1] is not kv.v:
            for i, d in enumerate(self.descs):
                if self.kinds[i] == "attention":
                    j = self.model.kv_layer[i]
                    d[D["KC"]], d[D["VC"]] = kv.k[j].data_ptr(), kv.v[j].data_ptr()
                    d[D["FLAGS"]] = (d[D["FLAGS"]] & ~(F_KV_F16 | F_KV_FP8)) | _KV_FLAG.get(kv.k.dtype, 0)
            self._kv = (kv.k, kv.v)
        if "gdn" in self.kinds and (self._state is None or self._state[0] is not state.conv
                                    or self._state[1] is not state.rec):
            if _f32(state.conv) is None or _f32(state.rec) is None:
                raise RuntimeError("CPU decode: the linear-attention state pools are no longer float32 CPU tensors")
            for i, d in enumerate(self.descs):
                if self.kinds[i] == "gdn":
                    j = self.model.state_layer[i]
                    d[G["CONV"]], d[G["REC"]] = state.conv[j].data_ptr(), state.rec[j].data_ptr()
            self._state = (state.conv, state.rec)

    def step_arrays(self, batch) -> tuple:
        """Per step, shared by every layer: (what to keep alive through the calls, the addresses of the positions,
        write slots, the sequences' KV slots and offsets, and their linear-attention state slots). A batch from the
        runner's decode fast path has them in one host buffer already (batch.extra["host"])."""
        host = batch.extra.get("host")
        if host is not None:
            return host, (host.at(1), host.at(2), host.at(6), host.at(5), host.at(3))
        pos = batch.positions.to(torch.int64).contiguous()
        slot = batch.kv_write_index.to(torch.int64).contiguous()
        seqs = batch.seqs
        idx = (seqs[0].kv_index if len(seqs) == 1 else torch.cat([s.kv_index for s in seqs])).to(torch.int64).contiguous()
        off = np.zeros(len(batch.seqs) + 1, dtype=np.int64)
        off[1:] = np.cumsum([s.total for s in batch.seqs])
        states = (batch.state_slots.to(torch.int64).contiguous() if batch.state_slots is not None
                  else torch.tensor([s.state_slot for s in batch.seqs], dtype=torch.int64))
        return (pos, slot, idx, off, states), (pos.data_ptr(), slot.data_ptr(), idx.data_ptr(), off.ctypes.data,
                                               states.data_ptr())

    def run_layer(self, i: int, h: torch.Tensor, x: torch.Tensor, arrays: tuple, nthreads: int) -> None:
        """Layer i's compiled part: h (residual stream) updated in place, x = the post-attention norm of h."""
        pos, slot, idx, off, states = arrays[1]
        mod = cpu_quant.module()
        if self.kinds[i] == "gdn":
            rc = mod.ms_gdn_decode(self.descs[i].ctypes.data, self.fd[i].ctypes.data, h.shape[0], h.data_ptr(),
                                   x.data_ptr(), states, nthreads)
        else:
            rc = mod.ms_decode_layer(self.descs[i].ctypes.data, self.eps.ctypes.data, h.shape[0], h.data_ptr(),
                                     x.data_ptr(), pos, slot, idx, off, nthreads)
        if rc:
            raise RuntimeError(f"CPU decode layer {i} failed ({rc})")

    def forward(self, batch) -> torch.Tensor:
        """The decoder layers of one decode step and the final norm: the normed final hidden states [T, H] (the
        vocabulary head's input)."""
        m = self.model
        self.steps += 1
        self._point_at(m.caches.kv, getattr(m.caches, "state", None))
        h = m.embed_tokens(batch.input_ids).contiguous()
        x = torch.empty_like(h)
        arrays = self.step_arrays(batch)
        nthreads = cpu_quant.threads()
        if self.stack is not None and all(self._moe_now(i, block) for i, block in self._blocks):
            self._run_stack(h, x, arrays, nthreads)
            self.stack_steps += 1
            return x
        return m.norm(self._per_layer(h, x, arrays, nthreads, batch))

    def logits(self, batch) -> torch.Tensor | None:
        """The step's logits [B, vocab] from one ms_decode_logits call (embedding, every layer, final norm, head)
        where the plan describes all of it and every row samples; None otherwise (nothing run: `forward`)."""
        host = batch.extra.get("host")  # the runner's decode fast path: every row samples, indices in one buffer
        if host is not None:
            B = host.B
        else:
            B = batch.input_ids.shape[0]
            li = batch.logits_index
            if li.numel() != B or int(li[-1]) != B - 1:
                return None
        if self.io is None or self.stack is None or (self.io[1] and B > CPU_FLOAT_KERNEL_MAX_ROWS) \
                or not all(self._moe_now(i, block) for i, block in self._blocks):
            return None
        m = self.model
        self.steps += 1
        self.stack_steps += 1
        self._point_at(m.caches.kv, getattr(m.caches, "state", None))
        h, x = self._scratch(B)
        io = self.io[0].copy()
        out = torch.empty(B, int(io[IO["HEAD_N"]]))
        tokens = None if host is not None else batch.input_ids.to(torch.int64).contiguous()
        io[IO["TOKENS"]], io[IO["LOGITS"]] = host.addr if host is not None else tokens.data_ptr(), out.data_ptr()
        arrays = self.step_arrays(batch)  # held here: the call reads them by address
        args, ids = self._stack_args(h, x, arrays[1])
        rc = cpu_quant.module().ms_decode_logits(*args, io.ctypes.data, cpu_quant.threads())
        if rc == -3:
            raise IndexError(f"a token id out of the embedding's range [0, {int(io[IO['EMB_N']])})")
        if rc:
            where = int(self.stack["failed"][0])
            raise RuntimeError(f"CPU decode {'embedding or head' if where < 0 else f'layer {where}'} failed ({rc})")
        self._book(ids)
        return out

    def _scratch(self, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        """ms_decode_logits' residual stream and normed rows [B, H], kept from step to step (only the call reads
        them: its output is the logits)."""
        hx = self._hx.get(B)
        if hx is None:
            H = self.model.cfg.hidden_size
            hx = self._hx[B] = (torch.empty(B, H), torch.empty(B, H))
        return hx

    def _book(self, ids: np.ndarray) -> None:
        if self._blocks:  # every block runs the engine's one expert runtime (_moe_now held for each): one booking call
            self._blocks[0][1].runtime.book_host_calls(
                self._moe_layers, ids if len(self._moe_idx) == len(ids) else ids[self._moe_idx])

    def _stack_args(self, h: torch.Tensor, x: torch.Tensor, addrs: tuple) -> tuple[tuple, np.ndarray]:
        """ms_decode_stack's arguments but the thread count (ms_decode_logits' first ones), and the routes array
        they fill [layers, B, k]. Addresses only (addrs: step_arrays'): the caller keeps h, x and the step's arrays
        alive through the call."""
        pos, slot, idx, off, states = addrs
        B, k = h.shape[0], max(1, self.model.cfg.top_k)
        ids = np.empty((len(self.descs), B, k), dtype=np.int64)
        return (*self._stack_head, B, h.data_ptr(), x.data_ptr(), pos, slot, idx, off, states, ids.ctypes.data,
                *self._stack_tail, h.shape[1], self._stack_failed), ids

    def _run_stack(self, h: torch.Tensor, x: torch.Tensor, arrays: tuple, nthreads: int) -> None:
        """Every layer and the final norm in one ms_decode_stack call (x = the normed output); routes booked."""
        args, ids = self._stack_args(h, x, arrays[1])
        rc = cpu_quant.module().ms_decode_stack(*args, nthreads)
        if rc:
            raise RuntimeError(f"CPU decode layer {int(self.stack['failed'][0])} failed ({rc})")
        self._book(ids)

    def _per_layer(self, h: torch.Tensor, x: torch.Tensor, arrays: tuple, nthreads: int, batch) -> torch.Tensor:
        """One compiled call per described layer and MoE block, the per-op path for the others: the final hidden
        states [T, H] before the final norm."""
        m = self.model
        ids = np.empty((h.shape[0], max(1, m.cfg.top_k)), dtype=np.int64)
        normed = None
        for i, layer in enumerate(m.layers):
            if self.descs[i] is None:
                h, normed = m._layer(i, h, normed, batch)
                h = h.contiguous()
                continue
            normed = None
            self.run_layer(i, h, x, arrays, nthreads)
            if self._moe_now(i, layer.mlp):
                self.run_moe(i, layer.mlp, h, x, ids, nthreads)
            elif not self.has_mlp[i]:
                h = self._mlp(layer.mlp, x, h)
        return h

    def _moe_now(self, i: int, block) -> bool:
        """Whether block i takes its one call this step: described, its runtime still the one whose expert table
        the description holds (a rebuilt runtime is not), and no routing tap attached since (trace record/force)."""
        return self.moe[i] is not None and block.runtime is self._runtimes[i] and block.runtime.tap is None

    def run_moe(self, i: int, block, h: torch.Tensor, x: torch.Tensor, ids: np.ndarray, nthreads: int) -> None:
        """Layer i's MoE block in one call: h += routed (+ shared) experts of x; the route is booked."""
        B = h.shape[0]
        rc = cpu_quant.module().ms_moe_decode(self.moe[i].ctypes.data, B, x.data_ptr(), h.data_ptr(),
                                              ids.ctypes.data, nthreads)
        if rc:
            raise RuntimeError(f"CPU decode MoE block {i} failed ({rc})")
        block.runtime.book_host_call(block.layer, ids[:B])

    @staticmethod
    def _mlp(mlp, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        if getattr(mlp, "takes_residual", False):
            return mlp._fused_forward(x, h).contiguous()
        return (h + mlp(x)).contiguous()

"""A MoE layer's CPU-computed (token, expert) pairs in ONE compiled call (kernels/cpu_quant.moe_layer).

Every CPU path of a layer call goes through here when the compiled kernels are built and the layer's
experts are in a type they read: GGUF experts of Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K/F16/BF16 or the
codebook types IQ4_NL/IQ4_XS/IQ3_S/MXFP4 (gate, up and down may differ, e.g. Q4_K_M's Q6_K down), HF
safetensors NVFP4 / MXFP4 experts (H and I multiples of 32) and FP8 experts (e4m3 with float32 or bf16 scales
per block, row or matrix; float32 activations), each matrix passed as a descriptor of its parts' addresses, built
here and kept alive with the address table, and dense bf16/f16 banks (the bridge's PairMlp). Callers:

- `compute.partial_outputs` (the grouped path on a CPU device: fused, offload, cpu, hybrid), for experts of
  any row count (a prefill chunk's experts as a decode step's, as qlinear does);
- `bridge.CpuBridge` (the decode step's CPU pairs of cpu/hybrid on a GPU), every pair;
- `qpairs.quant_pair_outputs_torch` on a CPU device (the pair path's CPU reference), every pair.

The kernel quantizes each x row once (int8 per 32, as qlinear's kernel), computes gate and up of every
expert's pairs, h = silu(g) * u rounded to the activations' dtype, quantizes h, runs the down projection
and multiplies by the routing weight; a pair's value depends only on its x row and its expert's bytes, not
on which other pairs share the call, so every placement gives the same tokens. Semantics are the pair
kernels' (float32 gate/up/down outputs, h rounded to x.dtype; dense experts: PairMlp's, every matmul
output rounded to the weights' dtype). MOESTREAM_CPU_KERNELS=0 or a failed build: the callers' torch paths.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from .formats import GGUFExpertFormat, HFExpertFormat

GGUF_PROJS = ("gate", "up", "down")
# Rows of one expert from which a float32 GEMM on its widened 16-bit rows beats the float kernels (the 2-core
# AVX-512 VM, H 2048, I 768, bf16: 16 rows 2.0 vs 2.8 ms, 32 rows 5.2 vs 3.9; 2026-12-07)
DENSE_KERNEL_MAX_ROWS = 16
# an HF FP4 expert matrix's parts as the kernels' descriptor holds them: codes, scales, global scale (or none)
FP4_PARTS = {"nvfp4": ("weight", "weight_scale", "weight_scale_2"), "mxfp4": ("blocks", "scales", None)}


@lru_cache(maxsize=None)
def kernel_types(fmt) -> tuple[str, str, str] | None:
    """(gate, up, down) type names if the compiled kernel reads this layer format, else None: GGUF type names, or
    an HF format's name ("nvfp4" / "mxfp4" / "fp8", cpu_quant.HF_TYPES) three times."""
    from ..kernels.cpu_quant import supports
    from ..quant.fp_formats import FP8Format

    if isinstance(fmt, HFExpertFormat) and isinstance(fmt.qfmt, FP8Format):
        scale = fmt.qfmt.parts[1].name  # the kernel reads float32 or bf16 scales
        dts = {dt for a, dt in fmt.parts if a.endswith("." + scale)}
        return ("fp8",) * 3 if len(dts) == 1 and dts <= {torch.float32, torch.bfloat16} else None
    if isinstance(fmt, HFExpertFormat):
        name = getattr(fmt.qfmt, "name", None)
        if name not in FP4_PARTS or fmt.hidden % 32 or fmt.inter % 32:
            return None
        global_scale = FP4_PARTS[name][2]
        if global_scale and any(dt != torch.float32 for a, dt in fmt.parts if a.endswith("." + global_scale)):
            return None
        return (name,) * 3
    if not isinstance(fmt, GGUFExpertFormat):
        return None
    t = dict(fmt.types)
    types = tuple(t[p] for p in GGUF_PROJS)
    return types if all(supports(name) for name in types) else None


_DENSE = {torch.bfloat16: "BF16", torch.float16: "F16"}


def kernels_on() -> bool:
    """Whether the compiled kernels run now (built, enabled, not inside a prefill step)."""
    from ..kernels import cpu_quant

    return cpu_quant.available()


def ready(fmt, x: torch.Tensor, bank: dict | None = None) -> bool:
    """Whether `run` computes this layer's experts for activations x: CPU x in float32/bf16/f16, kernels
    built and enabled, and a GGUF or HF FP4 format they read (or, fmt None / dense, a bf16/f16 bank)."""
    from ..kernels import cpu_quant

    if x.device.type != "cpu" or x.dtype not in cpu_quant.ACT_DTYPES:
        return False
    if bank is not None and any(a.device.type != "cpu" for a in bank.values()):
        return False
    if fmt is not None and fmt.quantized:
        ok = kernel_types(fmt) is not None
    else:
        ok = bank is not None and "gate_up" in bank and bank["gate_up"].dtype in _DENSE
    return ok and cpu_quant.available()


@lru_cache(maxsize=None)
def _gguf_layout(fmt) -> tuple:
    """(types, I, bytes of gate/up/down) of a GGUF layer format (cached: formats are frozen)."""
    H, I = fmt.hidden, fmt.inter
    need = tuple(fmt.quant(p).nbytes(s) for p, s in zip(GGUF_PROJS, ((I, H), (I, H), (H, I))))
    return kernel_types(fmt), I, need


def _row_bytes(a: torch.Tensor) -> int:
    """Bytes of one row a[i] if its elements are contiguous, else -1."""
    expected = 1
    for d in range(a.dim() - 1, 0, -1):
        if a.shape[d] != 1 and a.stride(d) != expected:
            return -1
        expected *= a.shape[d]
    return expected * a.element_size()


def _part_rows(bank: dict, sizes: dict, key: str, experts: np.ndarray) -> np.ndarray:
    """Addresses of rows `experts` of the bank array `key` (an HF expert part), checked to be CPU rows of at least the
    format's bytes, contiguous."""
    a, nb = bank[key], sizes[key][0]
    if a.device.type != "cpu" or _row_bytes(a) < nb:
        raise ValueError(f"expert array {key}: CPU rows of at least {nb} contiguous bytes needed")
    return a.data_ptr() + experts * (a.stride(0) * a.element_size())


def _descriptor_table(desc: np.ndarray) -> np.ndarray:
    """Addresses [G, 3] of the descriptors desc [G, 3, W] (int64 each), held in the same buffer as the addresses,
    so whoever keeps the returned array (a view of it) keeps the descriptors."""
    G, W = desc.shape[0], desc.shape[-1]
    buf = np.empty(3 * G + desc.size, dtype=np.int64)
    buf[3 * G:] = desc.reshape(-1)
    ptrs = buf[:3 * G].reshape(G, 3)
    ptrs[:] = buf.ctypes.data + 8 * 3 * G + 8 * W * np.arange(3 * G).reshape(G, 3)
    return ptrs


def _fp4_ptrs(bank: dict, fmt: HFExpertFormat, experts: np.ndarray, name: str) -> np.ndarray:
    """expert_ptrs' addresses [G, 3] for HF FP4 experts: each the address of a descriptor (cpu_quant.fp4_descriptors:
    the matrix's codes, scales, global scale; _descriptor_table)."""
    from ..kernels.cpu_quant import fp4_descriptors

    sizes = fmt.shapes(fmt.hidden, fmt.inter)
    addr = np.zeros((3, 3, len(experts)), dtype=np.int64)  # [matrix, part, expert]
    for j, proj in enumerate(GGUF_PROJS):
        for c, part in enumerate(FP4_PARTS[name]):
            if part is not None:
                addr[j, c] = _part_rows(bank, sizes, f"{proj}.{part}", experts)
    return _descriptor_table(fp4_descriptors(addr[:, 0].T, addr[:, 1].T,
                                             addr[:, 2].T if FP4_PARTS[name][2] else None))  # [G, 3, 3]


def _fp8_ptrs(bank: dict, fmt: HFExpertFormat, experts: np.ndarray, name: str) -> np.ndarray:
    """expert_ptrs' addresses [G, 3] for HF FP8 experts: each the address of a descriptor (cpu_quant.fp8_descriptors:
    the matrix's codes, scales and their layout; _descriptor_table)."""
    from ..kernels.cpu_quant import fp8_descriptors

    q, sizes, logical = fmt.qfmt, fmt.shapes(fmt.hidden, fmt.inter), fmt.logical(fmt.hidden, fmt.inter)
    scale = q.parts[1].name
    descs = []
    for proj in GGUF_PROJS:
        block, stride = q.scale_layout(*logical[proj])  # per expert
        codes, scales = (_part_rows(bank, sizes, f"{proj}.{part}", experts) for part in ("weight", scale))
        bf16 = dict(fmt.parts)[f"{proj}.{scale}"] == torch.bfloat16
        descs.append(fp8_descriptors(codes, scales, block, stride, bf16))  # [G, 6]
    return _descriptor_table(np.stack(descs, 1))  # [G, 3, 6]


_X8_ATTR = "_moestream_x8"  # on a bank tensor: (its address then, the interleaved copy, the copy's type name, bytes)


def attach_x8(src: torch.Tensor, copy: np.ndarray, type_name: str, per_expert: int) -> None:
    """Records on a layer's bank of one projection (src [E, ...], GGUF rows) its experts' 8-row interleaved copy (E
    blocks of per_expert bytes, kernels/cpu_quant.repack_x8's layout of type_name: the CPU decode plan's), so that
    every call of the layer's experts from here (prefill chunks as decode steps) reads the copy and none touches the
    file's bytes of them. The tensor keeps the copy alive; a bank replaced or moved (another address) drops it."""
    setattr(src, _X8_ATTR, (src.data_ptr(), copy, f"{type_name}_x8", per_expert))


def interleave_projection(addrs: np.ndarray, name: str, rows: int, k: int) -> tuple[np.ndarray, int]:
    """One projection of a layer's experts (the address of each expert's rows x k matrix of GGUF type `name`, rows
    contiguous) copied into one array of the experts' 8-row interleaved matrices, expert after expert
    (kernels/cpu_quant.repack_x8, threaded): (the array, bytes per expert)."""
    from ..kernels import cpu_quant

    stride = cpu_quant.row_bytes(name, k)
    per = rows * cpu_quant.X8_TYPES[name][1](k)
    arr = np.empty(len(addrs) * per, dtype=np.uint8)
    for e, addr in enumerate(np.asarray(addrs).tolist()):
        cpu_quant.repack_x8(addr, rows, k, stride, name, out=arr[e * per:(e + 1) * per])
    return arr, per


def interleave_layer(bank: dict, fmt, room=None) -> int:
    """Gives a host layer of GGUF experts the 8-row interleaved copies the CPU kernels read faster (each projection
    whose type has the layout: one copy of all the layer's experts, attach_x8), so every CPU call of the layer reads
    them; the file's layout stays where it is for whatever else reads it (PCIe copies, the GPU's kernels).
    room(nbytes) -> bool may refuse a copy (host memory). Returns the bytes copied (0: none, or already there)."""
    from ..kernels import cpu_quant

    if not isinstance(fmt, GGUFExpertFormat) or any(bank[p].device.type != "cpu" for p in GGUF_PROJS):
        return 0
    H, I = fmt.hidden, fmt.inter
    E = min(bank[p].shape[0] for p in GGUF_PROJS)
    ptrs, names, _, _ = expert_ptrs(bank, fmt, np.arange(E))
    made = 0
    for j, (p, (rows, k)) in enumerate(zip(GGUF_PROJS, ((I, H), (I, H), (H, I)))):
        name = names[j]
        if not cpu_quant.x8_fits(name, rows, k):
            continue  # (a name already "<type>_x8": copied before)
        nbytes = E * rows * cpu_quant.X8_TYPES[name][1](k)
        if room is not None and not room(nbytes):
            break
        arr, per = interleave_projection(ptrs[:, j], name, rows, k)
        attach_x8(bank[p], arr, name, per)
        made += arr.nbytes
    return made


def x8_copy(src: torch.Tensor) -> tuple[np.ndarray, str, int] | None:
    """(copy, its type name, bytes per expert) attach_x8 recorded on src, if still for src's bytes; else None."""
    got = getattr(src, _X8_ATTR, None)
    return got[1:] if got is not None and got[0] == src.data_ptr() else None


def expert_ptrs(bank: dict, fmt, experts: np.ndarray) -> tuple[np.ndarray, tuple[str, str, str], int, bool]:
    """(addresses [G, 3] of gate/up/down of bank rows `experts`, types, I, round_mm) for `run`. Checks that
    every row index is in the bank and every row holds the layer's bytes, contiguous. HF FP4 experts: the
    addresses are of descriptors that live in the returned array's buffer (keep it while they are used). A GGUF
    projection with an interleaved copy (attach_x8) is read from the copy (type "<name>_x8")."""
    experts = np.asarray(experts, dtype=np.int64)
    if isinstance(fmt, HFExpertFormat) and kernel_types(fmt) is not None:
        types = kernel_types(fmt)
        n = min(a.shape[0] for a in bank.values())
        if len(experts) and (experts.min() < 0 or experts.max() >= n):
            raise IndexError(f"expert rows {experts.min()}..{experts.max()} outside a bank of {n}")
        ptrs = (_fp8_ptrs if types[0] == "fp8" else _fp4_ptrs)(bank, fmt, experts, types[0])
        return ptrs, types, fmt.inter, False
    if fmt is not None and fmt.quantized:
        types, I, need = _gguf_layout(fmt)
        arrays = [bank[p] for p in GGUF_PROJS]
        offsets = (0, 0, 0)
        round_mm = False
    else:
        gu, dn = bank["gate_up"], bank["down"]
        I2, H = gu.shape[-2:]
        I = I2 // 2
        types = (_DENSE[gu.dtype],) * 3
        arrays = [gu, gu, dn]
        need = (I2 * H * gu.element_size(),) * 2 + (H * I * dn.element_size(),)
        offsets = (0, I * H * gu.element_size(), 0)
        round_mm = True
    if len(experts) and (experts.min() < 0 or experts.max() >= min(a.shape[0] for a in arrays)):
        raise IndexError(f"expert rows {experts.min()}..{experts.max()} outside a bank of {arrays[0].shape[0]}")
    ptrs = np.empty((len(experts), 3), dtype=np.int64)
    for j, (a, nb, off) in enumerate(zip(arrays, need, offsets)):
        if a.device.type != "cpu" or _row_bytes(a) < nb:
            raise ValueError(f"expert array {j}: CPU rows of at least {nb} contiguous bytes needed")
        ptrs[:, j] = a.data_ptr() + experts * (a.stride(0) * a.element_size()) + off
    if fmt is not None and fmt.quantized:
        for j, a in enumerate(arrays):
            x8 = x8_copy(a)
            if x8 is not None:
                ptrs[:, j] = x8[0].ctypes.data + experts * x8[2]
                types = types[:j] + (x8[1],) + types[j + 1:]
    return ptrs, types, I, round_mm


def layer_table(bank: dict, fmt):
    """(addresses [E, 3] of every expert's gate/up/down, type ids, I, the GGUF bank's gate / up / down tensors or
    None) of a layer of GGUF or HF FP4 experts the kernels read, in host memory; None otherwise
    (models/cpu_decode.py's one-call MoE block, which keeps the address array alive: HF FP4's descriptors live in
    its buffer, and attaches its interleaved copies to the bank's tensors)."""
    from ..kernels.cpu_quant import type_id

    if fmt is not None and fmt.quantized:
        types = kernel_types(fmt)
    else:  # 16-bit banks (the float-activation kernels: a decode step's few rows each)
        types = _DENSE.get(bank["gate_up"].dtype) if "gate_up" in bank and "down" in bank else None
    if types is None or any(a.device.type != "cpu" for a in bank.values()):
        return None
    E = min(a.shape[0] for a in bank.values())
    ptrs, types, inter, _ = expert_ptrs(bank, fmt, np.arange(E))
    arrays = tuple(bank[p] for p in GGUF_PROJS) if isinstance(fmt, GGUFExpertFormat) else None
    return ptrs, tuple(type_id(t) for t in types), inter, arrays


class LayerCall:
    """`run` for one layer's bank, with what does not change between calls worked out once: the arrays'
    addresses and row strides, the type ids, I, the rounding mode (the bridge worker calls it every decode
    step of every MoE layer; `run`'s argument building and checks cost ~100 us a call in Python, a few
    percent of a CPU decode step). The bank must stay where it is while this object is used."""

    def __init__(self, bank: dict, fmt, x_dtype: torch.dtype):
        from ..kernels.cpu_quant import ACT_DTYPES, type_id

        E = self._experts(bank)
        # every expert's addresses (HF FP4: of descriptors in this table's buffer, kept alive by self.table)
        self.table, self.types, self.inter, self.round_mm = expert_ptrs(bank, fmt, np.arange(E, dtype=np.int64))
        self.base = self.table[0]
        self.step = self.table[1] - self.table[0] if E > 1 else np.zeros_like(self.base)
        self.tids = np.array([type_id(t) for t in self.types], dtype=np.int64)
        self.h_code = ACT_DTYPES[x_dtype]
        self.num_experts = self._experts(bank)

    @staticmethod
    def _experts(bank: dict) -> int:
        return min(a.shape[0] for a in bank.values())

    def __call__(self, x: torch.Tensor, experts: np.ndarray, starts: np.ndarray, rows: np.ndarray,
                 weights: np.ndarray, dst: np.ndarray, out: torch.Tensor) -> torch.Tensor:
        """x contiguous CPU [nx, H] in the dtype given at construction; int64 experts (ascending, in the bank),
        starts [G + 1], rows, dst [P]; float32 weights [P]; out float32 [n, H] with contiguous rows."""
        from ..kernels.cpu_quant import moe_layer_unchecked

        if len(experts) and (experts[0] < 0 or experts[-1] >= self.num_experts):
            raise IndexError(f"expert rows {experts[0]}..{experts[-1]} outside a bank of {self.num_experts}")
        wptr = self.base[None, :] + experts[:, None] * self.step[None, :]
        moe_layer_unchecked(x, wptr, self.tids, starts, rows, weights, dst, out, self.inter, self.h_code,
                            self.round_mm)
        return out


def run(x: torch.Tensor, bank: dict, fmt, experts: np.ndarray, starts: np.ndarray, rows: np.ndarray,
        weights: np.ndarray | None, dst: np.ndarray, out: torch.Tensor) -> torch.Tensor:
    """out[dst[p]] = weights[p] * mlp_{experts[g]}(x[rows[p]]) for the pairs p of group g
    (starts[g]:starts[g+1]); see kernels/cpu_quant.moe_layer. h is rounded to x.dtype."""
    from ..kernels.cpu_quant import moe_layer

    ptrs, types, inter, round_mm = expert_ptrs(bank, fmt, experts)
    x = x.contiguous()
    return moe_layer(x, ptrs, types, starts, rows, weights, dst, out, inter, h_dtype=x.dtype, round_mm=round_mm)


def layer_partials(x: torch.Tensor, topk_w: torch.Tensor, groups, refs: dict) -> dict:
    """`compute.partial_outputs` for the refs the kernels compute (one bank and format: GGUF / HF compressed, or
    16-bit rows against float32 x for experts of at most DENSE_KERNEL_MAX_ROWS rows): {expert: w * mlp(x rows)
    float32 [n_e, H]}; the others (or {} where the kernels do not apply) are left to the caller."""
    first = next(iter(refs.values()))
    dense = first.fmt is None or not first.fmt.quantized
    if not ready(first.fmt, x, first.bank if dense else None) or (dense and x.dtype != torch.float32):
        return {}  # 16-bit activations against 16-bit banks: torch's GEMMs in that dtype, HF's numerics
    where = groups.index()
    # 16-bit banks: an expert of a few rows by the float kernels, of more by one float32 GEMM (compute.expert_mlp)
    most = DENSE_KERNEL_MAX_ROWS if dense else x.shape[0]
    sel = [e for e, r in refs.items() if r.bank is first.bank and r.fmt == first.fmt
           and groups.counts[where[e]] <= most]
    if not sel:
        return {}
    counts = np.array([groups.counts[where[e]] for e in sel], dtype=np.int64)
    starts = np.zeros(len(sel) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    firsts = np.array([groups.starts[where[e]] for e in sel], dtype=np.int64)
    idx = np.repeat(firsts - starts[:-1], counts) + np.arange(starts[-1])  # positions in groups.rows
    prow = groups.rows.numpy()[idx]
    w = topk_w.detach().float().numpy()[prow, groups.pos.numpy()[idx]]
    out = torch.empty(int(starts[-1]), x.shape[1], dtype=torch.float32)
    run(x, first.bank, first.fmt, np.array([refs[e].index for e in sel]), starts, prow, w,
        np.arange(starts[-1]), out)
    return {e: out[starts[i]:starts[i + 1]] for i, e in enumerate(sel)}


def pair_outputs(x: torch.Tensor, topk_w: torch.Tensor, src: torch.Tensor, pool: dict, fmt,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """The pair contract on CPU (moe/qpairs.py): y [P, H] float32, w[p] * mlp(x[p // k]) from pool row
    src[p]; rows of pairs with src[p] < 0 are zero (or left as they are in a given `out`)."""
    T, k = topk_w.shape
    s = src.numpy()
    pairs = np.flatnonzero(s >= 0)
    order = pairs[np.argsort(s[pairs], kind="stable")]
    experts, first = np.unique(s[order], return_index=True)
    starts = np.append(first, len(order)).astype(np.int64)
    if out is None:
        out = torch.zeros(T * k, x.shape[1], dtype=torch.float32)
    w = topk_w.detach().float().reshape(-1).numpy()[order]
    return run(x, pool, fmt, experts, starts, order // k, w, order, out)

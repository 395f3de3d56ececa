"""Decode-time routed experts over (token, k) pairs, straight from COMPRESSED expert rows.

The quantized twin of moe/pairs.py (same pair contract, same bookkeeping): P = T*k pairs, pair
p = t*k + j reads token t and the expert row src[p] of the pool; src[p] < 0 means another producer
(moe/bridge.py: the CPU) fills that output row, which is left untouched (garbage until then).

    quant_pair_outputs(x, topk_w, src, pool, fmt) -> y [P, H] float32

x [T, H] (bf16 / fp16 / fp32); topk_w [T, k]; src [P] int64; pool: array name -> uint8 [rows, bytes]
holding each expert's STORED bytes (moe/formats.py: GGUF "gate"/"up"/"down", HF "gate.weight",
"gate.weight_scale_inv", ...); fmt: the layer's GGUFExpertFormat / HFExpertFormat (a dense format
goes to pairs.pair_outputs with pool {"gate_up", "down"}). A pool row may be longer than this
layer's bytes (slot rows of per-layer GGUF type mixes are sized for the largest type): the layer's
bytes are the row's front, the row stride is the pool tensor's stride(0).

Semantics (both implementations), with W_* dequantized by moestream.quant's decoders to float32:

    g = W_gate x, u = W_up x      fp32 accumulation over H
    h = silu(g) * u               rounded to x.dtype (as the dense pair kernels do)
    y[p] = w[p] * (W_down h)      fp32

Implementations:
- on CPU, where the compiled kernels read the layer's types: moe/cpu_moe.py, one call for the layer
  (activations rounded to int8 per block, as the CPU bridge computes its pairs);
- `quant_pair_outputs_torch`: the reference and the other CPU path. On CPU it dequantizes each distinct
  row used once; on CUDA (formats without a Triton decoder) it gathers and dequantizes one row per
  pair, which has static shapes and no host reads, so it can be recorded in a CUDA graph (slow:
  a fallback, not the decode path).
- Triton kernels (CUDA, `supports(fmt)`): blocks are decoded in registers by the decoders of
  moestream.quant.triton_dequant and dotted with x in fp32; nothing dense is written.
  Given the call's staged misses (`staged`, where `fetches_in_pairs`: one-token calls by default),
  the fetch variants of the two kernels copy each miss's rows from the pinned host bank into its pool row as part
  of computing them (no copy kernel first: the hits compute while the misses cross PCIe).
"""
from __future__ import annotations

import torch

from ..env import launch_triple
from .formats import PROJS, GGUFExpertFormat, HFExpertFormat
from .swiglu import swiglu

try:  # optional: absent on CPU-only installs (the torch reference runs there)
    import triton
    import triton.language as tl

    from ..quant import triton_dequant as td
    from ..quant.triton_dequant import Q8R, _e2m1, _e4m3, _e8m0, _f16, _ld, _store, gguf_decode
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def supports(fmt) -> bool:
    """Whether the Triton pair kernels read `fmt` (the layer format) on CUDA: every quantized GGUF type and HF FP8 /
    NVFP4 / MXFP4 (other HF formats run `quant_pair_outputs_torch` there)."""
    if triton is None:
        return False
    if isinstance(fmt, GGUFExpertFormat):
        return all(t in td._GGUF_IDS for _, t in fmt.types)
    if isinstance(fmt, HFExpertFormat):
        from ..quant.fp_formats import FP8Format, MXFP4Format, NVFP4Format

        return isinstance(fmt.qfmt, (FP8Format, NVFP4Format, MXFP4Format))
    return False


def quant_pair_outputs(x: torch.Tensor, topk_w: torch.Tensor, src: torch.Tensor, pool: dict, fmt,
                       staged: tuple | None = None) -> torch.Tensor:
    """y [P, H] float32: w[p] * mlp(x[p // k]) from the compressed pool row src[p] (module doc). staged: the call's
    misses (host bank, experts, rows, count: caches.PairRows.staged) not yet copied into their rows; the kernels
    copy them on the Triton path (the caller asks `fetches_in_pairs` whether to hand them over), every other path
    runs the copy kernel first."""
    if not getattr(fmt, "quantized", False):
        from .pairs import pair_outputs

        return pair_outputs(x, topk_w, src, pool, staged=staged)
    if x.device.type == "cuda" and supports(fmt) and _triton_ok():
        return _quant_pair_outputs_triton(x, topk_w, src, pool, fmt, staged=staged)
    if staged is not None:
        from .pairs import stage_experts

        stage_experts(staged[0], pool, *staged[1:])
    if x.device.type == "cpu":
        from . import cpu_moe

        if cpu_moe.ready(fmt, x):  # the compiled layer call (int8 activations), as the CPU bridge computes
            return cpu_moe.pair_outputs(x, topk_w, src, pool, fmt)
    return quant_pair_outputs_torch(x, topk_w, src, pool, fmt)


def quant_pair_outputs_torch(x, topk_w, src, pool, fmt) -> torch.Tensor:
    """The reference: dequantize (moestream.quant's decoders) to float32, fp32 GEMVs. Rows of pairs with
    src < 0 are zero here (callers must not rely on it: the kernels leave them untouched)."""
    if not isinstance(fmt, (GGUFExpertFormat, HFExpertFormat)):
        raise TypeError(f"{fmt.name}: pass the layer's own format (LayeredGGUFFormat.for_layer(layer))")
    T, k = topk_w.shape
    P = T * k
    H = fmt.hidden
    if x.shape[1] != H:
        raise ValueError(f"x has {x.shape[1]} features, the experts H={H}")
    if x.device.type == "cpu":
        pairs = torch.nonzero(src >= 0).flatten()
        if pairs.numel() == 0:
            return torch.zeros(P, H, dtype=torch.float32)
        rows, inv = torch.unique(src[pairs], return_inverse=True)  # each distinct row decoded once
    else:  # static shapes, no host reads: one row per pair (rows of skipped pairs: row 0, discarded)
        pairs = torch.arange(P, device=x.device)
        rows, inv = src.clamp(min=0), pairs
    wg, wu, wd = (w[inv] for w in dequantize_rows(pool, fmt, rows))  # [n, I, H], [n, I, H], [n, H, I]
    xp = x[pairs // k].float()
    g = torch.bmm(wg, xp.unsqueeze(-1)).squeeze(-1)
    u = torch.bmm(wu, xp.unsqueeze(-1)).squeeze(-1)
    h = swiglu(g, u, x.dtype).float()
    out = torch.bmm(wd, h.unsqueeze(-1)).squeeze(-1) * topk_w.reshape(-1)[pairs].float().unsqueeze(-1)
    if x.device.type != "cpu":
        return torch.where((src >= 0).unsqueeze(-1), out, 0.0)
    y = torch.zeros(P, H, dtype=torch.float32, device=x.device)
    return y.index_copy_(0, pairs, out)


def dequantize_rows(pool: dict, fmt, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Pool rows `rows` [n] -> float32 (gate [n, I, H], up [n, I, H], down [n, H, I]) via the format's
    decoders (the Triton dequant kernels on CUDA, bit-identical to torch)."""
    n = rows.shape[0]
    sizes = {name: s[0] for name, s in fmt.shapes(fmt.hidden, fmt.inter).items()}  # this layer's bytes per row
    # each array's rows, cut to the layer's bytes (the front of a possibly longer slot row)
    gathered = {name: pool[name].index_select(0, rows)[:, :nb].contiguous() for name, nb in sizes.items()}
    out = []
    for proj in PROJS:
        q, raw, shape = _weight(fmt, gathered, proj)
        out.append(q.dequantize(raw, (n, *shape), torch.float32))
    return tuple(out)


def _weight(fmt, rows: dict, proj: str):
    """(QuantFormat, raw parts, logical shape of ONE expert) for stacked rows [n, bytes]."""
    if isinstance(fmt, GGUFExpertFormat):
        return fmt.quant(proj), rows[proj], fmt.logical(fmt.hidden, fmt.inter)[proj]
    return fmt.weight(rows, proj)  # HF: views each part's bytes as its stored dtype (last dim)


def _triton_ok() -> bool:
    from ..env import triton_enabled

    return triton is not None and triton_enabled()


# ----------------------------------------------------------------------------- Triton host side
def _quant_pair_outputs_triton(x, topk_w, src, pool, fmt, cfg=None, y=None, staged=None) -> torch.Tensor:
    """The kernels (also on CPU tensors under TRITON_INTERPRET=1: the tests). Shapes only decide the
    launches (no host reads of device values, outputs from torch.empty): CUDA-graph capturable.
    cfg: {"gate_up": (BN, BV, warps), "down": ...} overrides the launch constants (benchmarks, tests);
    y: an output to write into (rows of pairs with src < 0 are left as they are); staged (where
    `fetches_in_pairs`): the misses the kernels copy from the host bank into their rows as they compute."""
    T, k = topk_w.shape
    P = T * k
    x, src = x.contiguous(), src.contiguous()
    h = torch.empty((P, fmt.inter), dtype=x.dtype, device=x.device)
    gate_up_triton(x, src, pool, fmt, k, h, (cfg or {}).get("gate_up"), staged)
    if y is None:
        y = torch.empty((P, fmt.hidden), dtype=torch.float32, device=x.device)
    down_triton(h, topk_w.reshape(-1).contiguous(), src, pool, fmt, y, (cfg or {}).get("down"), staged)
    return y


def gate_up_triton(x, src, pool, fmt, k: int, h: torch.Tensor, cfg=None, staged=None) -> torch.Tensor:
    """h [P, I] (x.dtype) = silu(W_gate x) * W_up x for every pair with a row; other rows untouched."""
    return _launch(pool, fmt, "gate_up", (x, src), fmt.inter, fmt.hidden, h, cfg, k=k, staged=staged)


def down_triton(h, w, src, pool, fmt, y: torch.Tensor, cfg=None, staged=None) -> torch.Tensor:
    """y [P, H] float32 = w[p] * W_down h[p] for every pair with a row; other rows untouched."""
    return _launch(pool, fmt, "down", (h, src), fmt.hidden, fmt.inter, y, cfg, w=w, staged=staged)


def fetches_in_pairs(x: torch.Tensor, fmt, pool: dict, tokens: int) -> bool:
    """Whether this layer call's pair kernels copy its misses themselves (env.fetch_in_pairs; module doc of the
    fetch kernels): compressed experts on the Triton path (GGUF, FP8, NVFP4, MXFP4), at one token (or any batch under
    "all")."""
    from ..env import fetch_in_pairs

    how = fetch_in_pairs()
    return (how == "all" or (how == "1" and tokens == 1)) and x.is_cuda and supports(fmt) and _triton_ok() \
        and _fetch_layout(fmt, pool)


def _fetch_layout(fmt, pool: dict) -> bool:
    """Whether the fetch kernels know every array of the layer's pool: GGUF's gate / up / down, or an HF format's
    row-wise codes, then its scales, then (NVFP4) a per-tensor scale."""
    if isinstance(fmt, GGUFExpertFormat):
        return set(pool) == set(PROJS)
    parts = fmt.qfmt.parts
    return (set(pool) == {f"{proj}.{p.name}" for proj in PROJS for p in parts} and parts[0].row_block == 1
            and len(parts) in (2, 3) and (len(parts) == 2 or parts[2].row_block is None))


def _fetch_words(host: torch.Tensor, dst: torch.Tensor, row_bytes: int) -> tuple:
    """(host words, their row stride, pool words, their row stride, words per matrix row) in the widest word that
    divides a matrix row, both row strides and both base addresses (the fetch kernels copy whole matrix rows)."""
    from .pairs import _words

    def fits(size: int) -> bool:
        return all(v % size == 0 for v in (row_bytes, host.stride(0) * host.element_size(), host.data_ptr(),
                                           dst.stride(0) * dst.element_size(), dst.data_ptr()))

    size = next(s for s in (8, 4, 2, 1) if fits(s))
    hw, pw = _words(host, size), _words(dst, size)
    return hw, hw.stride(0), pw, pw.stride(0), row_bytes // size


def _hf_fetch_args(staged, pool: dict, fmt, proj: str, K: int, BN: int) -> tuple[list, dict]:
    """The HF fetch kernels' arguments of one projection: (host words, stride, pool words, stride) of its codes,
    scales and (NVFP4) per-tensor scale (the codes' again where a format has no third part), and their constants:
    words per stored row of each, matrix rows per stored scale row (RBP_S; per-tensor: 1 << 30) and the most scale
    rows one program's rows span (NR_S)."""
    host, dtypes, parts = staged[0], dict(fmt.parts), fmt.qfmt.parts
    args, consts = [], {"NPARTS": len(parts), "RW_G": 1}
    for key, part in zip(("W", "S", "G"), parts):
        name = f"{proj}.{part.name}"
        hw, hs, pw, ps, rw = _fetch_words(host[name], pool[name], part.cols(K) * dtypes[name].itemsize)
        args += [hw, hs, pw, ps]
        consts[f"RW_{key}"] = rw
        if key == "S":
            rbp = part.row_block or 1 << 30
            consts["RBP_S"], consts["NR_S"] = rbp, (BN if rbp == 1 else BN // rbp + 2)
    args += args[:4] * (3 - len(parts))  # the absent part: never read (NPARTS)
    return args, consts


def _gguf_fetch_args(staged, pool: dict, fmt, names) -> tuple[list, list[int]]:
    """The GGUF fetch kernels' arguments of `names` (host words, stride, pool words, stride, each) and their words
    per matrix row."""
    args, rws = [], []
    for name in names:
        q = fmt.quant(name)
        K = fmt.hidden if name != "down" else fmt.inter
        hw, hs, pw, ps, rw = _fetch_words(staged[0][name], pool[name], K // q.block_size * q.type_size)
        args += [hw, hs, pw, ps]
        rws.append(rw)
    return args, rws


def _fetch_cw(fmt, bv: int) -> int:
    """The fetch kernels' copy step: FETCH_CW, doubled for Q8_0R rows where the dot's x step is as long. The Q8_0R dot
    loads x as a 1-D [BV] tile; with BV = FETCH_CW its arange is the copy's, and Triton's coalescing then gave the
    copy's host loads x's 8 elements a thread and sent every chunk through shared memory, two barriers a chunk (sm_90
    PTX, RESULTS.md thirty-fifth session); a copy step of another length keeps the copy straight."""
    q8r = isinstance(fmt, GGUFExpertFormat) and any(t == "Q8_0R" for _, t in fmt.types)
    return 2 * FETCH_CW if q8r and bv == FETCH_CW else FETCH_CW


FETCH_CW = 1024  # words a fetch kernel's copy moves a step (8 KiB of 8-byte words: four 16-byte loads a thread at 4 warps)


def linear_supported(fmt) -> bool:
    """Does `quant_linear` have a kernel for this moestream.quant GGUF format (a dense weight's format)?"""
    from ..quant.gguf_formats import GGUFFormat

    return isinstance(fmt, GGUFFormat) and fmt.type_name in td._GGUF_IDS and fmt.type_name != "Q8_0R"  # (expert rows)


def quant_linear(x: torch.Tensor, fmt, raw: torch.Tensor, shape, perm: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, N] (x.dtype) = x [T, K] @ W.T for a dense layer kept compressed (GGUF bytes, N rows of
    K // block_size blocks): the pair "down" kernel with one expert row holding the whole matrix, every
    pair reading it with weight 1 (fp32 accumulation, no dense copy of W); T > 1 rows through the multi-row kernel.
    perm [K] (layers.QuantLinear's in_perm): the stored columns are x's in another order (y = x[:, perm] @ W.T); the
    multi-row kernel reads x through it (no gather launch), else x is gathered first. For decode-sized T on CUDA
    (capturable: shapes decide everything); under TRITON_INTERPRET=1 on CPU tensors in the tests."""
    from .formats import PROJS, gguf_expert_format

    N, K = int(shape[-2]), int(shape[-1])
    key = (fmt.type_name, N, K)
    efmt = _LINEAR_FORMATS.get(key)
    if efmt is None:
        efmt = _LINEAR_FORMATS[key] = gguf_expert_format({p: fmt.type_name for p in PROJS}, hidden=N, inter=K)
    xs = x.reshape(-1, K).contiguous()
    y = torch.empty((xs.shape[0], N), dtype=_linear_out_dtype(x), device=x.device)
    if xs.shape[0] == 1 and fmt.type_name == "Q4_K" and _words_on():  # the word-load experiment
        bf16 = y.dtype == torch.bfloat16
        _q4k_linear_words_kernel[(triton.cdiv(N, 4),)](
            xs, raw.reshape(-1), y.view(torch.int16) if bf16 else y, xs if perm is None else perm, N, K, BN=4,
            BKB=1 << (max(1, min(4, K // 256)).bit_length() - 1), Y_BF16=bf16, PERM=perm is not None, num_warps=4)
    elif perm is not None and _rows_on():  # any T: the permutation read in the kernel
        _launch_linear_rows({"down": raw.reshape(1, -1)}, efmt, xs, y, N, K, perm)
    else:
        if perm is not None:  # the multi-row kernel off: x gathered first
            xs = xs.index_select(-1, perm)
        if _rows_kernel(xs.shape[0]):
            _launch_linear_rows({"down": raw.reshape(1, -1)}, efmt, xs, y, N, K)
        else:
            src, w = _unit_pairs(xs.shape[0], x.device)
            down_triton(xs, w, src, {"down": raw.reshape(1, -1)}, efmt, y, linear_config(N, K, xs.shape[0]))
    return y.to(x.dtype).reshape(*x.shape[:-1], N)


def hf_linear_format(qfmt, dtypes: dict, N: int, K: int):
    """The one-expert HFExpertFormat whose "down" projection is a dense [N, K] weight of HF format qfmt (dtypes: part
    name -> stored dtype), for hf_quant_linear; made once per (format, dtypes, N, K)."""
    from .formats import hf_expert_format

    key = (qfmt.name, tuple(sorted((k, str(v)) for k, v in dtypes.items())), N, K)
    efmt = _LINEAR_FORMATS.get(key)
    if efmt is None:
        efmt = _LINEAR_FORMATS[key] = hf_expert_format(
            qfmt, {f"{p}.{n}": dt for p in PROJS for n, dt in dtypes.items()}, hidden=N, inter=K)
    return efmt


def hf_quant_linear(x: torch.Tensor, efmt, pool: dict, shape) -> torch.Tensor:
    """quant_linear for a dense layer kept in an HF quantization (FP8 block / channel / tensor scales, NVFP4, MXFP4):
    efmt from hf_linear_format, pool {"down.<part>": uint8 [1, bytes]} (the weight's parts). The HF pair "down"
    kernel with one expert row holding the whole matrix (capturable; TRITON_INTERPRET=1 on CPU in the tests)."""
    N, K = int(shape[-2]), int(shape[-1])
    xs = x.reshape(-1, K).contiguous()
    y = torch.empty((xs.shape[0], N), dtype=_linear_out_dtype(x), device=x.device)
    if _rows_kernel(xs.shape[0]):
        _launch_linear_rows(pool, efmt, xs, y, N, K)
    else:
        src, w = _unit_pairs(xs.shape[0], x.device)
        down_triton(xs, w, src, pool, efmt, y, linear_config(N, K, xs.shape[0]))
    return y.to(x.dtype).reshape(*x.shape[:-1], N)


def _linear_out_dtype(x: torch.Tensor) -> torch.dtype:
    """A dense layer's output as the kernel stores it: bf16 rounded in the kernel (round to nearest even, what
    torch's cast of the float32 sums gives: one launch fewer per layer, 164 a Qwen3.6 decode step), else float32
    (cast after where x is fp16)."""
    return torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32


def linear_config(N: int, K: int, T: int):
    """Launch constants (BN, BV, warps) of a dense layer's GEMV (quant_linear / hf_quant_linear): the pair kernels'
    default (None), or MOESTREAM_QLINEAR_CFG="BN,BV,WARPS" (benchmarks/qlinear_gpu.py sweeps them; read once)."""
    cfg = _QLINEAR_CFG.get("v", False)
    if cfg is False:
        cfg = _QLINEAR_CFG["v"] = launch_triple("MOESTREAM_QLINEAR_CFG")
    return cfg


_QLINEAR_CFG: dict = {}

LINEAR_MAX_RT = 8  # activation rows one program of the multi-row dense kernel reads each decoded weight tile for


def _rows_kernel(T: int) -> bool:
    """A dense layer's GEMV of T > 1 rows goes through the multi-row kernel (each weight block decoded once for up
    to LINEAR_MAX_RT rows) unless MOESTREAM_QLINEAR_ROWS=0 (then one pair-kernel program per row, each decoding the
    whole matrix: a batch-4 GEMV cost ~3.2x a batch-1 one on an H100, benchmarks/RESULTS.md 2026-12-06)."""
    return T >= 2 and _rows_on()


def _words_on() -> bool:
    """MOESTREAM_QLINEAR_WORDS=1: one-row Q4_K dense GEMVs through the word-load experiment (_q4k_words_dot: one
    32-bit load per 8 codes instead of a byte load per value; off by default, not measured on a GPU yet)."""
    on = _QLINEAR_CFG.get("words_on")
    if on is None:
        import os

        on = _QLINEAR_CFG["words_on"] = os.environ.get("MOESTREAM_QLINEAR_WORDS", "0") == "1"
    return on


def _mma_on() -> bool:
    """MOESTREAM_QLINEAR_MMA=1: GGUF dense GEMVs of 2-16 rows through the tensor-core experiment (weights rounded to
    bf16 before the dot: not the fp32 products of the other kernels; off by default, not measured on a GPU yet)."""
    on = _QLINEAR_CFG.get("mma_on")
    if on is None:
        import os

        on = _QLINEAR_CFG["mma_on"] = os.environ.get("MOESTREAM_QLINEAR_MMA", "0") == "1"
    return on


def repack_q4k(raw: torch.Tensor, N: int, K: int) -> dict[str, torch.Tensor]:
    """A Q4_K matrix [N, K] (raw: its N * K / 256 blocks of 144 bytes) in the layout of _q4kr_linear_kernel, on
    raw's device: "q" [N, K / 8] int32 (column 8w + c at bits 4c..4c+3 of word w), "sc" / "mn"
    [N, K / 32] uint8 (each sub-block's six-bit scale and min, unpacked), "d" / "dm" [N, K / 256] fp16 (the
    blocks' d and dmin). 148 bytes per 256 values where Q4_K stores 144; the values are the stored ones exactly."""
    from ..quant import gguf_formats as gf

    if K % 256:
        raise ValueError(f"Q4_K rows hold whole 256-value blocks, not {K} columns")
    b = raw.reshape(N * (K // 256), 144)
    nb = b.shape[0]
    sc, mn = gf._k_scale_min(b[:, 4:16])
    q = gf._fields(b[:, 16:144].reshape(nb, 4, 32), (0, 4), 2, 0x0F).reshape(N, K)
    v = (q.reshape(N, K // 8, 8).to(torch.int64) << (4 * torch.arange(8, device=raw.device))).sum(-1)  # < 2^32
    return {"q": torch.where(v >= 1 << 31, v - (1 << 32), v).to(torch.int32), "sc": sc.reshape(N, K // 32).contiguous(),
            "mn": mn.reshape(N, K // 32).contiguous(),
            "d": b[:, 0:2].contiguous().view(torch.float16).reshape(N, K // 256),
            "dm": b[:, 2:4].contiguous().view(torch.float16).reshape(N, K // 256)}


def repacked_config(N: int, K: int, T: int) -> tuple[int, int, int, int]:
    """(BN, BV, warps, RT) of _q4kr_linear_kernel: BV the largest of 1024 / 512 / 256 dividing K; one row ~4K
    values a step per program, several rows ~8K products (the multi-row kernel's budget);
    _QLINEAR_CFG["repack_cfg"] = (BN, BV, warps) (benchmarks/qlinear_gpu.py's sweep) sets the first three."""
    rt = min(_pow2(T), LINEAR_MAX_RT)
    cfg = _QLINEAR_CFG.get("repack_cfg")
    if cfg is not None:
        return cfg[0], cfg[1], cfg[2], rt
    bv = next(v for v in (1024, 512, 256) if K % v == 0)
    bn = max(1, min(_pow2(N), (4096 if rt == 1 else 8192) // (bv * rt)))
    return bn, bv, 4, rt


def repack_wanted() -> bool:
    """MOESTREAM_QLINEAR_REPACK=1: a GPU's Q4_K dense layers (layers.QuantLinear) repacked at their first decode call
    and read through q4k_repacked_linear (an experiment, off by default until an H100 sweep says it wins)."""
    on = _QLINEAR_CFG.get("repack_on")
    if on is None:
        import os

        on = _QLINEAR_CFG["repack_on"] = os.environ.get("MOESTREAM_QLINEAR_REPACK", "0") == "1"
    return on


def q4k_repacked_dense(packed: dict[str, torch.Tensor], N: int, K: int, dtype: torch.dtype) -> torch.Tensor:
    """The repacked Q4_K matrix as a dense [N, K] tensor of `dtype` (one Triton launch; a prefill's GEMM operand)."""
    w = torch.empty((N, K), dtype=dtype, device=packed["q"].device)
    bv = next(v for v in (1024, 512, 256) if K % v == 0)
    _q4kr_dequant_kernel[(triton.cdiv(N, 4), K // bv)](packed["q"], packed["sc"], packed["mn"], packed["d"],
                                                        packed["dm"], w, N, K, BN=4, BV=bv, num_warps=4)
    return w


def q4k_repacked_linear(x: torch.Tensor, packed: dict[str, torch.Tensor], N: int, K: int) -> torch.Tensor:
    """y [T, N] (x's dtype rules of quant_linear) = x [T, K] @ W.T for a Q4_K matrix in repack_q4k's layout."""
    xs = x.reshape(-1, K).contiguous()
    T = xs.shape[0]
    y = torch.empty((T, N), dtype=_linear_out_dtype(x), device=x.device)
    bf16 = y.dtype == torch.bfloat16
    bn, bv, warps, rt = repacked_config(N, K, T)
    _q4kr_linear_kernel[(triton.cdiv(N, bn), triton.cdiv(T, rt))](
        xs, packed["q"], packed["sc"], packed["mn"], packed["d"], packed["dm"], y.view(torch.int16) if bf16 else y,
        T, N, K, BN=bn, BV=bv, RT=rt, Y_BF16=bf16, num_warps=warps)
    return y.to(x.dtype).reshape(*x.shape[:-1], N)


def _rows_on() -> bool:
    """The multi-row dense kernel is in use (MOESTREAM_QLINEAR_ROWS, read once; default on)."""
    on = _QLINEAR_CFG.get("rows_on")
    if on is None:
        import os

        on = _QLINEAR_CFG["rows_on"] = os.environ.get("MOESTREAM_QLINEAR_ROWS", "1") != "0"
    return on


def linear_rows_config(N: int, K: int, T: int, bs: int, qtype: str | None = None) -> tuple[int, int, int, int]:
    """(BN output rows, BV columns a step, warps, RT activation rows) of the multi-row dense kernel for T rows of K
    columns (bs: the weight's block size, which BV must hold; qtype: its GGUF type): RT = T rounded up to a power of
    two (at most LINEAR_MAX_RT); ~8K products a step per program (BN x BV weight values decoded, times RT rows), 16K
    for Q4_K.
    MOESTREAM_QLINEAR_ROWS_CFG="BN,BV,WARPS" (or benchmarks/qlinear_gpu.py's sweep) sets the first three."""
    rt = min(_pow2(T), LINEAR_MAX_RT)
    if rt == 1:  # one row (a permuted layer's decode GEMV): the pair kernel's constants
        bn, bv, warps = linear_config(N, K, 1) or default_config("down", N, K, 1)
        return bn, max(bv, bs), warps, 1
    cfg = _QLINEAR_CFG.get("rows_cfg", False)
    if cfg is False:
        cfg = _QLINEAR_CFG["rows_cfg"] = launch_triple("MOESTREAM_QLINEAR_ROWS_CFG")
    if cfg is not None:
        return cfg[0], max(cfg[1], bs), cfg[2], rt
    # BV 1024 up to K = 2048, else 512 (and at most K): the H100 sweep of 2026-12-06 (benchmarks/RESULTS.md, batch 4,
    # the Q4_K_M file's shapes) had (2, 1024) best or within 1 % at K = 2048, (4, 512) best at K = 4096 and 512
    bv = max(bs, min(_pow2(K), 1024 if K <= 2048 else 512))
    # Q4_K: twice the rows a program. Two H100 sweeps (2026-12-06, batch 4, K = 2048) timed (4, 1024) at 29.3 us for
    # 8192 x 2048 where (2, 1024) took 37.5, and 4.3 against 4.6 us for 512 x 2048; Q6_K's lm_head was 10 % slower so
    bn = max(1, min(_pow2(N), (16384 if qtype == "Q4_K" else 8192) // (bv * rt)))
    return bn, bv, 4, rt


_LINEAR_FORMATS: dict = {}
_UNIT_PAIRS: dict = {}


def _unit_pairs(T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(src = zeros [T], w = ones [T]) for quant_linear, made once per (T, device): no fill kernels in a
    recorded decode step. Read-only."""
    key = str(device)
    got = _UNIT_PAIRS.get(key)
    if got is None or got[0].shape[0] < T:  # the engine runs a step eagerly before it records one
        n = max(T, 64)
        got = _UNIT_PAIRS[key] = (torch.zeros(n, dtype=torch.long, device=device),
                                  torch.ones(n, dtype=torch.float32, device=device))
    return got[0][:T], got[1][:T]


# ----------------------------------------------------------------------------- Triton kernels
# A program computes BN output rows of one pair: grid (P, cdiv(N, BN)). It streams its rows' bytes
# once, BV logical columns (K values) per loop step, decodes them in registers with the decoders of
# quant/triton_dequant.py and accumulates the dot products with the pair's activation row in fp32.
# A pair with src < 0 returns at once (its output row belongs to another producer). H and I are
# constexpr: a model has two of them, and constant trip counts unroll (and the interpreter of this
# numpy cannot take a runtime loop bound).
_HF_FP8, _HF_NVFP4, _HF_MXFP4 = 0, 1, 2  # KIND
_S_BLOCK, _S_CHANNEL, _S_TENSOR = 0, 1, 2  # SMODE of FP8 scales

if triton is not None:

    @triton.jit
    def _q8_words_dot(w, n, nmask, xrow, K: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr):
        """[BN] fp32: rows n of one expert's Q8_0 matrix at w dot xrow [K], each 34-byte block read as 17 16-bit
        words (its fp16 scale, then 16 words of two int8 codes: low byte code 2i, high byte 2i + 1); the same
        products as the byte decoder, the 32 of a block summed before the scale multiplies them."""
        NB: tl.constexpr = K // 32
        rows = n.to(tl.int64) * (NB * 17)
        w16 = w.to(tl.pointer_type(tl.int16))
        i = tl.arange(0, 16)
        acc = tl.zeros([BN, BV // 32], dtype=tl.float32)
        for k0 in range(0, K, BV):
            b = k0 // 32 + tl.arange(0, BV // 32)
            bm = b < NB
            blk = rows[:, None] + (b * 17)[None, :]  # [BN, BB]: the word of each block's scale
            m = nmask[:, None] & bm[None, :]
            v = tl.load(w16 + blk[:, :, None] + 1 + i[None, None, :], mask=m[:, :, None], other=0).to(tl.int32)
            lo = ((v << 24) >> 24).to(tl.float32)  # the low byte sign-extended: code 2i
            hi = (v >> 8).to(tl.float32)  # the high byte, signed as the word is: code 2i + 1
            col = (b * 32)[:, None] + 2 * i[None, :]
            xe = tl.load(xrow + col, mask=bm[:, None], other=0.0).to(tl.float32)
            xo = tl.load(xrow + col + 1, mask=bm[:, None], other=0.0).to(tl.float32)
            part = tl.sum(lo * xe[None, :, :] + hi * xo[None, :, :], axis=2)
            acc += part * tl.load(w16 + blk, mask=m, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        return tl.sum(acc, axis=1)

    @triton.jit
    def _q8r_dot(w, n, nmask, xrow, K: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr):
        """[BN] fp32: rows n of one expert's Q8_0R matrix at w (each row K / 16 bytes of fp16 block scales, then K
        int8 codes: 16-byte aligned for K a multiple of 256) dot xrow [K]; each block's 32 products summed, then
        times its scale (benchmarks/q8_planar_bench.py measured this read 1.7x the block layout's)."""
        rows = n.to(tl.int64) * (K // 16 + K)
        codes = (w + K // 16).to(tl.pointer_type(tl.int8))
        scales = w.to(tl.pointer_type(tl.float16))
        acc = tl.zeros([BN, BV // 32], dtype=tl.float32)
        for k0 in range(0, K, BV):
            c = k0 + tl.arange(0, BV)
            j = k0 // 32 + tl.arange(0, BV // 32)
            if K % BV == 0:
                cm = nmask[:, None]
                jm = nmask[:, None]
                xv = tl.load(xrow + c).to(tl.float32)
            else:
                cm = nmask[:, None] & (c < K)[None, :]
                jm = nmask[:, None] & (j < K // 32)[None, :]
                xv = tl.load(xrow + c, mask=c < K, other=0.0).to(tl.float32)
            q = tl.load(codes + rows[:, None] + c[None, :], mask=cm, other=0).to(tl.float32)
            part = tl.sum(tl.reshape(q * xv[None, :], [BN, BV // 32, 32]), axis=2)
            sv = tl.load(scales + (rows // 2)[:, None] + j[None, :], mask=jm, other=0.0).to(tl.float32)
            acc += part * sv
        return tl.sum(acc, axis=1)

    @triton.jit
    def _gguf_dot(w, n, nmask, xrow, K: tl.constexpr, lut, QT: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr,
                  NS: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr):
        """[BN] fp32: rows n of one expert's GGUF matrix (rows of K // BS blocks of TS bytes at w) dot xrow [K].
        A step decodes BV // BS whole blocks of each row ([BN, BKB, NS, SS]: one scale per sub-block).
        QT 99 (Q8_WORDS): Q8_0 read as 16-bit words (_q8_words_dot); Q8R: the Q8_0R row layout (_q8r_dot)."""
        if QT == 99:
            out = _q8_words_dot(w, n, nmask, xrow, K, BN, BV)
        elif QT == Q8R:
            out = _q8r_dot(w, n, nmask, xrow, K, BN, BV)
        else:
            out = _gguf_bytes_dot(w, n, nmask, xrow, K, lut, QT, BS, TS, NS, BN, BV)
        return out

    @triton.jit
    def _gguf_bytes_dot(w, n, nmask, xrow, K: tl.constexpr, lut, QT: tl.constexpr, BS: tl.constexpr,
                        TS: tl.constexpr, NS: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr):
        nblk = K // BS
        rowp = w + n.to(tl.int64) * (nblk * TS)
        s = tl.arange(0, NS)[None, None, :, None]
        e = s * (BS // NS) + tl.arange(0, BS // NS)[None, None, None, :]  # value ids within a block
        acc = tl.zeros([BN, BV // BS], dtype=tl.float32)
        for k0 in range(0, K, BV):  # 
            b = k0 // BS + tl.arange(0, BV // BS)
            bm = b < nblk
            p = (rowp[:, None] + b[None, :] * TS)[:, :, None, None]
            m = (nmask[:, None] & bm[None, :])[:, :, None, None]
            v = gguf_decode(p, e, s, m, lut, QT)
            xv = tl.load(xrow + (b * BS)[None, :, None, None] + e, mask=bm[None, :, None, None], other=0.0)
            acc += tl.sum(tl.sum(v * xv.to(tl.float32), axis=3), axis=2)
        return tl.sum(acc, axis=1)

    @triton.jit
    def _hf_dot(w, sc, gsc, n, nmask, xrow, K: tl.constexpr, KIND: tl.constexpr, SMODE: tl.constexpr, RB: tl.constexpr,
                CB: tl.constexpr, GS: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr):
        """[BN] fp32: rows n of one expert's FP8 / NVFP4 / MXFP4 matrix [N, K] dot xrow [K].
        w: its weight bytes (row-major codes: e4m3 one per byte, e2m1 two per byte, low nibble first);
        sc: its scale part (typed pointer); gsc: its fp32 per-expert scale (NVFP4 weight_scale_2).
        A step reads [BN, BV // GS groups, GS columns]; one group shares one scale (GS divides the scale
        block), so a scale is loaded once per group."""
        nn = n.to(tl.int64)[:, None]
        mrow = nmask[:, None]
        g0 = tl.arange(0, BV // GS)[None, :] * GS  # first column of each group within a step
        acc = tl.zeros([BN, BV // GS], dtype=tl.float32)
        for k0 in range(0, K, BV):
            cg = k0 + g0  # [1, NG]
            mg = mrow & (cg < K)
            if KIND == 0:  # e4m3 codes, one byte per column: contiguous (vectorized) loads
                c = cg[:, :, None] + tl.arange(0, GS)[None, None, :]
                # per column: a group may straddle K (partial scale blocks), and a code read past the row
                # could be NaN (0x7F), which times x = 0 is still NaN
                v = _e4m3(_ld(w + nn[:, :, None] * K, c, mg[:, :, None] & (c < K)))
                xv = tl.load(xrow + c, mask=c < K, other=0.0).to(tl.float32)
                part = tl.sum(v * xv, axis=2)
            else:  # e2m1 pairs: load each byte once, dot its low / high nibble with x's even / odd columns
                c2 = cg[:, :, None] // 2 + tl.arange(0, GS // 2)[None, None, :]  # byte ids
                b = _ld(w + nn[:, :, None] * (K // 2), c2, mg[:, :, None] & (2 * c2 < K))
                xe = tl.load(xrow + 2 * c2, mask=2 * c2 < K, other=0.0).to(tl.float32)
                xo = tl.load(xrow + 2 * c2 + 1, mask=2 * c2 < K, other=0.0).to(tl.float32)
                part = tl.sum(_e2m1(b & 0xF) * xe + _e2m1(b >> 4) * xo, axis=2)
            if KIND == 0:
                if SMODE == 0:  # [ceil(N/RB), ceil(K/CB)] block scales
                    sv = tl.load(sc + (nn // RB) * tl.cdiv(K, CB) + cg // CB, mask=mg, other=0.0).to(tl.float32)
                    part = part * sv
            elif KIND == 1:  # e4m3 scale per 16 columns
                part = part * _e4m3(_ld(sc + nn * (K // 16), cg // 16, mg))
            else:  # e8m0 scale per 32 columns
                part = part * _e8m0(_ld(sc + nn * (K // 32), cg // 32, mg))
            acc += part
        out = tl.sum(acc, axis=1)
        if KIND == 0:
            if SMODE == 1:  # one scale per output row
                out = out * tl.load(sc + n, mask=nmask, other=0.0).to(tl.float32)
            elif SMODE == 2:  # one scale per expert
                out = out * tl.load(sc).to(tl.float32)
        elif KIND == 1:
            out = out * tl.load(gsc).to(tl.float32)
        return out

    @triton.jit
    def _silu_mul_store(h, p, n, nmask, g, u, N: tl.constexpr, H_BF16: tl.constexpr):
        _store(h, p.to(tl.int64) * N + n, g / (1.0 + tl.exp(-g)) * u, nmask, H_BF16)

    @triton.jit
    def _gguf_gate_up_pair(x, p, r, gw, g_stride, uw, u_stride, h, lut, H: tl.constexpr, I: tl.constexpr, K_TOP,
                           QG: tl.constexpr, BSG: tl.constexpr, TSG: tl.constexpr, NSG: tl.constexpr,
                           QU: tl.constexpr, BSU: tl.constexpr, TSU: tl.constexpr, NSU: tl.constexpr,
                           BN: tl.constexpr, BV: tl.constexpr, H_BF16: tl.constexpr):
        """h[p, n] for this program's BN rows n of pool row r."""
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = n < I
        xrow = x + (p // K_TOP).to(tl.int64) * H
        g = _gguf_dot(gw + r * g_stride, n, nmask, xrow, H, lut, QG, BSG, TSG, NSG, BN, BV)
        u = _gguf_dot(uw + r * u_stride, n, nmask, xrow, H, lut, QU, BSU, TSU, NSU, BN, BV)
        _silu_mul_store(h, p, n, nmask, g, u, I, H_BF16)

    @triton.jit
    def _gguf_down_pair(h, tw, p, r, dw, d_stride, y, lut, H: tl.constexpr, I: tl.constexpr,
                        QD: tl.constexpr, BSD: tl.constexpr, TSD: tl.constexpr, NSD: tl.constexpr,
                        BN: tl.constexpr, BV: tl.constexpr, Y_BF16: tl.constexpr):
        """y[p, n] for this program's BN rows n of pool row r."""
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = n < H
        acc = _gguf_dot(dw + r * d_stride, n, nmask, h + p.to(tl.int64) * I, I, lut, QD, BSD, TSD, NSD, BN, BV)
        _store(y, p.to(tl.int64) * H + n, acc * tl.load(tw + p).to(tl.float32), nmask, Y_BF16)

    @triton.jit
    def _gguf_gate_up_kernel(x, src, gw, g_stride, uw, u_stride, h, lut, H: tl.constexpr, I: tl.constexpr, K_TOP,
                             QG: tl.constexpr, BSG: tl.constexpr, TSG: tl.constexpr, NSG: tl.constexpr,
                             QU: tl.constexpr, BSU: tl.constexpr, TSU: tl.constexpr, NSU: tl.constexpr,
                             BN: tl.constexpr, BV: tl.constexpr, H_BF16: tl.constexpr):
        p = tl.program_id(0)
        r = tl.load(src + p)
        if r >= 0:
            _gguf_gate_up_pair(x, p, r, gw, g_stride, uw, u_stride, h, lut, H, I, K_TOP, QG, BSG, TSG, NSG,
                               QU, BSU, TSU, NSU, BN, BV, H_BF16)

    @triton.jit
    def _gguf_down_kernel(h, tw, src, dw, d_stride, y, lut, H: tl.constexpr, I: tl.constexpr,
                          QD: tl.constexpr, BSD: tl.constexpr, TSD: tl.constexpr, NSD: tl.constexpr,
                          BN: tl.constexpr, BV: tl.constexpr, Y_BF16: tl.constexpr):
        p = tl.program_id(0)
        r = tl.load(src + p)
        if r >= 0:
            _gguf_down_pair(h, tw, p, r, dw, d_stride, y, lut, H, I, QD, BSD, TSD, NSD, BN, BV, Y_BF16)

    # ---- the same two kernels fetching the call's missed experts themselves (fetch_in_pairs): a program whose pair
    # reads a row being staged (rows[i] for i < count) first copies ITS rows of that expert's matrices from the pinned
    # host bank (words of the widest size the layout allows) into the pool row, then computes them from there, so
    # the hits' programs compute while the misses' cross PCIe. Every row of a matrix belongs to exactly one program
    # of a pair, so the pool row is filled whole once the call ends, as the copy kernel would have left it.
    @triton.jit
    def _staged_expert(r, stg_e, stg_r, stg_n, NSTG: tl.constexpr):
        """The host expert staged into pool row r by this call, or -1."""
        i = tl.arange(0, NSTG)
        m = i < tl.load(stg_n)
        rr = tl.load(stg_r + i, mask=m, other=-1)
        ee = tl.load(stg_e + i, mask=m, other=-1)
        return tl.max(tl.where(rr == r, ee, -1), axis=0)

    @triton.jit
    def _copy_rows(hsrc, pdst, n0, N, RW: tl.constexpr, BN: tl.constexpr, CW: tl.constexpr, RBP: tl.constexpr,
                   NR: tl.constexpr):
        """The stored rows of one array that hold matrix rows [n0, min(n0 + BN, N)) — with RBP matrix rows to a
        stored row (1: row-wise codes and scales; an FP8 block scale's 128; N or more: a per-tensor value, its one
        stored row) of RW words each, at most NR of them (BN where RBP is 1) — copied from a host row to the same
        words of a pool row."""
        start = (n0 // RBP) * RW
        end = ((tl.minimum(n0 + BN, N) - 1) // RBP + 1) * RW
        for off in range(0, (BN if RBP == 1 else NR) * RW, CW):
            o = start + off + tl.arange(0, CW)
            m = o < end
            tl.store(pdst + o, tl.load(hsrc + o, mask=m), mask=m)

    @triton.jit
    def _gguf_gate_up_fetch_kernel(x, src, gw, g_stride, uw, u_stride, h, lut, H: tl.constexpr, I: tl.constexpr,
                                   K_TOP, hg, hg_stride, pg, pg_stride, hu, hu_stride, pu, pu_stride,
                                   stg_e, stg_r, stg_n,
                                   QG: tl.constexpr, BSG: tl.constexpr, TSG: tl.constexpr, NSG: tl.constexpr,
                                   QU: tl.constexpr, BSU: tl.constexpr, TSU: tl.constexpr, NSU: tl.constexpr,
                                   RWG: tl.constexpr, RWU: tl.constexpr, CW: tl.constexpr, NSTG: tl.constexpr,
                                   BN: tl.constexpr, BV: tl.constexpr, H_BF16: tl.constexpr):
        p = tl.program_id(0)
        r = tl.load(src + p)
        if r >= 0:
            e = _staged_expert(r, stg_e, stg_r, stg_n, NSTG)
            if e >= 0:
                n0 = tl.program_id(1) * BN
                _copy_rows(hg + e * hg_stride, pg + r * pg_stride, n0, I, RWG, BN, CW, 1, BN)
                _copy_rows(hu + e * hu_stride, pu + r * pu_stride, n0, I, RWU, BN, CW, 1, BN)
                tl.debug_barrier()  # this program's copies are visible to all of its threads
            _gguf_gate_up_pair(x, p, r, gw, g_stride, uw, u_stride, h, lut, H, I, K_TOP, QG, BSG, TSG, NSG,
                               QU, BSU, TSU, NSU, BN, BV, H_BF16)

    @triton.jit
    def _gguf_down_fetch_kernel(h, tw, src, dw, d_stride, y, lut, H: tl.constexpr, I: tl.constexpr,
                                hd, hd_stride, pd, pd_stride, stg_e, stg_r, stg_n,
                                QD: tl.constexpr, BSD: tl.constexpr, TSD: tl.constexpr, NSD: tl.constexpr,
                                RWD: tl.constexpr, CW: tl.constexpr, NSTG: tl.constexpr,
                                BN: tl.constexpr, BV: tl.constexpr, Y_BF16: tl.constexpr):
        p = tl.program_id(0)
        r = tl.load(src + p)
        if r >= 0:
            e = _staged_expert(r, stg_e, stg_r, stg_n, NSTG)
            if e >= 0:
                _copy_rows(hd + e * hd_stride, pd + r * pd_stride, tl.program_id(1) * BN, H, RWD, BN, CW, 1, BN)
                tl.debug_barrier()
            _gguf_down_pair(h, tw, p, r, dw, d_stride, y, lut, H, I, QD, BSD, TSD, NSD, BN, BV, Y_BF16)

    @triton.jit
    def _hf_fetch_parts(hw, hw_s, pw, pw_s, hs, hs_s, ps, ps_s, hg, hg_s, pg, pg_s, e, r, n0, N,
                        RW_W: tl.constexpr, RBP_S: tl.constexpr, RW_S: tl.constexpr, NR_S: tl.constexpr,
                        RW_G: tl.constexpr, NPARTS: tl.constexpr, BN: tl.constexpr, CW: tl.constexpr):
        """One projection's parts (codes, scales, NVFP4's global scale) of host expert e into pool row r, for this
        program's matrix rows."""
        _copy_rows(hw + e * hw_s, pw + r * pw_s, n0, N, RW_W, BN, CW, 1, BN)
        _copy_rows(hs + e * hs_s, ps + r * ps_s, n0, N, RW_S, BN, CW, RBP_S, NR_S)
        if NPARTS == 3:
            _copy_rows(hg + e * hg_s, pg + r * pg_s, n0, N, RW_G, BN, CW, 1 << 30, 1)

    @triton.jit
    def _hf_gate_up_fetch_kernel(x, src, gw, gw_stride, gs, gs_stride, gg, gg_stride,
                                 uw, uw_stride, us, us_stride, ug, ug_stride, h, H: tl.constexpr, I: tl.constexpr,
                                 K_TOP, hgw, hgw_s, pgw, pgw_s, hgs, hgs_s, pgs, pgs_s, hgg, hgg_s, pgg, pgg_s,
                                 huw, huw_s, puw, puw_s, hus, hus_s, pus, pus_s, hug, hug_s, pug, pug_s,
                                 stg_e, stg_r, stg_n,
                                 KIND: tl.constexpr, SMODE: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr,
                                 GS: tl.constexpr, RW_W: tl.constexpr, RBP_S: tl.constexpr, RW_S: tl.constexpr,
                                 NR_S: tl.constexpr, RW_G: tl.constexpr, NPARTS: tl.constexpr, CW: tl.constexpr,
                                 NSTG: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr, H_BF16: tl.constexpr):
        p = tl.program_id(0)
        r = tl.load(src + p)
        if r >= 0:
            e = _staged_expert(r, stg_e, stg_r, stg_n, NSTG)
            if e >= 0:
                n0 = tl.program_id(1) * BN
                _hf_fetch_parts(hgw, hgw_s, pgw, pgw_s, hgs, hgs_s, pgs, pgs_s, hgg, hgg_s, pgg, pgg_s, e, r, n0, I,
                                RW_W, RBP_S, RW_S, NR_S, RW_G, NPARTS, BN, CW)
                _hf_fetch_parts(huw, huw_s, puw, puw_s, hus, hus_s, pus, pus_s, hug, hug_s, pug, pug_s, e, r, n0, I,
                                RW_W, RBP_S, RW_S, NR_S, RW_G, NPARTS, BN, CW)
                tl.debug_barrier()
            _hf_gate_up_pair(x, p, r.to(tl.int64), gw, gw_stride, gs, gs_stride, gg, gg_stride, uw, uw_stride, us,
                             us_stride, ug, ug_stride, h, H, I, K_TOP, KIND, SMODE, RB, CB, GS, BN, BV, H_BF16)

    @triton.jit
    def _hf_down_fetch_kernel(h, tw, src, dw, dw_stride, ds, ds_stride, dg, dg_stride, y, H: tl.constexpr,
                              I: tl.constexpr, hdw, hdw_s, pdw, pdw_s, hds, hds_s, pds, pds_s, hdg, hdg_s, pdg, pdg_s,
                              stg_e, stg_r, stg_n,
                              KIND: tl.constexpr, SMODE: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr,
                              GS: tl.constexpr, RW_W: tl.constexpr, RBP_S: tl.constexpr, RW_S: tl.constexpr,
                              NR_S: tl.constexpr, RW_G: tl.constexpr, NPARTS: tl.constexpr, CW: tl.constexpr,
                              NSTG: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr, Y_BF16: tl.constexpr):
        p = tl.program_id(0)
        r = tl.load(src + p)
        if r >= 0:
            e = _staged_expert(r, stg_e, stg_r, stg_n, NSTG)
            if e >= 0:
                _hf_fetch_parts(hdw, hdw_s, pdw, pdw_s, hds, hds_s, pds, pds_s, hdg, hdg_s, pdg, pdg_s, e, r,
                                tl.program_id(1) * BN, H, RW_W, RBP_S, RW_S, NR_S, RW_G, NPARTS, BN, CW)
                tl.debug_barrier()
            _hf_down_pair(h, tw, p, r.to(tl.int64), dw, dw_stride, ds, ds_stride, dg, dg_stride, y, H, I, KIND, SMODE,
                          RB, CB, GS, BN, BV, Y_BF16)

    @triton.jit
    def _hf_gate_up_pair(x, p, r, gw, gw_stride, gs, gs_stride, gg, gg_stride, uw, uw_stride, us, us_stride, ug,
                         ug_stride, h, H: tl.constexpr, I: tl.constexpr, K_TOP, KIND: tl.constexpr,
                         SMODE: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr, GS: tl.constexpr, BN: tl.constexpr,
                         BV: tl.constexpr, H_BF16: tl.constexpr):
        """h[p, n] for this program's BN rows n of pool row r (int64)."""
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = n < I
        xrow = x + (p // K_TOP).to(tl.int64) * H
        g = _hf_dot(gw + r * gw_stride, gs + r * gs_stride, gg + r * gg_stride, n, nmask, xrow, H,
                    KIND, SMODE, RB, CB, GS, BN, BV)
        u = _hf_dot(uw + r * uw_stride, us + r * us_stride, ug + r * ug_stride, n, nmask, xrow, H,
                    KIND, SMODE, RB, CB, GS, BN, BV)
        _silu_mul_store(h, p, n, nmask, g, u, I, H_BF16)

    @triton.jit
    def _hf_down_pair(h, tw, p, r, dw, dw_stride, ds, ds_stride, dg, dg_stride, y, H: tl.constexpr, I: tl.constexpr,
                      KIND: tl.constexpr, SMODE: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr, GS: tl.constexpr,
                      BN: tl.constexpr, BV: tl.constexpr, Y_BF16: tl.constexpr):
        """y[p, n] for this program's BN rows n of pool row r (int64)."""
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = n < H
        acc = _hf_dot(dw + r * dw_stride, ds + r * ds_stride, dg + r * dg_stride, n, nmask,
                      h + p.to(tl.int64) * I, I, KIND, SMODE, RB, CB, GS, BN, BV)
        _store(y, p.to(tl.int64) * H + n, acc * tl.load(tw + p).to(tl.float32), nmask, Y_BF16)

    @triton.jit
    def _hf_gate_up_kernel(x, src, gw, gw_stride, gs, gs_stride, gg, gg_stride,
                           uw, uw_stride, us, us_stride, ug, ug_stride, h, H: tl.constexpr, I: tl.constexpr, K_TOP,
                           KIND: tl.constexpr, SMODE: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr,
                           GS: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr, H_BF16: tl.constexpr):
        p = tl.program_id(0)
        r = tl.load(src + p)
        if r >= 0:
            _hf_gate_up_pair(x, p, r.to(tl.int64), gw, gw_stride, gs, gs_stride, gg, gg_stride, uw, uw_stride, us,
                             us_stride, ug, ug_stride, h, H, I, K_TOP, KIND, SMODE, RB, CB, GS, BN, BV, H_BF16)

    @triton.jit
    def _hf_down_kernel(h, tw, src, dw, dw_stride, ds, ds_stride, dg, dg_stride, y, H: tl.constexpr, I: tl.constexpr,
                        KIND: tl.constexpr, SMODE: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr,
                        GS: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr, Y_BF16: tl.constexpr):
        p = tl.program_id(0)
        r = tl.load(src + p)
        if r >= 0:
            _hf_down_pair(h, tw, p, r.to(tl.int64), dw, dw_stride, ds, ds_stride, dg, dg_stride, y, H, I, KIND, SMODE,
                          RB, CB, GS, BN, BV, Y_BF16)


    # ---- dense layers of several rows (quant_linear / hf_quant_linear at T > 1): a program computes BN output
    # columns for RT activation rows, each weight tile decoded once and dotted with every row ([RT, BN, ...]
    # products); grid (cdiv(N, BN), cdiv(T, RT)). Same decoders and fp32 accumulation as the pair kernels.
    @triton.jit
    def _gguf_rows_dot(w, n, nmask, x, t, tmask, K: tl.constexpr, lut, QT: tl.constexpr, BS: tl.constexpr,
                       TS: tl.constexpr, NS: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr, RT: tl.constexpr,
                       perm, PERM: tl.constexpr):
        """[RT, BN] fp32: rows n of a GGUF matrix (rows of K // BS blocks of TS bytes at w) dot x rows t ([T, K]);
        PERM: stored column c reads x's column perm[c]."""
        nblk = K // BS
        rowp = w + n.to(tl.int64) * (nblk * TS)
        s = tl.arange(0, NS)[None, None, :, None]
        e = s * (BS // NS) + tl.arange(0, BS // NS)[None, None, None, :]
        xr = x + (t.to(tl.int64) * K)[:, None, None, None, None]
        tm = tmask[:, None, None, None, None]
        acc = tl.zeros([RT, BN, BV // BS], dtype=tl.float32)
        for k0 in range(0, K, BV):
            b = k0 // BS + tl.arange(0, BV // BS)
            bm = b < nblk
            p = (rowp[:, None] + b[None, :] * TS)[:, :, None, None]
            m = (nmask[:, None] & bm[None, :])[:, :, None, None]
            v = gguf_decode(p, e, s, m, lut, QT)  # [BN, BKB, NS, SS], decoded once
            cols = (b * BS)[None, :, None, None] + e
            if PERM:
                cols = tl.load(perm + cols, mask=bm[None, :, None, None], other=0)
            xo = cols[None, :, :, :, :]
            xv = tl.load(xr + xo, mask=tm & bm[None, None, :, None, None], other=0.0).to(tl.float32)
            acc += tl.sum(tl.sum(v[None, :, :, :, :] * xv, axis=4), axis=3)
        return tl.sum(acc, axis=2)

    @triton.jit
    def _gguf_linear_kernel(x, dw, y, lut, perm, T, N: tl.constexpr, K: tl.constexpr, QD: tl.constexpr,
                            BSD: tl.constexpr, TSD: tl.constexpr, NSD: tl.constexpr, BN: tl.constexpr,
                            BV: tl.constexpr, RT: tl.constexpr, Y_BF16: tl.constexpr, PERM: tl.constexpr):
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nmask = n < N
        t = tl.program_id(1) * RT + tl.arange(0, RT)
        tmask = t < T
        acc = _gguf_rows_dot(dw, n, nmask, x, t, tmask, K, lut, QD, BSD, TSD, NSD, BN, BV, RT, perm, PERM)
        _store(y, t.to(tl.int64)[:, None] * N + n[None, :], acc, tmask[:, None] & nmask[None, :], Y_BF16)

    @triton.jit
    def _q4k_words_dot(w, n, nmask, xrow, perm, K: tl.constexpr, BN: tl.constexpr, BKB: tl.constexpr,
                       PERM: tl.constexpr):
        """[BN] fp32: rows n of a Q4_K matrix (K // 256 blocks of 144 bytes a row) dot xrow [K], the 4-bit codes read
        as 32-bit words (one load per 4 bytes, 8 values) instead of a byte load per value; each block's 8 scales and
        mins once. Tile [BN, BKB blocks, 8 sub-blocks, 8 words, 4 bytes]: sub-block s is the low (s even) or high
        nibble of the 32 bytes of group s // 2, so its value 4 w + b is byte b of word w, the block's value
        32 s + 4 w + b. PERM: stored column c reads x's column perm[c]."""
        nblk = K // 256
        rowp = w + n.to(tl.int64) * (nblk * 144)
        s = tl.arange(0, 8)[None, None, :, None, None]
        wi = tl.arange(0, 8)[None, None, None, :, None]
        bi = tl.arange(0, 4)[None, None, None, None, :]
        s3 = tl.arange(0, 8)[None, None, :]
        acc = tl.zeros([BN, BKB], dtype=tl.float32)
        for k0 in range(0, K, BKB * 256):
            b = k0 // 256 + tl.arange(0, BKB)
            bm = b < nblk
            p = rowp[:, None] + b[None, :] * 144
            m = nmask[:, None] & bm[None, :]
            p3, m3 = p[:, :, None], m[:, :, None]
            a = _ld(p3, 4 + s3 % 4, m3)
            mm = _ld(p3, 8 + s3 % 4, m3)
            md = _ld(p3, 12 + s3 % 4, m3)
            sc = tl.where(s3 < 4, a & 0x3F, (md & 0xF) | ((a >> 2) & 0x30))
            mn = tl.where(s3 < 4, mm & 0x3F, (md >> 4) | ((mm >> 2) & 0x30))
            dl = (_f16(p, 0, m)[:, :, None] * sc.to(tl.float32))[:, :, :, None, None]
            ml = (_f16(p, 2, m)[:, :, None] * mn.to(tl.float32))[:, :, :, None, None]
            wp = (p[:, :, None, None, None] + 16 + (s // 2) * 32 + wi * 4).to(tl.pointer_type(tl.int32))
            word = tl.load(wp, mask=m[:, :, None, None, None], other=0)
            v = dl * ((word >> ((s % 2) * 4 + bi * 8)) & 0xF).to(tl.float32) - ml
            e = (b * 256)[None, :, None, None, None] + s * 32 + wi * 4 + bi
            em = bm[None, :, None, None, None]
            if PERM:
                e = tl.load(perm + e, mask=em, other=0)
            xv = tl.load(xrow + e, mask=em, other=0.0).to(tl.float32)
            acc += tl.sum(tl.sum(tl.sum(v * xv, axis=4), axis=3), axis=2)
        return tl.sum(acc, axis=1)

    @triton.jit
    def _q4k_linear_words_kernel(x, dw, y, perm, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
                                 BKB: tl.constexpr, Y_BF16: tl.constexpr, PERM: tl.constexpr):
        """One row of a Q4_K dense layer through _q4k_words_dot (MOESTREAM_QLINEAR_WORDS=1, an experiment)."""
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nmask = n < N
        _store(y, n, _q4k_words_dot(dw, n, nmask, x, perm, K, BN, BKB, PERM), nmask, Y_BF16)

    @triton.jit
    def _q4kr_tile(qw, sc, mn, d, dm, nn, nmask, k0, K: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr):
        """[BN, BV] fp32: rows nn ([BN, 1] int64), columns k0.. of a repacked Q4_K matrix (repack_q4k): [BN, BV / 8]
        code words and x-free decode — each nibble a float by its bits (2^23 + q, minus 2^23: exact, no int-to-float
        conversion), one scale and min per 32 columns."""
        wd = tl.load(qw + nn * (K // 8) + (k0 // 8 + tl.arange(0, BV // 8))[None, :], mask=nmask[:, None], other=0)
        nib = (wd[:, :, None] >> (4 * tl.arange(0, 8))[None, None, :]) & 0xF  # [BN, BV / 8, 8]
        q = tl.reshape((nib | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0, [BN, BV // 32, 32])
        sb = (k0 // 32 + tl.arange(0, BV // 32))[None, :]
        scv = tl.load(sc + nn * (K // 32) + sb, mask=nmask[:, None], other=0).to(tl.float32)  # [BN, BV / 32]
        mnv = tl.load(mn + nn * (K // 32) + sb, mask=nmask[:, None], other=0).to(tl.float32)
        db = (k0 // 256 + tl.arange(0, BV // 256))[None, :]
        dv = tl.load(d + nn * (K // 256) + db, mask=nmask[:, None], other=0.0).to(tl.float32)  # [BN, BV / 256]
        dmv = tl.load(dm + nn * (K // 256) + db, mask=nmask[:, None], other=0.0).to(tl.float32)
        dl = tl.reshape(tl.reshape(scv, [BN, BV // 256, 8]) * dv[:, :, None], [BN, BV // 32])
        ml = tl.reshape(tl.reshape(mnv, [BN, BV // 256, 8]) * dmv[:, :, None], [BN, BV // 32])
        return tl.reshape(q * dl[:, :, None] - ml[:, :, None], [BN, BV])

    @triton.jit
    def _q4kr_linear_kernel(x, qw, sc, mn, d, dm, y, T, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
                            BV: tl.constexpr, RT: tl.constexpr, Y_BF16: tl.constexpr):
        """T rows of a Q4_K dense layer repacked (repack_q4k; MOESTREAM_QLINEAR_REPACK=1, an experiment timed by
        benchmarks/qlinear_gpu.py): the codes as int32 words of 8 columns (column c of a word at bits 4c..4c+3), each
        sub-block's six-bit scale and min a byte of their own, the fp16 d and dmin per 256 columns. A step decodes a
        [BN, BV] tile (_q4kr_tile: 16-byte vector loads, no per-value index arithmetic, no six-bit unpacking), loads
        x's [RT, BV] contiguously and accumulates products elementwise; one reduction at the end.
        grid (cdiv(N, BN), cdiv(T, RT)); BV divides K, BV >= 256."""
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nmask = n < N
        nn = n.to(tl.int64)[:, None]
        t = tl.program_id(1) * RT + tl.arange(0, RT)
        tmask = t < T
        acc = tl.zeros([RT, BN, BV], dtype=tl.float32)
        for k0 in range(0, K, BV):
            w = _q4kr_tile(qw, sc, mn, d, dm, nn, nmask, k0, K, BN, BV)
            xv = tl.load(x + t.to(tl.int64)[:, None] * K + (k0 + tl.arange(0, BV))[None, :], mask=tmask[:, None],
                         other=0.0).to(tl.float32)  # [RT, BV]
            acc += w[None, :, :] * xv[:, None, :]
        _store(y, t.to(tl.int64)[:, None] * N + n[None, :], tl.sum(acc, axis=2), tmask[:, None] & nmask[None, :],
               Y_BF16)

    @triton.jit
    def _q4kr_dequant_kernel(qw, sc, mn, d, dm, w, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
                             BV: tl.constexpr):
        """The repacked Q4_K matrix as 16-bit rows w [N, K] (a prefill's GEMM operand): the GEMV's decode, stored."""
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nmask = n < N
        nn = n.to(tl.int64)[:, None]
        k0 = tl.program_id(1) * BV
        v = _q4kr_tile(qw, sc, mn, d, dm, nn, nmask, k0, K, BN, BV)
        tl.store(w + nn * K + (k0 + tl.arange(0, BV))[None, :], v.to(w.dtype.element_ty), mask=nmask[:, None])

    @triton.jit
    def _gguf_linear_mma_kernel(x, dw, y, lut, perm, T, N: tl.constexpr, K: tl.constexpr, QD: tl.constexpr,
                                BSD: tl.constexpr, TSD: tl.constexpr, NSD: tl.constexpr, BN: tl.constexpr,
                                BV: tl.constexpr, Y_BF16: tl.constexpr, PERM: tl.constexpr,
                                DOT_T: tl.constexpr = tl.bfloat16):
        """The multi-row dense GEMV with a tensor-core dot (MOESTREAM_QLINEAR_MMA=1, an experiment): a program decodes
        a [BN, BV] weight tile once, rounds it to bf16 and multiplies it with 16 activation rows (T <= 16, the rest
        masked) by tl.dot, fp32 accumulation. grid (cdiv(N, BN), cdiv(T, 16)); BN >= 16, BV >= 16. DOT_T float32: the
        same products unrounded (the tests under the interpreter, whose bf16 dot is not exact numpy)."""
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nmask = n < N
        t = tl.program_id(1) * 16 + tl.arange(0, 16)
        tmask = t < T
        nblk = K // BSD
        rowp = dw + n.to(tl.int64) * (nblk * TSD)
        s = tl.arange(0, NSD)[None, None, :, None]
        e = s * (BSD // NSD) + tl.arange(0, BSD // NSD)[None, None, None, :]
        acc = tl.zeros([16, BN], dtype=tl.float32)
        for k0 in range(0, K, BV):
            b = k0 // BSD + tl.arange(0, BV // BSD)
            bm = b < nblk
            p = (rowp[:, None] + b[None, :] * TSD)[:, :, None, None]
            m = (nmask[:, None] & bm[None, :])[:, :, None, None]
            v = tl.reshape(gguf_decode(p, e, s, m, lut, QD), [BN, BV]).to(DOT_T)
            cols = tl.reshape((b * BSD)[None, :, None, None] + e, [BV])
            cm = tl.reshape((bm[None, :, None, None] & (e >= 0)), [BV])
            if PERM:
                cols = tl.load(perm + cols, mask=cm, other=0)
            xv = tl.load(x + (t.to(tl.int64) * K)[:, None] + cols[None, :], mask=tmask[:, None] & cm[None, :],
                         other=0.0).to(DOT_T)
            acc = tl.dot(xv, tl.trans(v), acc)
        _store(y, t.to(tl.int64)[:, None] * N + n[None, :], acc, tmask[:, None] & nmask[None, :], Y_BF16)

    @triton.jit
    def _hf_rows_dot(w, sc, gsc, n, nmask, x, t, tmask, K: tl.constexpr, KIND: tl.constexpr, SMODE: tl.constexpr,
                     RB: tl.constexpr, CB: tl.constexpr, GS: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr,
                     RT: tl.constexpr):
        """[RT, BN] fp32: _hf_dot's rows n of an FP8 / NVFP4 / MXFP4 matrix [N, K] dot x rows t ([T, K]), each group
        of codes and its scale decoded once for the RT rows."""
        nn = n.to(tl.int64)[:, None]
        mrow = nmask[:, None]
        g0 = tl.arange(0, BV // GS)[None, :] * GS
        xr = x + (t.to(tl.int64) * K)[:, None, None, None]
        tm = tmask[:, None, None, None]
        acc = tl.zeros([RT, BN, BV // GS], dtype=tl.float32)
        for k0 in range(0, K, BV):
            cg = k0 + g0
            mg = mrow & (cg < K)
            if KIND == 0:
                c = cg[:, :, None] + tl.arange(0, GS)[None, None, :]
                v = _e4m3(_ld(w + nn[:, :, None] * K, c, mg[:, :, None] & (c < K)))
                xv = tl.load(xr + c[None, :, :, :], mask=tm & (c < K)[None, :, :, :], other=0.0).to(tl.float32)
                part = tl.sum(v[None, :, :, :] * xv, axis=3)
            else:
                c2 = cg[:, :, None] // 2 + tl.arange(0, GS // 2)[None, None, :]
                b = _ld(w + nn[:, :, None] * (K // 2), c2, mg[:, :, None] & (2 * c2 < K))
                cm = tm & (2 * c2 < K)[None, :, :, :]
                xe = tl.load(xr + 2 * c2[None, :, :, :], mask=cm, other=0.0).to(tl.float32)
                xo = tl.load(xr + 2 * c2[None, :, :, :] + 1, mask=cm, other=0.0).to(tl.float32)
                part = tl.sum(_e2m1(b & 0xF)[None, :, :, :] * xe + _e2m1(b >> 4)[None, :, :, :] * xo, axis=3)
            if KIND == 0:
                if SMODE == 0:
                    sv = tl.load(sc + (nn // RB) * tl.cdiv(K, CB) + cg // CB, mask=mg, other=0.0).to(tl.float32)
                    part = part * sv[None, :, :]
            elif KIND == 1:
                part = part * _e4m3(_ld(sc + nn * (K // 16), cg // 16, mg))[None, :, :]
            else:
                part = part * _e8m0(_ld(sc + nn * (K // 32), cg // 32, mg))[None, :, :]
            acc += part
        out = tl.sum(acc, axis=2)
        if KIND == 0:
            if SMODE == 1:
                out = out * tl.load(sc + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
            elif SMODE == 2:
                out = out * tl.load(sc).to(tl.float32)
        elif KIND == 1:
            out = out * tl.load(gsc).to(tl.float32)
        return out

    @triton.jit
    def _hf_linear_kernel(x, dw, ds, dg, y, T, N: tl.constexpr, K: tl.constexpr, KIND: tl.constexpr,
                          SMODE: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr, GS: tl.constexpr,
                          BN: tl.constexpr, BV: tl.constexpr, RT: tl.constexpr, Y_BF16: tl.constexpr):
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nmask = n < N
        t = tl.program_id(1) * RT + tl.arange(0, RT)
        tmask = t < T
        acc = _hf_rows_dot(dw, ds, dg, n, nmask, x, t, tmask, K, KIND, SMODE, RB, CB, GS, BN, BV, RT)
        _store(y, t.to(tl.int64)[:, None] * N + n[None, :], acc, tmask[:, None] & nmask[None, :], Y_BF16)


def _launch_linear_rows(pool, fmt, xs: torch.Tensor, y: torch.Tensor, N: int, K: int,
                        perm: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, N] = xs [T, K] @ W.T through the multi-row dense kernel (pool: the weight's "down" parts, one row);
    perm (GGUF only): xs's columns read in the stored order."""
    T = xs.shape[0]
    bf16 = y.dtype == torch.bfloat16
    out_arg = y.view(torch.int16) if bf16 else y
    if isinstance(fmt, GGUFExpertFormat):
        qd, bsd, tsd, nsd = _gguf_spec(fmt.quant("down"))
        if T > 1 and _mma_on():  # the tensor-core experiment (bf16 weights; T <= 16 a program)
            bn, bv = 16, max(bsd, 64)
            _gguf_linear_mma_kernel[(triton.cdiv(N, bn), triton.cdiv(T, 16))](
                xs, pool["down"], out_arg, td.lut_table(xs.device), xs if perm is None else perm, T, N, K, QD=qd,
                BSD=bsd, TSD=tsd, NSD=nsd, BN=bn, BV=bv, Y_BF16=bf16, PERM=perm is not None,
                DOT_T=tl.float32 if _QLINEAR_CFG.get("mma_fp32") else tl.bfloat16, num_warps=4)
            return y
        bn, bv, warps, rt = linear_rows_config(N, K, T, bsd, fmt.quant("down").type_name)
        _gguf_linear_kernel[(triton.cdiv(N, bn), triton.cdiv(T, rt))](
            xs, pool["down"], out_arg, td.lut_table(xs.device), xs if perm is None else perm, T, N, K, QD=qd, BSD=bsd,
            TSD=tsd, NSD=nsd, BN=bn, BV=bv, RT=rt, Y_BF16=bf16, PERM=perm is not None, num_warps=warps)
        return y
    consts = _hf_consts(fmt)
    bn, bv, warps, rt = linear_rows_config(N, K, T, consts["GS"])
    dw, _, ds, _, dg, _ = _hf_parts(pool, fmt, "down", xs.device)
    _hf_linear_kernel[(triton.cdiv(N, bn), triton.cdiv(T, rt))](
        xs, dw, ds, dg, out_arg, T, N, K, **consts, BN=bn, BV=bv, RT=rt, Y_BF16=bf16, num_warps=warps)
    return y


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def default_config(stage: str, N: int, K: int, P: int) -> tuple[int, int, int]:
    """(BN rows, BV columns per step, warps) of one launch: ~4K values in flight per program (about one
    16-byte load per thread and array at 4 warps), and BN small enough that P * N / BN programs fill
    the GPU several times over at batch 1 (P = 8). Fixed constants, no autotuning: nothing to run
    before a CUDA graph is captured, and the same choice under the interpreter."""
    bv = min(1024, max(256, _pow2(K)))
    bn = max(1, min(_pow2(N), 4096 // bv))
    return bn, bv, 4


Q8_WORDS = 99  # the pair kernels' kernel id for Q8_0 read as 16-bit words (_gguf_dot; env.q8_words)


def _gguf_spec(q) -> tuple[int, int, int, int]:
    """Kernel constants of a GGUF type: (QT, block values, block bytes, sub-blocks with their own scale)."""
    return td._GGUF_IDS[q.type_name], q.block_size, q.type_size, td._GGUF_NS.get(q.type_name, 1)


def _pair_spec(q) -> tuple[int, int, int, int]:
    """_gguf_spec for the pair kernels: Q8_0 as Q8_WORDS where env.q8_words asks for it."""
    from ..env import q8_words

    spec = _gguf_spec(q)
    return (Q8_WORDS, *spec[1:]) if spec[0] == td._GGUF_IDS["Q8_0"] and q8_words() else spec


def _hf_parts(pool: dict, fmt, proj: str, dev) -> tuple:
    """(weight, scale, global scale) pool tensors of one projection as typed [rows, elems] views with their
    row strides; an absent part is a dummy (never read)."""
    from ..quant.fp_formats import NVFP4Format

    dtypes = dict(fmt.parts)
    names = [p.name for p in fmt.qfmt.parts]
    out = []
    for name in (names[0], names[1], names[2] if isinstance(fmt.qfmt, NVFP4Format) else None):
        if name is None:
            out += [out[0], 0]
            continue
        t, dt = pool[f"{proj}.{name}"], dtypes[f"{proj}.{name}"]
        if dt.itemsize > 1:
            t = t.view(dt)  # fp32 / bf16 scales: the kernel loads them typed; 1-byte codes stay uint8
        out += [t, t.stride(0)]
    return tuple(out)


def _hf_consts(fmt) -> dict:
    """KIND / SMODE / scale block (RB rows x CB columns) / group size GS of an HF format."""
    from ..quant.fp_formats import FP8Format, NVFP4Format

    q = fmt.qfmt
    if isinstance(q, FP8Format):
        smode = {"block": _S_BLOCK, "channel": _S_CHANNEL, "tensor": _S_TENSOR}[q.mode]
        rb, cb = q.block if q.mode == "block" else (1, 1)
        gs = (cb & -cb) if q.mode == "block" else 32  # a power of two dividing the scale block
        return dict(KIND=_HF_FP8, SMODE=smode, RB=rb, CB=cb, GS=min(gs, 256))
    if isinstance(q, NVFP4Format):
        return dict(KIND=_HF_NVFP4, SMODE=0, RB=1, CB=16, GS=16)
    return dict(KIND=_HF_MXFP4, SMODE=0, RB=1, CB=32, GS=32)


def _launch(pool, fmt, stage: str, acts, N: int, K: int, out: torch.Tensor, cfg, k: int = 0, w=None, staged=None):
    """One launch of `stage` ("gate_up": out = h [P, I]; "down": out = y [P, H]) for the layer format; staged: the
    fetch kernel, copying the call's misses into their rows first."""
    a, src = acts
    P = src.shape[0]
    bn, bv, warps = cfg or default_config(stage, N, K, P)
    grid = (P, triton.cdiv(N, bn))
    bf16 = out.dtype == torch.bfloat16
    out_arg = out.view(torch.int16) if bf16 else out  # _store rounds bf16 itself
    if staged is not None:  # the staged list (experts, rows, count) and its constants, for either kind of format
        stg, fetch = list(staged[1:]), dict(CW=_fetch_cw(fmt, bv), NSTG=_pow2(min(P, staged[1].shape[0])))
    if isinstance(fmt, GGUFExpertFormat):
        lut = td.lut_table(a.device)
        if stage == "gate_up":
            (qg, bsg, tsg, nsg), (qu, bsu, tsu, nsu) = _pair_spec(fmt.quant("gate")), _pair_spec(fmt.quant("up"))
            bv = max(bv, bsg, bsu)
            consts = dict(QG=qg, BSG=bsg, TSG=tsg, NSG=nsg, QU=qu, BSU=bsu, TSU=tsu, NSU=nsu, BN=bn, BV=bv,
                          H_BF16=bf16, num_warps=warps)
            args = (a, src, pool["gate"], pool["gate"].stride(0), pool["up"], pool["up"].stride(0), out_arg, lut, K,
                    N, k)
            if staged is None:
                _gguf_gate_up_kernel[grid](*args, **consts)
            else:
                words, (rwg, rwu) = _gguf_fetch_args(staged, pool, fmt, ("gate", "up"))
                _gguf_gate_up_fetch_kernel[grid](*args, *words, *stg, **consts, RWG=rwg, RWU=rwu, **fetch)
        else:
            qd, bsd, tsd, nsd = _pair_spec(fmt.quant("down"))
            consts = dict(QD=qd, BSD=bsd, TSD=tsd, NSD=nsd, BN=bn, BV=max(bv, bsd), Y_BF16=bf16, num_warps=warps)
            args = (a, w, src, pool["down"], pool["down"].stride(0), out_arg, lut, N, K)
            if staged is None:
                _gguf_down_kernel[grid](*args, **consts)
            else:
                words, (rwd,) = _gguf_fetch_args(staged, pool, fmt, ("down",))
                _gguf_down_fetch_kernel[grid](*args, *words, *stg, **consts, RWD=rwd, **fetch)
        return out
    consts = _hf_consts(fmt)
    bv = max(bv, consts["GS"])
    if stage == "gate_up":
        args = (a, src, *_hf_parts(pool, fmt, "gate", a.device), *_hf_parts(pool, fmt, "up", a.device), out_arg, K, N, k)
        if staged is None:
            _hf_gate_up_kernel[grid](*args, **consts, BN=bn, BV=bv, H_BF16=bf16, num_warps=warps)
        else:
            g, c = _hf_fetch_args(staged, pool, fmt, "gate", K, bn)
            u, _ = _hf_fetch_args(staged, pool, fmt, "up", K, bn)
            _hf_gate_up_fetch_kernel[grid](*args, *g, *u, *stg, **consts, **c, **fetch, BN=bn, BV=bv, H_BF16=bf16,
                                           num_warps=warps)
    else:
        args = (a, w, src, *_hf_parts(pool, fmt, "down", a.device), out_arg, N, K)
        if staged is None:
            _hf_down_kernel[grid](*args, **consts, BN=bn, BV=bv, Y_BF16=bf16, num_warps=warps)
        else:
            d, c = _hf_fetch_args(staged, pool, fmt, "down", K, bn)
            _hf_down_fetch_kernel[grid](*args, *d, *stg, **consts, **c, **fetch, BN=bn, BV=bv, Y_BF16=bf16,
                                        num_warps=warps)
    return out

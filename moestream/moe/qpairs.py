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
- `quant_pair_outputs_torch`: the reference and the CPU path. On CPU it dequantizes each distinct
  row used once; on CUDA (formats without a Triton decoder) it gathers and dequantizes one row per
  pair, which has static shapes and no host reads, so it can be recorded in a CUDA graph (slow:
  a fallback, not the decode path).
- Triton kernels (CUDA, `supports(fmt)`): blocks are decoded in registers by the decoders of
  moestream.quant.triton_dequant and dotted with x in fp32; nothing dense is written.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .formats import PROJS, GGUFExpertFormat, HFExpertFormat


def supports(fmt) -> bool:
    """Whether the Triton pair kernels read `fmt` (the layer format) on CUDA; other quantized formats
    (IQ3_S, IQ2_*, TQ*, ...) run `quant_pair_outputs_torch` there."""
    if isinstance(fmt, GGUFExpertFormat):
        from ..quant.triton_dequant import _GGUF_IDS

        return all(t in _GGUF_IDS for _, t in fmt.types)
    if isinstance(fmt, HFExpertFormat):
        from ..quant.fp_formats import FP8Format, MXFP4Format, NVFP4Format

        return isinstance(fmt.qfmt, (FP8Format, NVFP4Format, MXFP4Format))
    return False


def quant_pair_outputs(x: torch.Tensor, topk_w: torch.Tensor, src: torch.Tensor, pool: dict, fmt) -> torch.Tensor:
    """y [P, H] float32: w[p] * mlp(x[p // k]) from the compressed pool row src[p] (module doc)."""
    if not getattr(fmt, "quantized", False):
        from .pairs import pair_outputs

        return pair_outputs(x, topk_w, src, pool)
    if x.device.type == "cuda" and supports(fmt) and _triton_ok():
        return _quant_pair_outputs_triton(x, topk_w, src, pool, fmt)
    return quant_pair_outputs_torch(x, topk_w, src, pool, fmt)


def quant_pair_outputs_torch(x, topk_w, src, pool, fmt) -> torch.Tensor:
    """The reference: dequantize (moestream.quant's decoders) to float32, fp32 GEMVs. Rows of pairs with
    src < 0 are zero here (callers must not rely on it: the kernels leave them untouched)."""
    T, k = topk_w.shape
    P = T * k
    H, I = fmt.hidden, fmt.inter
    if x.shape[1] != H:
        raise ValueError(f"x has {x.shape[1]} features, the experts H={H}")
    if x.device.type == "cpu":
        pairs = torch.nonzero(src >= 0).flatten()
        rows, inv = torch.unique(src[pairs], return_inverse=True)  # each distinct row decoded once
    else:  # static shapes, no host reads: one row per pair (rows of skipped pairs: row 0, discarded)
        pairs = torch.arange(P, device=x.device)
        rows, inv = src.clamp(min=0), pairs
    wg, wu, wd = (w[inv] for w in dequantize_rows(pool, fmt, rows))  # [n, I, H], [n, I, H], [n, H, I]
    xp = x[pairs // k].float()
    g = torch.bmm(wg, xp.unsqueeze(-1)).squeeze(-1)
    u = torch.bmm(wu, xp.unsqueeze(-1)).squeeze(-1)
    h = (F.silu(g) * u).to(x.dtype).float()
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
    try:
        import triton  # noqa: F401
    except ImportError:  # pragma: no cover - depends on the install
        return False
    from ..env import triton_enabled

    return triton_enabled()


def _quant_pair_outputs_triton(x, topk_w, src, pool, fmt) -> torch.Tensor:
    return quant_pair_outputs_torch(x, topk_w, src, pool, fmt)  # until the kernels land (issue 13 item 1)

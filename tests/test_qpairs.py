"""moestream.moe.qpairs: the pair kernels that read compressed expert rows equal the torch decoder followed
by fp32 GEMVs, for every format with a Triton decoder; pairs.stage_experts copies compressed rows.

* Interpreter: every case runs once in a subprocess with TRITON_INTERPRET=1 (tests/triton_harness.py), on
  CPU tensors, with large tiles (few programs: the interpreter pays per program); one case also with the
  default launch constants. Each case is then reported as its own test.
* sm_90: the kernels of a few formats compile for an H100/H200 with the default constants (no GPU needed).
* CUDA (`@pytest.mark.cuda`, skipped without a GPU): every case at the default constants, the Qwen3.6
  expert shape, `quant_pair_outputs` recorded in a CUDA graph and replayed on new inputs (every quantized GGUF
  type has a Triton decoder now: no torch fallback case is left), and staging compressed rows.

Pools are built as the engine builds them: one uint8 row of stored bytes per expert and array, and GGUF
rows LONGER than the layer's bytes, padded with 0xFF (fp16 NaN: a kernel reading past a layer's bytes
or a wrong row stride gives NaN). src has repeated rows and rows of another producer (src < 0).

Tolerance (`_check`): the kernel and the reference compute the same fp32 products in a different order
(per-block partial sums vs torch's GEMV; a scale multiplied per group or per row instead of per element;
an FMA contraction on the GPU). For a K-term dot product each result is within gamma_K = K * 2^-24 of
the exact sum times sum|terms| (the standard bound for recursive summation), so two of them differ by
at most 2 * gamma_(K+2) * sum|terms|; that is the bound used, computed per output from |W| @ |x| - it
cannot fail spuriously, yet a wrong value, block, scale or row shows as an O(1) relative error. h is
also rounded to x.dtype (one rounding: eps(x.dtype) * |h|), and silu through exp adds ~2^-22 relative.
The down projection is checked on the kernel's own h, so a rounding flip of h never reaches y's check.

Run as a script (`python tests/test_qpairs.py --worker OUT.json`) it is the interpreter worker.
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the worker runs as a script: find moestream
sys.path.insert(0, str(Path(__file__).resolve().parent))
from moestream.moe import cpu_moe  # noqa: E402
from moestream.moe import qpairs  # noqa: E402
from moestream.moe.formats import PROJS, gguf_expert_format, hf_expert_format  # noqa: E402
from moestream.moe.swiglu import swiglu  # noqa: E402
from moestream.quant import (FP8_BLOCK, FP8_CHANNEL, FP8_TENSOR, MXFP4, NVFP4, fp8_block_format,  # noqa: E402
                             gguf_format)
from moestream.quant.synthetic import random_raw  # noqa: E402
from triton_harness import (HAS_TRITON, assert_case, compile_sm90, frame_bytes, interpreted_results,  # noqa: E402
                            write_case_results)

from moestream.layers.triton_ops import DRIVER_STACK_LIMIT  # noqa: E402

ROWS = 5  # pool rows (experts)
PAD = 40  # extra bytes at the end of every GGUF pool row (a bigger type's row of another layer)


def _gguf(types: str, H: int, I: int, dtype=torch.float32):
    g, u, d = (types.split("/") * 3)[:3] if "/" in types else (types,) * 3
    return ("gguf", {"gate": g, "up": u, "down": d}), H, I, dtype


def _hf(qfmt, H: int, I: int, dtype=torch.float32, scale_dtype=None):
    return ("hf", (qfmt, scale_dtype)), H, I, dtype


# name -> (format spec, H, I, x dtype). 32-value blocks: H=256, I=64; 256-value super-blocks: H=I=256.
CASES = {
    "Q8_0": _gguf("Q8_0", 256, 64, torch.bfloat16),
    "Q8_0R": _gguf("Q8_0R", 256, 64, torch.bfloat16),  # Q8_0 rows row-planar (the GPU stores' layout)
    "Q8_0R/Q8_0R/Q4_K": _gguf("Q8_0R/Q8_0R/Q4_K", 256, 256),  # a planar gate/up beside a block-format down
    "Q4_0": _gguf("Q4_0", 256, 64),
    "Q4_1": _gguf("Q4_1", 256, 64, torch.float16),
    "Q5_0": _gguf("Q5_0", 256, 64),
    "Q5_1": _gguf("Q5_1", 256, 64, torch.bfloat16),
    "IQ4_NL": _gguf("IQ4_NL", 256, 64),
    "MXFP4_gguf": _gguf("MXFP4", 256, 64, torch.bfloat16),
    "NVFP4_gguf": _gguf("NVFP4", 256, 64),
    "Q2_K": _gguf("Q2_K", 256, 256),
    "Q3_K": _gguf("Q3_K", 256, 256, torch.bfloat16),
    "Q4_K": _gguf("Q4_K", 256, 256),
    "Q5_K": _gguf("Q5_K", 256, 256, torch.float16),
    "Q6_K": _gguf("Q6_K", 256, 256),
    "IQ4_XS": _gguf("IQ4_XS", 256, 256, torch.bfloat16),
    "IQ3_S": _gguf("IQ3_S", 256, 256),
    "IQ3_XXS": _gguf("IQ3_XXS", 256, 256, torch.bfloat16),
    "IQ2_XXS/IQ2_XS/IQ2_S": _gguf("IQ2_XXS/IQ2_XS/IQ2_S", 256, 256, torch.bfloat16),  # each array its own type
    "IQ1_M/IQ1_S/TQ1_0": _gguf("IQ1_M/IQ1_S/TQ1_0", 256, 256, torch.bfloat16),
    "TQ2_0": _gguf("TQ2_0", 256, 256),
    "Q4_K/Q5_K/Q6_K": _gguf("Q4_K/Q5_K/Q6_K", 256, 256, torch.bfloat16),  # each array its own type
    "fp8_block": _hf(FP8_BLOCK, 256, 128, torch.bfloat16),  # 2 column blocks; down: 2 row blocks
    "fp8_block_32x64_bf16": _hf(fp8_block_format((32, 64)), 256, 96, scale_dtype=torch.bfloat16),  # partial blocks
    "fp8_channel": _hf(FP8_CHANNEL, 256, 64),
    "fp8_tensor": _hf(FP8_TENSOR, 256, 64, torch.bfloat16),
    "nvfp4": _hf(NVFP4, 256, 64, torch.float16),
    "mxfp4": _hf(MXFP4, 256, 64, torch.bfloat16),
}
# launch constants under the interpreter: few, large programs (gate_up, down): (BN, BV, warps)
INTERP_CFG = {"gate_up": (64, 256, 4), "down": (128, 256, 4)}
DEFAULT_CFG_CASES = ("Q8_0", "Q8_0R")  # also run with the default constants under the interpreter


def make_layer(case: str, device="cpu"):
    """(fmt, pool) of one case: ROWS experts of random valid weights, each array a uint8 row per expert."""
    (kind, spec), H, I, _ = CASES[case]
    if kind == "gguf":
        fmt = gguf_expert_format(spec, H, I)
        pool = {n: torch.full((ROWS, nb + PAD), 0xFF, dtype=torch.uint8) for n, (nb,) in fmt.shapes(H, I).items()}
        for e in range(ROWS):
            for j, proj in enumerate(PROJS):
                raw = random_raw(fmt.quant(proj), fmt.logical(H, I)[proj], seed=3 * e + j).reshape(-1)
                pool[proj][e, :raw.numel()] = raw
        return fmt, {n: t.to(device) for n, t in pool.items()}
    qfmt, scale_dtype = spec
    dtypes = {f"{proj}.{p.name}": (scale_dtype if scale_dtype and p.dtype == torch.float32 and p.row_block else p.dtype)
              for proj in PROJS for p in qfmt.parts}
    fmt = hf_expert_format(qfmt, dtypes, H, I)
    pool = {n: torch.empty((ROWS, nb), dtype=torch.uint8) for n, (nb,) in fmt.shapes(H, I).items()}
    for e in range(ROWS):
        for j, proj in enumerate(PROJS):
            for part, t in random_raw(qfmt, fmt.logical(H, I)[proj], seed=3 * e + j).items():
                t = t.to(dtypes[f"{proj}.{part}"]) if t.is_floating_point() and t.element_size() > 1 else t
                pool[f"{proj}.{part}"][e] = t.reshape(-1).contiguous().view(torch.uint8)
    return fmt, {n: t.to(device) for n, t in pool.items()}


def make_inputs(case: str, device="cpu", T: int = 2, k: int = 2, seed: int = 0):
    _, H, _, dtype = CASES[case]
    g = torch.Generator().manual_seed(seed)
    x = (0.1 * torch.randn(T, H, generator=g)).to(dtype)  # |h| well inside fp16's range for every format
    w = torch.rand(T, k, generator=g)
    src = torch.randint(0, ROWS, (T * k,), generator=g)
    src[1] = -1  # another producer's pair
    src[2] = src[0]  # a row used twice
    return x.to(device), w.to(device), src.to(device)


def _bound(terms_abs_sum: torch.Tensor, K: int) -> torch.Tensor:
    """Two fp32 K-term sums of the same products, in any orders, differ by at most this (module doc)."""
    return 2 * (K + 2) * 2.0 ** -24 * terms_abs_sum + 1e-30


def _check(case: str, device: str = "cpu", cfg=None, T: int = 2, k: int = 2, fmt_pool=None) -> list[str]:
    """Kernel h and y (each stage on exact inputs) against the reference decoders and fp32 GEMVs."""
    fmt, pool = fmt_pool or make_layer(case, device)
    x, w, src = make_inputs(case, device, T, k)
    H, I, P = fmt.hidden, fmt.inter, T * k
    h = torch.full((P, I), float("nan"), dtype=x.dtype, device=device)
    qpairs.gate_up_triton(x, src, pool, fmt, k, h, cfg and cfg["gate_up"])
    y = torch.full((P, H), float("nan"), dtype=torch.float32, device=device)
    qpairs.down_triton(h, w.reshape(-1), src, pool, fmt, y, cfg and cfg["down"])
    errs = []
    skip = src < 0
    if not (torch.isnan(h[skip]).all() and torch.isnan(y[skip]).all()):
        errs.append("a pair with src < 0 was written")
    live = torch.nonzero(~skip).flatten()
    wg, wu, wd = qpairs.dequantize_rows({n: t.cpu() for n, t in pool.items()}, fmt, src[live].cpu())
    xp = x.cpu()[live.cpu() // k].float()
    g, u = (torch.bmm(m, xp.unsqueeze(-1)).squeeze(-1) for m in (wg, wu))
    sg, su = (torch.bmm(m.abs(), xp.abs().unsqueeze(-1)).squeeze(-1) for m in (wg, wu))
    h_ref = swiglu(g, u)
    tol_h = (torch.finfo(x.dtype).eps + 2.0 ** -21) * h_ref.abs() + 1.1 * u.abs() * _bound(sg, H) \
        + F.silu(g).abs() * _bound(su, H)
    hk = h.cpu()[live.cpu()].float()
    bad = (hk - h_ref).abs() > tol_h
    if bad.any() or torch.isnan(hk).any():
        errs.append(f"h: {int(bad.sum())} of {bad.numel()} off, max err {float((hk - h_ref).abs().max()):.3g} "
                    f"(tol {float(tol_h.max()):.3g})")
    wl = w.cpu().reshape(-1)[live.cpu()].float().unsqueeze(-1)
    y_ref = torch.bmm(wd, hk.unsqueeze(-1)).squeeze(-1) * wl
    tol_y = _bound(torch.bmm(wd.abs(), hk.abs().unsqueeze(-1)).squeeze(-1) * wl.abs(), I)
    yk = y.cpu()[live.cpu()]
    bad = (yk - y_ref).abs() > tol_y
    if bad.any() or torch.isnan(yk).any():
        errs.append(f"y: {int(bad.sum())} of {bad.numel()} off, max err {float((yk - y_ref).abs().max()):.3g} "
                    f"(tol {float(tol_y.max()):.3g})")
    return errs


def test_reference_equals_per_expert_dense():
    """The reference (decode distinct rows, fp32 GEMV) equals each expert's own dense weights (fmt.dense)."""
    for case in ("Q4_K/Q5_K/Q6_K", "nvfp4"):
        fmt, pool = make_layer(case)
        x, w, src = make_inputs(case)
        y = qpairs.quant_pair_outputs_torch(x, w, src, pool, fmt)  # CPU: the reference
        fast = qpairs.quant_pair_outputs(x, w, src, pool, fmt)  # CPU: the compiled layer call where it reads fmt
        if cpu_moe.ready(fmt, x):  # int8-rounded activations (GGUF, NVFP4): close, not equal
            assert not torch.equal(fast, y)
            assert ((fast - y).norm() / y.norm()).item() < 0.05
        else:
            assert torch.equal(fast, y)
        for p, s in enumerate(src.tolist()):
            if s < 0:
                assert torch.all(y[p] == 0)
                continue
            rows = {n: t[s, :fmt.shapes(fmt.hidden, fmt.inter)[n][0]] for n, t in pool.items()}
            gu, d = fmt.dense(rows, torch.float32)
            g, u = (gu @ x[p // w.shape[1]].float()).chunk(2)
            want = (d @ swiglu(g, u, x.dtype).float()) * w.reshape(-1)[p]
            torch.testing.assert_close(y[p], want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_supports():
    assert qpairs.supports(make_layer("Q8_0")[0]) == HAS_TRITON
    assert qpairs.supports(make_layer("nvfp4")[0]) == HAS_TRITON
    assert qpairs.supports(gguf_expert_format({"gate": "IQ3_S", "up": "IQ3_S", "down": "Q4_K"}, 256, 256)) == HAS_TRITON
    # every quantized GGUF type the loader accepts has a Triton decoder (quant/triton_dequant.py)
    from moestream.quant.base import FORMATS

    for name in sorted(f.name[5:] for f in FORMATS.values()
                       if f.name.startswith("gguf:") and f.name[5:] not in ("F32", "F16", "BF16")):
        fmt = gguf_expert_format({"gate": name, "up": name, "down": "Q4_K"}, 256, 256)
        assert qpairs.supports(fmt) == HAS_TRITON, name


# --------------------------------------------------------------------------- interpreter
def _stage_case(case: str = "Q4_K", pad: int = PAD) -> list[str]:
    """pairs._stage_triton copies every array of a compressed pool (one launch: 3 GGUF arrays, 6 FP8 parts, 9 NVFP4
    ones; more than the kernel's slots: one launch an array), host rows shorter than pool rows."""
    from moestream.moe import pairs

    fmt, host = make_layer(case)
    host = {n: t[:, :fmt.shapes(fmt.hidden, fmt.inter)[n][0]].contiguous() for n, t in host.items()}  # exact rows
    pool = {n: torch.zeros((4, t.shape[1] + pad), dtype=torch.uint8) for n, t in host.items()}
    experts, rows, count = torch.tensor([3, 1, 4]), torch.tensor([2, 0, 1]), torch.tensor(2)
    pairs._stage_triton(host, pool, experts, rows, count)
    errs = []
    for n, t in pool.items():
        want = torch.zeros_like(t)
        want[2, :host[n].shape[1]], want[0, :host[n].shape[1]] = host[n][3], host[n][1]
        if not torch.equal(t, want):
            errs.append(f"{case} {n}: staged rows differ")
    return errs


def _stage_cases() -> list[str]:
    from moestream.moe import pairs

    errs = _stage_case("Q4_K") + _stage_case("fp8_block") + _stage_case("nvfp4", pad=3)  # pad 3: 1-byte words
    slots = pairs.STAGE_ARRAYS
    try:  # fewer slots than arrays: the per-array launches
        pairs.STAGE_ARRAYS = 2
        errs += _stage_case("Q4_K")
    finally:
        pairs.STAGE_ARRAYS = slots
    return errs


FETCH_CASES = {"fetchQ8_0": _gguf("Q8_0", 256, 96, torch.bfloat16),
               "fetchQ8_0R": _gguf("Q8_0R", 256, 96, torch.bfloat16)}  # I = 96: a partial gate_up block of 64 rows


def _fetch_case(case: str, T: int = 1, cfg=None) -> list[str]:
    """The fetch kernels (qpairs.fetches_in_pairs) copy a call's staged misses into their pool rows as they compute:
    the pool and the pair outputs equal the copy kernel's staging followed by the plain kernels, bit for bit. A hit,
    a CPU pair (src -1), a miss into a scratch row, the staged list longer than its count (the entry past it must not
    be copied), and at T = 2 a missed expert routed by both tokens (both programs copy the same rows)."""
    from moestream.moe.pairs import stage_experts

    CASES.update(FETCH_CASES)
    fmt, bank = make_layer(case)
    host = {n: t[:, :fmt.shapes(fmt.hidden, fmt.inter)[n][0]].contiguous() for n, t in bank.items()}
    pool = {n: torch.full((6, t.shape[1] + PAD), 0xFF, dtype=torch.uint8) for n, t in host.items()}
    for n, t in pool.items():
        t[0, :host[n].shape[1]] = host[n][1]  # expert 1 resident in row 0
    x, w, _ = make_inputs(case, T=T, k=4 if T == 1 else 2)
    # experts 3 (a miss admitted into row 2), 1 (a hit, row 0), a CPU pair, 4 (a miss into scratch row 5)
    src = torch.tensor([2, 0, -1, 5]) if T == 1 else torch.tensor([2, 0, 2, 5])
    experts, rows, count = torch.tensor([3, 4, 0, 2]), torch.tensor([2, 5, 0, 3]), torch.tensor(2)
    want_pool = {n: t.clone() for n, t in pool.items()}
    stage_experts(host, want_pool, experts, rows, count)
    want = qpairs._quant_pair_outputs_triton(x, w, src, want_pool, fmt, cfg)
    got = qpairs._quant_pair_outputs_triton(x, w, src, pool, fmt, cfg, staged=(host, experts, rows, count))
    errs = [f"{case} T={T} {n}: pool rows differ from the copy kernel's" for n in pool
            if not torch.equal(pool[n], want_pool[n])]
    live = src >= 0
    if not torch.equal(got[live], want[live]):
        errs.append(f"{case} T={T}: outputs differ, max {float((got[live] - want[live]).abs().max()):.3g}")
    return errs


def _linear_rows(T: int, how: str):
    """(T, whether the multi-row kernel is on) of a dense case: how "pairs" runs T rows through the pair kernel, one
    program per row (MOESTREAM_QLINEAR_ROWS=0); else the multi-row kernel where T > 1 (or a permuted layer's rows)."""
    on = "pairs" not in how
    qpairs._QLINEAR_CFG["rows_on"] = on
    assert qpairs._rows_kernel(T) == (on and T > 1)


def _linear_case(qtype: str, T: int = 3, how: str = "") -> list[str]:
    """qpairs.quant_linear (a dense layer kept compressed) against the torch decoder and a float64 GEMM;
    K = 512 (two K-quant super-blocks), N = 40 (a partial tile), T rows of bf16 activations (3: one partial block of
    the multi-row kernel's 4; 9: a full block of 8 and a partial one; 1: the pair kernel)."""
    from moestream.quant import gguf_format
    from moestream.quant.synthetic import random_raw

    q = gguf_format(qtype)
    N, K = 40, 512
    raw = random_raw(q, (N, K), "cpu", seed=3)
    x = (torch.randn(T, K, generator=torch.Generator().manual_seed(4)) * 0.5).to(torch.bfloat16)
    _linear_rows(T, how)
    # "perm": stored column c is the model's column perm[c] (layers.QuantLinear's in_perm), read in the kernel (or
    # gathered first, with the multi-row kernel off)
    perm = torch.randperm(K, generator=torch.Generator().manual_seed(5)) if "perm" in how else None
    got = qpairs.quant_linear(x, q, raw, (N, K), perm).double()
    W = q.dequantize(raw, (N, K), torch.float64)
    want = (x if perm is None else x[:, perm]).double() @ W.t()
    # fp32 accumulation in any order (bounded by _bound), then one bf16 rounding of the output
    tol = _bound(x.double().abs() @ W.abs().t(), K) + 2.0 ** -8 * want.abs()
    bad = (got - want).abs() > tol
    return [f"{qtype}: {int(bad.sum())} of {bad.numel()} off"] if bad.any() else []


def _words_case(K: int, how: str = "") -> list[str]:
    """The word-load experiment (MOESTREAM_QLINEAR_WORDS=1) of a one-row Q4_K dense layer against the torch decoder
    and a float64 GEMV: K = 768 (three blocks: a partial second step of two), 1024, 2048; with a permutation."""
    from moestream.quant import gguf_format
    from moestream.quant.synthetic import random_raw

    q = gguf_format("Q4_K")
    N = 40
    raw = random_raw(q, (N, K), "cpu", seed=3)
    x = (torch.randn(1, K, generator=torch.Generator().manual_seed(4)) * 0.5).to(torch.bfloat16)
    perm = torch.randperm(K, generator=torch.Generator().manual_seed(5)) if how == "perm" else None
    qpairs._QLINEAR_CFG.update(words_on=True)
    try:
        got = qpairs.quant_linear(x, q, raw, (N, K), perm).double()
    finally:
        qpairs._QLINEAR_CFG.update(words_on=False)
    W = q.dequantize(raw, (N, K), torch.float64)
    want = (x if perm is None else x[:, perm]).double() @ W.t()
    tol = _bound(x.double().abs() @ W.abs().t(), K) + 2.0 ** -8 * want.abs()
    bad = (got - want).abs() > tol
    return [f"words K={K}: {int(bad.sum())} of {bad.numel()} off"] if bad.any() else []


def _repack_case(K: int, T: int) -> list[str]:
    """The repacked Q4_K experiment (MOESTREAM_QLINEAR_REPACK=1): repack_q4k keeps the stored values exactly (its
    layout decoded in torch equals the Q4_K decoder), and the kernel over it equals a float64 GEMM (quant_linear's
    bound): K = 768 (three 256-column steps), 2048 (two 1024-column steps); T = 1, 3 (a partial row block), 9."""
    from moestream.quant import gguf_format
    from moestream.quant.synthetic import random_raw

    q = gguf_format("Q4_K")
    N = 40
    raw = random_raw(q, (N, K), "cpu", seed=3)
    packed = qpairs.repack_q4k(raw, N, K)
    W = q.dequantize(raw, (N, K), torch.float64)
    codes = ((packed["q"][:, :, None] >> (4 * torch.arange(8))) & 0xF).reshape(N, K // 32, 32).double()
    dl = (packed["sc"].double().reshape(N, K // 256, 8) * packed["d"].double()[:, :, None]).reshape(N, K // 32, 1)
    ml = (packed["mn"].double().reshape(N, K // 256, 8) * packed["dm"].double()[:, :, None]).reshape(N, K // 32, 1)
    errs = [] if torch.equal((codes * dl - ml).reshape(N, K), W) else [f"repack K={K}: values differ"]
    if not torch.equal(qpairs.q4k_repacked_dense(packed, N, K, torch.float32).double(), W):  # a prefill's operand
        errs.append(f"repack K={K}: the dense decode differs")
    x = (torch.randn(T, K, generator=torch.Generator().manual_seed(4)) * 0.5).to(torch.bfloat16)
    got = qpairs.q4k_repacked_linear(x, packed, N, K)
    want = x.double() @ W.t()
    tol = _bound(x.double().abs() @ W.abs().t(), K) + 2.0 ** -8 * want.abs()
    bad = (got.double() - want).abs() > tol
    return errs + ([f"repack K={K} T={T}: {int(bad.sum())} of {bad.numel()} off"] if bad.any() else []) + (
        [] if got.dtype == torch.bfloat16 and got.shape == (T, N) else [f"repack: {got.dtype} {tuple(got.shape)}"])


def _repack_module_case() -> list[str]:
    """layers.QuantLinear.repack (what MOESTREAM_QLINEAR_REPACK=1 does at a GPU layer's first decode call): raw released,
    decode rows through the repacked GEMV and a prefill's 40 rows through the dense decode + GEMM, both within
    quant_linear's bound of the stored weight's product."""
    from moestream.layers.quant_linear import QuantLinear
    from moestream.quant import gguf_format
    from moestream.quant.synthetic import random_raw

    q = gguf_format("Q4_K")
    N, K = 24, 512
    raw = random_raw(q, (N, K), "cpu", seed=7)
    W = q.dequantize(raw, (N, K), torch.float64)
    lin = QuantLinear("Q4_K", raw.clone(), N, K).repack()
    errs = [] if lin.raw.numel() == 0 and lin.packed is not None else ["repack kept raw"]
    for rows in (3, 40):
        x = (torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)) * 0.5).to(torch.bfloat16)
        got = lin(x).double()
        want = x.double() @ W.t()
        mag = x.double().abs() @ W.abs().t()
        # a prefill's rows multiply the weight decoded to x's dtype (as quant.qlinear's GPU path does): each weight
        # rounded to bf16, half an ulp (2^-9) relative, on top of the GEMV's bound
        tol = _bound(mag, K) + 2.0 ** -7 * want.abs() + 1e-2 + (2.0 ** -8 * mag if rows > 16 else 0)
        if got.shape != (rows, N) or ((got - want).abs() > tol).any():
            errs.append(f"repacked module, {rows} rows: {int(((got - want).abs() > tol).sum())} off")
    return errs


def _mma_case(qtype: str, T: int, how: str = "") -> list[str]:
    """The tensor-core experiment (MOESTREAM_QLINEAR_MMA=1) of a GGUF dense layer: its tiles, column order,
    permutation and masks, with the dot in float32 (the interpreter's bf16 dot is not exact numpy; on a GPU the
    weights are rounded to bf16 and the kernel is compiled below). Same bound as _linear_case."""
    from moestream.quant import gguf_format
    from moestream.quant.synthetic import random_raw

    q = gguf_format(qtype)
    N, K = 40, 512
    raw = random_raw(q, (N, K), "cpu", seed=3)
    x = (torch.randn(T, K, generator=torch.Generator().manual_seed(4)) * 0.5).to(torch.bfloat16)
    perm = torch.randperm(K, generator=torch.Generator().manual_seed(5)) if how == "perm" else None
    qpairs._QLINEAR_CFG.update(rows_on=True, mma_on=True, mma_fp32=True)
    try:
        got = qpairs.quant_linear(x, q, raw, (N, K), perm).double()
    finally:
        qpairs._QLINEAR_CFG.update(mma_on=False, mma_fp32=False)
    W = q.dequantize(raw, (N, K), torch.float64)
    want = (x if perm is None else x[:, perm]).double() @ W.t()
    tol = _bound(x.double().abs() @ W.abs().t(), K) + 2.0 ** -8 * want.abs()
    bad = (got - want).abs() > tol
    return [f"mma {qtype}: {int(bad.sum())} of {bad.numel()} off"] if bad.any() else []


def _hf_linear_case(case: str, T: int = 3, how: str = "") -> list[str]:
    """qpairs.hf_quant_linear (an HF-quantized dense layer kept as stored: layers.HFQuantLinear's parts) against the
    format's torch decoder and a float64 GEMM; N = 40 rows (a partial tile and, for 128 x 128 FP8, a partial row
    block), K = 256, T = 3 rows of bf16 activations; same bound as _linear_case."""
    from moestream.layers.quant_linear import HFQuantLinear

    (_, (qfmt, scale_dtype)), _, _, _ = CASES[case]
    N, K = 40, 256
    parts = random_raw(qfmt, (N, K), seed=7)
    if scale_dtype is not None:
        parts = {n: t.to(scale_dtype) if t.dtype == torch.float32 and t.dim() > 1 else t for n, t in parts.items()}
    lin = HFQuantLinear(qfmt, parts, N, K)
    x = (torch.randn(T, K, generator=torch.Generator().manual_seed(4)) * 0.5).to(torch.bfloat16)
    _linear_rows(T, how)
    efmt = qpairs.hf_linear_format(qfmt, lin.dtypes, N, K)
    got = qpairs.hf_quant_linear(x, efmt, lin._pool(), (N, K)).double()
    W = lin.dense(torch.float64)
    want = x.double() @ W.t()
    tol = _bound(x.double().abs() @ W.abs().t(), K) + 2.0 ** -8 * want.abs()
    bad = (got - want).abs() > tol
    return [f"{case}: {int(bad.sum())} of {bad.numel()} off"] if bad.any() else []


HF_LINEAR_CASES = ("fp8_block", "fp8_block_32x64_bf16", "fp8_channel", "fp8_tensor", "nvfp4", "mxfp4")


COUNT_CASES = ((32, 256, [0, 1, 2], True), (12, 384, [3, 1, 3], True), (5, 64, [2], True),
               (8, 256, [0, 1, 2, 3], False))


def _count_inputs(P, E, layers, distinct_too):
    """ids [n, P] of calls to `layers` (one layer twice in a case), counters with something in them, and the counts
    they must end with: every distinct expert of a call once, no distinct count for batch-1 calls (distinct_too)."""
    g = torch.Generator().manual_seed(P)
    ids = torch.randint(0, E, (len(layers), P), generator=g)
    ids[:, 1] = ids[:, 0]  # a repeat in every call
    hits, distinct = torch.randint(0, 5, (4, E), generator=g), torch.randint(0, 9, (4,), generator=g)
    want_h, want_d = hits.clone(), distinct.clone()
    for row, layer in zip(ids, layers):
        routed = torch.zeros(E, dtype=torch.long)
        routed[row] = 1
        want_h[layer] += routed
        if distinct_too:
            want_d[layer] += routed.sum()
    return ids, torch.tensor(layers), hits, distinct, want_h, want_d


def _count_case() -> list[str]:
    """pairs._count_routed_kernel (the fused pair path's counts of a decode step's layer calls, one program a call)
    equals the torch counts: repeats and experts past the top of the ids included, P not a power of two, a layer
    listed twice counted twice."""
    from moestream.moe import pairs

    errs = []
    for P, E, layers, distinct_too in COUNT_CASES:
        ids, lidx, hits, distinct, want_h, want_d = _count_inputs(P, E, layers, distinct_too)
        pairs._count_routed_kernel[(len(layers),)](ids, lidx, hits, distinct, E, P=P, BLOCK_E=triton_next_pow2(E),
                                                   DISTINCT=distinct_too)
        if not (torch.equal(hits, want_h) and torch.equal(distinct, want_d)):
            errs.append(f"P={P} E={E} layers={layers}: counts differ")
    return errs


@pytest.mark.parametrize("case", COUNT_CASES)
def test_count_routed_torch_path(case):
    """count_routed's torch path (CPU tensors) gives the same counts as the kernel's case above."""
    from moestream.moe import pairs

    ids, lidx, hits, distinct, want_h, want_d = _count_inputs(*case)
    pairs.count_routed(ids, lidx, hits, distinct, add_distinct=case[3])
    assert torch.equal(hits, want_h) and torch.equal(distinct, want_d)


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _worker_case(case: str) -> list[str]:
    if case.startswith("q8w:"):  # q8w:CASE: CASE with MOESTREAM_Q8_WORDS=1 (Q8_0 read as 16-bit words)
        import os

        from moestream.quant import gguf_format

        os.environ["MOESTREAM_Q8_WORDS"] = "1"
        try:
            if qpairs._pair_spec(gguf_format("Q8_0"))[0] != qpairs.Q8_WORDS:
                return ["MOESTREAM_Q8_WORDS=1 did not select the 16-bit word kernels"]
            return _worker_case(case[4:])
        finally:
            del os.environ["MOESTREAM_Q8_WORDS"]
    if case == "count":
        return _count_case()
    if case == "stage":
        return _stage_cases()
    if case.startswith("fetch:"):  # fetch:CASE[:T[:default|wide]]
        _, what, *rest = case.split(":")
        # wide: a gate_up step of FETCH_CW columns (Q8_0R rows then copy FETCH_CW * 2 words a step: qpairs._fetch_cw)
        cfg = None if "default" in rest else \
            {"gate_up": (4, qpairs.FETCH_CW, 4), "down": INTERP_CFG["down"]} if "wide" in rest else INTERP_CFG
        return _fetch_case(what, int(rest[0]) if rest else 1, cfg)
    if case.startswith("words:"):  # words:K[:perm]
        _, K, *how = case.split(":")
        return _words_case(int(K), *how)
    if case == "repackmod":
        return _repack_module_case()
    if case.startswith("repack:"):  # repack:K:T
        _, K, T = case.split(":")
        return _repack_case(int(K), int(T))
    if case.startswith("mma:"):  # mma:TYPE:T[:perm]
        _, what, T, *how = case.split(":")
        return _mma_case(what, int(T), *how)
    if case.startswith(("hflinear:", "linear:")):  # linear:TYPE[:T[:pairs]]
        kind, what, *rest = case.split(":")
        T, how = int(rest[0]) if rest else 3, rest[1] if len(rest) > 1 else ""
        return (_hf_linear_case if kind == "hflinear" else _linear_case)(what, T, how)
    if case.endswith(":default"):
        return _check(case.split(":")[0])
    return _check(case, cfg=INTERP_CFG)


WORKER_CASES = [*CASES, *(f"{c}:default" for c in DEFAULT_CFG_CASES), "stage", "count", "fetch:Q8_0", "fetch:fetchQ8_0",
                "fetch:fetchQ8_0:2", "fetch:fetchQ8_0R", "fetch:fetchQ8_0R:2", "fetch:Q8_0R:1:default", "fetch:fetchQ8_0R:1:wide",
                "fetch:Q4_K/Q5_K/Q6_K", "fetch:Q8_0:1:default", "fetch:fp8_block",
                "fetch:fp8_block_32x64_bf16", "fetch:fp8_block_32x64_bf16:1:default", "fetch:fp8_channel:2",
                "fetch:fp8_tensor", "fetch:nvfp4", "fetch:nvfp4:1:default", "fetch:mxfp4", "linear:Q8_0", "linear:Q4_K",
                "linear:Q6_K", "linear:Q4_K:9", "linear:Q6_K:1", "linear:Q4_K:3:pairs", "linear:IQ4_XS:2",
                "linear:Q6_K:1:perm", "linear:Q4_K:3:perm", "linear:Q8_0:9:perm", "linear:Q4_K:3:permpairs",
                "linear:Q6_K:1:permpairs",
                *(f"hflinear:{c}" for c in HF_LINEAR_CASES), "hflinear:fp8_block:9", "hflinear:nvfp4:1",
                "hflinear:mxfp4:3:pairs", "mma:Q4_K:3", "mma:Q6_K:4:perm", "mma:Q8_0:17", "mma:IQ4_XS:2", "words:768", "words:2048",
                "words:1024:perm", "repack:768:1", "repack:2048:3", "repack:1024:9", "repackmod", "q8w:Q8_0",
                "q8w:Q8_0:default", "q8w:fetch:fetchQ8_0", "q8w:fetch:fetchQ8_0:2", "q8w:fetch:Q8_0:1:default"]


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return interpreted_results(__file__, tmp_path_factory)


@pytest.mark.parametrize("case", WORKER_CASES)
def test_interpreted_kernel_equals_reference(interpreted, case):
    assert_case(interpreted, case)


def test_torch_stage_copies_compressed_rows():
    """The torch path of stage_experts: every array, host rows to the front of longer pool rows."""
    from moestream.moe import pairs
    from moestream.moe.pairs import stage_experts

    fmt, host = make_layer("Q8_0")
    host = {n: t[:, :fmt.shapes(fmt.hidden, fmt.inter)[n][0]].contiguous() for n, t in host.items()}
    pool = {n: torch.zeros((4, t.shape[1] + PAD), dtype=torch.uint8) for n, t in host.items()}
    stage_experts(host, pool, torch.tensor([3, 1, 4]), torch.tensor([2, 0, 1]), torch.tensor(2))
    for n, t in pool.items():
        w = host[n].shape[1]
        assert torch.equal(t[2, :w], host[n][3]) and torch.equal(t[0, :w], host[n][1])
        assert not t[1].any() and not t[3].any() and not t[:, w:].any()
    x, tw, _ = make_inputs("Q8_0", T=1, k=3)
    src = torch.tensor([2, 0, -1])  # pairs.pair_outputs hands a quantized layer format to qpairs
    torch.testing.assert_close(pairs.pair_outputs(x, tw, src, pool, fmt),
                               qpairs.quant_pair_outputs(x, tw, src, pool, fmt), rtol=0, atol=0)
    # from the staged pool rows (longer than the layer's bytes): the reference's values, up to the CPU
    # kernel's int8 activation rounding where it runs
    ref = qpairs.quant_pair_outputs_torch(x, tw, src, pool, fmt)
    torch.testing.assert_close(pairs.pair_outputs(x, tw, src, pool, fmt), ref, rtol=0,
                               atol=0.05 * float(ref.abs().max()))


# --------------------------------------------------------------------------- sm_90 compile
def _gguf_compile_args(types: str, H: int, I: int, P: int):
    import triton.language as tl

    sig_gu = {"x": "*bf16", "src": "*i64", "gw": "*u8", "g_stride": "i64", "uw": "*u8", "u_stride": "i64",
              "h": "*i16", "lut": "*fp32", "K_TOP": "i32"}
    sig_d = {"h": "*bf16", "tw": "*fp32", "src": "*i64", "dw": "*u8", "d_stride": "i64", "y": "*fp32", "lut": "*fp32"}
    qt, bs, ts, ns = qpairs._gguf_spec(gguf_format(types))
    bn, bv, _ = qpairs.default_config("gate_up", I, H, P)
    c_gu = dict(H=H, I=I, QG=qt, BSG=bs, TSG=ts, NSG=ns, QU=qt, BSU=bs, TSU=ts, NSU=ns, BN=bn, BV=max(bv, bs),
                H_BF16=True)
    bn, bv, _ = qpairs.default_config("down", H, I, P)
    c_d = dict(H=H, I=I, QD=qt, BSD=bs, TSD=ts, NSD=ns, BN=bn, BV=max(bv, bs), Y_BF16=False)
    # a dense layer kept compressed: the same kernel storing its bf16 output itself (quant_linear)
    bn, bv, _ = qpairs.default_config("down", 8192, H, 1)
    c_lin = dict(H=8192, I=H, QD=qt, BSD=bs, TSD=ts, NSD=ns, BN=bn, BV=max(bv, bs), Y_BF16=True)
    rows = []
    for T, perm in ((4, False), (8, False), (1, True), (4, True)):  # the multi-row dense kernel (RT 4, 8, 1), with
        bn, bv, _, rt = qpairs.linear_rows_config(8192, H, T, bs)  # the columns read through a permutation or not
        rows.append((qpairs._gguf_linear_kernel, {"x": "*bf16", "dw": "*u8", "y": "*i16", "lut": "*fp32",
                                                  "perm": "*i64", "T": "i32"},
                     dict(N=8192, K=H, QD=qt, BSD=bs, TSD=ts, NSD=ns, BN=bn, BV=bv, RT=rt, Y_BF16=True, PERM=perm)))
    if types == "Q4_K":  # the word-load experiment (one row); the repacked layout (1 and 4 rows)
        rows.append((qpairs._q4k_linear_words_kernel, {"x": "*bf16", "dw": "*u8", "y": "*i16", "perm": "*i64"},
                     dict(N=8192, K=H, BN=4, BKB=4, Y_BF16=True, PERM=False)))
        rows.append((qpairs._q4kr_dequant_kernel, {"qw": "*i32", "sc": "*u8", "mn": "*u8", "d": "*fp16", "dm": "*fp16",
                                                    "w": "*bf16"}, dict(N=8192, K=H, BN=4, BV=1024)))
        for T in (1, 4):
            bn, bv, _, rt = qpairs.repacked_config(8192, H, T)
            rows.append((qpairs._q4kr_linear_kernel, {"x": "*bf16", "qw": "*i32", "sc": "*u8", "mn": "*u8",
                                                      "d": "*fp16", "dm": "*fp16", "y": "*i16", "T": "i32"},
                         dict(N=8192, K=H, BN=bn, BV=bv, RT=rt, Y_BF16=True)))
    rows.append((qpairs._gguf_linear_mma_kernel, {"x": "*bf16", "dw": "*u8", "y": "*i16", "lut": "*fp32",
                                                  "perm": "*i64", "T": "i32"},
                 dict(N=8192, K=H, QD=qt, BSD=bs, TSD=ts, NSD=ns, BN=16, BV=max(bs, 64), Y_BF16=True, PERM=False,
                      DOT_T=tl.bfloat16)))
    # the same kernels copying a call's misses from the host bank (8-byte words of the file's rows) as they compute
    fetch = {"hg": "*i64", "hg_stride": "i64", "pg": "*i64", "pg_stride": "i64", "hu": "*i64", "hu_stride": "i64",
             "pu": "*i64", "pu_stride": "i64", "stg_e": "*i64", "stg_r": "*i64", "stg_n": "*i64"}
    row_words = {n: (K // bs * ts) // 8 for n, K in (("gu", H), ("d", I))}
    sig_gu_f = {**{n: t for n, t in sig_gu.items() if n != "K_TOP"}, "K_TOP": "i32", **fetch}
    sig_d_f = {**sig_d, "hd": "*i64", "hd_stride": "i64", "pd": "*i64", "pd_stride": "i64",
               **{n: t for n, t in fetch.items() if n.startswith("stg")}}
    efmt = gguf_expert_format({"gate": types, "up": types, "down": types}, H, I)
    rows.append((qpairs._gguf_gate_up_fetch_kernel, sig_gu_f, {**c_gu, "RWG": row_words["gu"], "RWU": row_words["gu"],
                                                               "CW": qpairs._fetch_cw(efmt, c_gu["BV"]), "NSTG": P}))
    rows.append((qpairs._gguf_down_fetch_kernel, sig_d_f, {**c_d, "RWD": row_words["d"],
                                                           "CW": qpairs._fetch_cw(efmt, c_d["BV"]), "NSTG": P}))
    return ((qpairs._gguf_gate_up_kernel, sig_gu, c_gu), (qpairs._gguf_down_kernel, sig_d, c_d),
            (qpairs._gguf_down_kernel, {**sig_d, "y": "*i16"}, c_lin), *rows)


def _hf_compile_args(qfmt, H: int, I: int, P: int):
    consts = qpairs._hf_consts(SimpleNamespace(qfmt=qfmt))
    sdt = "*fp32" if consts["KIND"] == 0 else "*u8"
    part = lambda p: {f"{p}w": "*u8", f"{p}w_stride": "i64", f"{p}s": sdt, f"{p}s_stride": "i64", f"{p}g": "*fp32",
                      f"{p}g_stride": "i64"}
    sig_gu = {"x": "*bf16", "src": "*i64", **part("g"), **part("u"), "h": "*i16", "K_TOP": "i32"}
    sig_d = {"h": "*bf16", "tw": "*fp32", "src": "*i64", **part("d"), "y": "*fp32"}
    bn, bv, _ = qpairs.default_config("gate_up", I, H, P)
    c_gu = dict(H=H, I=I, **consts, BN=bn, BV=max(bv, consts["GS"]), H_BF16=True)
    bn, bv, _ = qpairs.default_config("down", H, I, P)
    c_d = dict(H=H, I=I, **consts, BN=bn, BV=max(bv, consts["GS"]), Y_BF16=False)
    bn, bv, _ = qpairs.default_config("down", 8192, H, 1)
    c_lin = dict(H=8192, I=H, **consts, BN=bn, BV=max(bv, consts["GS"]), Y_BF16=True)
    rows = []
    for T in (4, 8):
        bn, bv, _, rt = qpairs.linear_rows_config(8192, H, T, consts["GS"])
        rows.append((qpairs._hf_linear_kernel, {"x": "*bf16", "dw": "*u8", "ds": sdt, "dg": "*fp32", "y": "*i16",
                                                "T": "i32"},
                     dict(N=8192, K=H, **consts, BN=bn, BV=bv, RT=rt, Y_BF16=True)))
    # the fetch kernels: each part's host and pool words (4-byte words: every part's stored rows divide into them)
    fetch = lambda p: {n: t for q in ("w", "s", "g") for n, t in ((f"h{p}{q}", "*i32"), (f"h{p}{q}_s", "i64"),
                                                                  (f"p{p}{q}", "*i32"), (f"p{p}{q}_s", "i64"))}
    stg = {"stg_e": "*i64", "stg_r": "*i64", "stg_n": "*i64"}
    names = [q.name for q in qfmt.parts]
    fc = lambda N, K, bn: dict(RW_W=(K // 2 if consts["KIND"] else K) // 4, RBP_S=1 if consts["KIND"] else 128,
                               RW_S=1 if consts["KIND"] == 0 else K // (16 if consts["KIND"] == 1 else 32) // 4,
                               NR_S=bn if consts["KIND"] else bn // 128 + 2, RW_G=1, NPARTS=len(names), CW=1024, NSTG=P)
    rows.append((qpairs._hf_gate_up_fetch_kernel, {**{n: t for n, t in sig_gu.items() if n != "K_TOP"}, "K_TOP": "i32",
                                                   **fetch("g"), **fetch("u"), **stg},
                 {**c_gu, **fc(I, H, c_gu["BN"])}))
    rows.append((qpairs._hf_down_fetch_kernel, {**sig_d, **fetch("d"), **stg}, {**c_d, **fc(H, I, c_d["BN"])}))
    return ((qpairs._hf_gate_up_kernel, sig_gu, c_gu), (qpairs._hf_down_kernel, sig_d, c_d),
            (qpairs._hf_down_kernel, {**sig_d, "y": "*i16"}, c_lin), *rows)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_q8_words_pair_kernels_compile_for_sm90():
    """The pair and fetch kernels with Q8_0 read as 16-bit words (MOESTREAM_Q8_WORDS) at the Qwen3.6 expert shape,
    the fetch kernels within the driver's default stack frame."""
    names = ("_gguf_gate_up_kernel", "_gguf_down_kernel", "_gguf_gate_up_fetch_kernel", "_gguf_down_fetch_kernel")
    done = 0
    for kernel, sig, consts in _gguf_compile_args("Q8_0", 2048, 512, 8):
        if kernel.fn.__name__ not in names or consts.get("Y_BF16") and "I" in consts and consts["H"] == 8192:
            continue
        consts = {n: (qpairs.Q8_WORDS if n in ("QG", "QU", "QD") else v) for n, v in consts.items()}
        k = compile_sm90(kernel, {**sig, **{n: "constexpr" for n in consts}}, consts, {"num_warps": 4})
        assert "ld.global" in k.asm["ptx"]
        if "fetch" in kernel.fn.__name__:
            assert frame_bytes(k) <= DRIVER_STACK_LIMIT, (kernel, frame_bytes(k))
        done += 1
    assert done == 4


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_q8_planar_pair_kernels_compile_for_sm90():
    """The pair and fetch kernels on Q8_0R rows (the stores' GPU layout) at the Qwen3.6 expert shape load the codes
    16 bytes at a time (the point of the layout: GGUF's 34-byte blocks allow 2), the fetch kernels within the
    driver's default stack frame."""
    names = ("_gguf_gate_up_kernel", "_gguf_down_kernel", "_gguf_gate_up_fetch_kernel", "_gguf_down_fetch_kernel")
    done = 0
    for kernel, sig, consts in _gguf_compile_args("Q8_0R", 2048, 512, 8):
        if kernel.fn.__name__ not in names or consts.get("Y_BF16") and "I" in consts and consts["H"] == 8192:
            continue
        aligned = tuple(n for n, t in sig.items() if t.startswith("*") or n.endswith("stride"))  # as launched
        k = compile_sm90(kernel, {**sig, **{n: "constexpr" for n in consts}}, consts, {"num_warps": 4},
                         aligned=aligned)
        ptx = k.asm["ptx"]
        # codes in 16-byte loads, one 2-byte load a projection for its scales; the block layout's kernels load the
        # codes 2 bytes (and a scale 1) at a time: 32 and 4 such loads in gate_up
        assert "ld.global.v4" in ptx and "ld.global.b8" not in ptx and ptx.count("ld.global.b16") <= 2, \
            (kernel.fn.__name__, ptx.count("ld.global.b16"))
        if "fetch" in kernel.fn.__name__:
            assert frame_bytes(k) <= DRIVER_STACK_LIMIT, (kernel, frame_bytes(k))
            # the misses' rows copied straight from the host to the slot (ld.global -> st.global) before the barrier
            # that precedes their reads, not through shared memory (qpairs._fetch_cw says how that happened)
            assert ptx.split("bar.sync", 1)[0].count("st.global") > 0, kernel.fn.__name__
        done += 1
    assert done == 4


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_K", "fp8_block", "nvfp4"])
def test_kernels_compile_for_sm90(fmt):
    """The real compiler (Triton -> PTX -> ptxas, H100/H200) accepts both kernels at the Qwen3.6 expert shape
    (H=2048, I=512, batch 1) with the default constants: 4-D tiles, typed scale loads, the decoders."""
    H, I, P = 2048, 512, 8
    if fmt.startswith(("Q", "IQ")):
        launches = _gguf_compile_args(fmt, H, I, P)
    else:
        launches = _hf_compile_args({"fp8_block": FP8_BLOCK, "nvfp4": NVFP4, "mxfp4": MXFP4}[fmt], H, I, P)
    for kernel, sig, consts in launches:
        k = compile_sm90(kernel, {**sig, **{n: "constexpr" for n in consts}}, consts, {"num_warps": 4})
        assert "ld.global" in k.asm["ptx"]
        if kernel is getattr(qpairs, "_gguf_linear_mma_kernel", None):  # the tensor-core experiment: bf16 mma
            assert "mma.sync" in k.asm["ptx"]
        if "fetch" in kernel.fn.__name__:
            assert frame_bytes(k) <= DRIVER_STACK_LIMIT, (kernel, frame_bytes(k))


# --------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs an NVIDIA GPU and triton")
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_kernel_equals_reference(case):
    """Every case at the default launch constants (many programs, partial tiles)."""
    errs = _check(case, "cuda", T=3, k=4)
    assert not errs, "; ".join(errs)


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs an NVIDIA GPU and triton")
@pytest.mark.parametrize("types", ["Q8_0", "Q4_K/Q4_K/Q6_K"])
def test_cuda_qwen36_shape(types):
    """The decode shape of the target model (H=2048, I=512, k=8), batch 1 and 4, at the default constants."""
    name = f"qwen36:{types}"
    CASES[name] = _gguf(types, 2048, 512, torch.bfloat16)
    try:
        fmt_pool = make_layer(name, "cuda")
        for T in (1, 4):
            errs = _check(name, "cuda", T=T, k=8, fmt_pool=fmt_pool)
            assert not errs, f"T={T}: " + "; ".join(errs)
    finally:
        del CASES[name]


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs an NVIDIA GPU and triton")
@pytest.mark.parametrize("case", ["Q8_0", "Q4_K/Q5_K/Q6_K", "IQ4_XS", "fp8_block", "fp8_tensor", "nvfp4", "mxfp4",
                                  "IQ3_S", "IQ3_XXS", "IQ1_M/IQ1_S/TQ1_0"])
def test_cuda_graph_replay(case):
    """quant_pair_outputs recorded in a CUDA graph replays on new x / weights / src (incl. src < 0)."""
    fmt, pool = make_layer(case, "cuda")
    assert qpairs.supports(fmt)
    x, w, src = make_inputs(case, "cuda", T=2, k=4)
    qpairs.quant_pair_outputs(x, w, src, pool, fmt)  # warm up: compile, tables, allocator
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = qpairs.quant_pair_outputs(x, w, src, pool, fmt)
    for seed in (1, 2):
        x2, w2, src2 = make_inputs(case, "cuda", T=2, k=4, seed=seed)
        x.copy_(x2)
        w.copy_(w2)
        src.copy_(src2)
        graph.replay()
        want = qpairs.quant_pair_outputs_torch(x, w, src, pool, fmt)
        keep = src >= 0
        # y against the whole reference: h may round differently in the last bit of x.dtype
        torch.testing.assert_close(y[keep], want[keep], rtol=2e-2, atol=2e-2 * float(want.abs().max()))


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs an NVIDIA GPU and triton")
def test_cuda_stage_compressed_rows_then_pairs():
    """stage_experts (Triton copy kernel) moves compressed host rows (pinned) into longer device rows; the pair
    kernels then read them."""
    from moestream.moe.pairs import pair_outputs, stage_experts

    fmt, bank = make_layer("Q4_K/Q5_K/Q6_K")
    host = {n: t[:, :fmt.shapes(fmt.hidden, fmt.inter)[n][0]].contiguous().pin_memory() for n, t in bank.items()}
    pool = {n: torch.full((4, t.shape[1] + PAD), 0xFF, dtype=torch.uint8, device="cuda") for n, t in host.items()}
    experts = torch.tensor([3, 1, 4, 0], device="cuda")
    rows = torch.tensor([2, 0, 1, 3], device="cuda")
    stage_experts(host, pool, experts, rows, torch.tensor(4, device="cuda"))
    for n, t in pool.items():
        assert torch.equal(t[:, :host[n].shape[1]].cpu(), host[n][[1, 4, 3, 0]])
    x, w, _ = make_inputs("Q4_K/Q5_K/Q6_K", "cuda", T=1, k=4)
    src = torch.tensor([2, 0, -1, 3], device="cuda")
    y = pair_outputs(x, w, src, pool, fmt)
    want = qpairs.quant_pair_outputs_torch(x, w, src, pool, fmt)
    keep = src >= 0
    torch.testing.assert_close(y[keep], want[keep], rtol=2e-2, atol=2e-2 * float(want.abs().max()))


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    write_case_results(WORKER_CASES, _worker_case, sys.argv[2])


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs an NVIDIA GPU and triton")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K"])
def test_cuda_quant_linear(qtype):
    """A dense layer kept compressed, on the GPU, equals the torch decoder + float64 GEMM (same bound)."""
    _check_cuda_linear(qtype, 4, lambda x, q, raw, N, K: qpairs.quant_linear(x, q, raw, (N, K)))


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs an NVIDIA GPU and triton")
@pytest.mark.parametrize("T", [1, 4, 9])
def test_cuda_q4k_repacked_linear(T):
    """The repacked Q4_K experiment on the GPU (the decode shapes' constants: words, 16-byte loads): the float64
    GEMM of the stored values, within quant_linear's bound."""
    _check_cuda_linear("Q4_K", T, lambda x, q, raw, N, K: qpairs.q4k_repacked_linear(x, qpairs.repack_q4k(raw, N, K),
                                                                                      N, K))


def _check_cuda_linear(qtype: str, T: int, run) -> None:
    """run(x, format, raw, N, K) -> y for a 4096 x 2048 matrix of qtype and T rows: within the float64 GEMM's bound."""
    from moestream.quant import gguf_format
    from moestream.quant.synthetic import random_raw

    q = gguf_format(qtype)
    N, K = 4096, 2048
    raw = random_raw(q, (N, K), "cuda", seed=3)
    x = (torch.randn(T, K, device="cuda") * 0.5).to(torch.bfloat16)
    got = run(x, q, raw, N, K).double()
    W = q.dequantize(raw.cpu(), (N, K), torch.float64).cuda()
    want = x.double() @ W.t()
    tol = _bound(x.double().abs() @ W.abs().t(), K) + 2.0 ** -8 * want.abs()
    assert got.shape == (T, N) and not ((got - want).abs() > tol).any()


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs an NVIDIA GPU and triton")
def test_cuda_quant_linear_module_repacked(monkeypatch):
    """MOESTREAM_QLINEAR_REPACK=1: a Q4_K QuantLinear on a GPU repacks at its first decode call (raw released), then
    reads the repacked weight for decode rows (recordable in a CUDA graph) and for a prefill's rows (one dense decode,
    one GEMM); both equal the dequantized weight's product (quant_linear's bound)."""
    from moestream.layers.quant_linear import QuantLinear
    from moestream.quant import gguf_format
    from moestream.quant.synthetic import random_raw

    monkeypatch.setitem(qpairs._QLINEAR_CFG, "repack_on", True)
    q = gguf_format("Q4_K")
    N, K = 3072, 2048
    raw = random_raw(q, (N, K), "cuda", seed=5)
    W = q.dequantize(raw.cpu(), (N, K), torch.float64).cuda()
    lin = QuantLinear("Q4_K", raw, N, K)
    for rows in (1, 4, 40):
        x = (torch.randn(rows, K, device="cuda") * 0.5).to(torch.bfloat16)
        got = lin(x)
        assert lin.packed is not None and lin.raw.numel() == 0 and got.shape == (rows, N)
        want = x.double() @ W.t()
        mag = x.double().abs() @ W.abs().t()  # prefill rows: the weight decoded to bf16 (_repack_module_case)
        tol = _bound(mag, K) + 2.0 ** -7 * want.abs() + 1e-2 + (2.0 ** -8 * mag if rows > 16 else 0)
        assert not ((got.double() - want).abs() > tol).any(), rows
    _replays_like_eager(lin, (torch.randn(4, K, device="cuda") * 0.5).to(torch.bfloat16))


def _replays_like_eager(lin, x) -> None:
    """lin(x) recorded in a CUDA graph and replayed on new rows equals lin on those rows, bit for bit."""
    g = torch.cuda.CUDAGraph()
    static = x.clone()
    lin(static)
    with torch.cuda.graph(g):
        out = lin(static)
    static.copy_(x.flip(0))
    g.replay()
    torch.testing.assert_close(out, lin(x.flip(0)), rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs an NVIDIA GPU and triton")
@pytest.mark.parametrize("rows", [1, 4, 40])
def test_cuda_quant_linear_module(rows):
    """layers.QuantLinear on a GPU: decode rows through the GEMV kernel (recordable in a CUDA graph), a
    prefill's rows through a decoded weight and one GEMM; both equal the dequantized weight's product."""
    from moestream.layers.quant_linear import GPU_GEMV_ROWS, FusedQuantLinear
    from moestream.quant import gguf_format
    from moestream.quant.synthetic import random_raw

    q = gguf_format("Q8_0")
    N, K = 3072, 2048
    raw = random_raw(q, (N, K), "cuda", seed=5)
    lin = FusedQuantLinear("Q8_0", raw, (1024, 2048), K)
    x = (torch.randn(rows, K, device="cuda") * 0.5).to(torch.bfloat16)
    W = q.dequantize(raw.cpu(), (N, K), torch.float64).cuda()
    want = x.double() @ W.t()
    got = lin(x)
    assert got.shape == (rows, N) and got.dtype == torch.bfloat16
    tol = _bound(x.double().abs() @ W.abs().t(), K) + 2.0 ** -7 * want.abs() + 1e-2
    assert not ((got.double() - want).abs() > tol).any()
    a, b = lin.split(got)
    assert a.shape[-1] == 1024 and b.shape[-1] == 2048
    if rows <= GPU_GEMV_ROWS:
        _replays_like_eager(lin, x)


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs an NVIDIA GPU and triton")
@pytest.mark.parametrize("rows", [1, 4, 40])
def test_cuda_quant_linear_module_permuted_input(rows):
    """layers.QuantLinear with in_perm (a GGUF's GDN out projection, value heads reordered) on a GPU: decode rows read
    x through the permutation inside the GEMV kernel (no gather; recordable in a CUDA graph), prefill rows gathered
    then one GEMM; both equal x[:, in_perm] @ W.T of the dequantized weight."""
    from moestream.layers.quant_linear import GPU_GEMV_ROWS, QuantLinear
    from moestream.quant import gguf_format
    from moestream.quant.synthetic import random_raw

    q = gguf_format("Q6_K")
    N, K = 2048, 4096
    raw = random_raw(q, (N, K), "cuda", seed=6)
    perm = torch.randperm(K, generator=torch.Generator().manual_seed(8))
    lin = QuantLinear("Q6_K", raw, N, K, in_perm=perm).cuda()
    x = (torch.randn(rows, K, device="cuda") * 0.5).to(torch.bfloat16)
    W = q.dequantize(raw.cpu(), (N, K), torch.float64).cuda()
    want = x[:, perm.cuda()].double() @ W.t()
    got = lin(x)
    tol = _bound(x.double().abs() @ W.abs().t(), K) + 2.0 ** -7 * want.abs() + 1e-2
    assert got.shape == (rows, N) and not ((got.double() - want).abs() > tol).any()
    if rows <= GPU_GEMV_ROWS:
        _replays_like_eager(lin, x)


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs an NVIDIA GPU and triton")
@pytest.mark.parametrize("case", ["fp8_block", "fp8_tensor", "nvfp4"])
@pytest.mark.parametrize("rows", [1, 4, 40])
def test_cuda_hf_quant_linear_module(case, rows):
    """layers.HFQuantLinear on a GPU (a dense layer of an HF FP8 / NVFP4 checkpoint kept as stored): decode rows
    through the HF pair kernel (recordable in a CUDA graph), a prefill's rows through a decoded weight and one GEMM;
    both equal the dequantized weight's product (the same bound as the GGUF module's test)."""
    from moestream.layers.quant_linear import GPU_GEMV_ROWS, HFQuantLinear

    (_, (qfmt, _)), _, _, _ = CASES[case]
    N, K = 3072, 2048
    parts = {n: t.cuda() for n, t in random_raw(qfmt, (N, K), seed=5).items()}
    lin = HFQuantLinear(qfmt, parts, N, K)
    x = (torch.randn(rows, K, device="cuda") * 0.5).to(torch.bfloat16)
    W = lin.dense(torch.float64)
    want = x.double() @ W.t()
    got = lin(x)
    assert got.shape == (rows, N) and got.dtype == torch.bfloat16
    terms = x.double().abs() @ W.abs().t()
    tol = _bound(terms, K) + 2.0 ** -7 * want.abs() + 1e-2
    if rows > GPU_GEMV_ROWS:  # the weight decoded to bf16 (each value within 2^-8 relative) before the GEMM
        tol = tol + 2.0 ** -8 * terms
    assert not ((got.double() - want).abs() > tol).any()
    if rows <= GPU_GEMV_ROWS:
        _replays_like_eager(lin, x)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_stage_all_kernel_compiles_for_sm90_within_the_default_frame():
    """The one-launch staging kernel (every array of a layer's misses; 8-byte words, 9 array slots) compiles for an
    H100/H200 and needs no local memory past the driver's default stack frame (tests/test_triton_frames.py says why)."""
    from moestream.layers import triton_ops
    from moestream.moe import pairs
    from triton_harness import frame_bytes

    sig = {}
    for j in range(pairs.STAGE_ARRAYS):
        sig.update({f"h{j}": "*i64", f"p{j}": "*i64", f"n{j}": "i32", f"hs{j}": "i32", f"ps{j}": "i32"})
    sig.update({"experts_ptr": "*i64", "rows_ptr": "*i64", "count_ptr": "*i64", "CHUNK": "constexpr",
                "BLOCK": "constexpr"})
    k = compile_sm90(pairs._stage_all_kernel, sig, {"CHUNK": 8192, "BLOCK": 1024}, {"num_warps": 4})
    assert frame_bytes(k) <= triton_ops.DRIVER_STACK_LIMIT


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("P, E", [(32, 256), (256, 512)])
def test_count_routed_kernel_compiles_for_sm90_within_the_default_frame(P, E):
    """The fused pair path's one-launch counts compile for an H100/H200 without local memory past the default frame,
    at batch 4 of top-8 over 256 experts and at its largest call."""
    from moestream.layers import triton_ops
    from moestream.moe import pairs
    from triton_harness import frame_bytes

    sig = {"ids": "*i64", "lidx": "*i64", "hits": "*i64", "distinct": "*i64", "E": "i32", "P": "constexpr",
           "BLOCK_E": "constexpr", "DISTINCT": "constexpr"}
    k = compile_sm90(pairs._count_routed_kernel, sig, {"P": P, "BLOCK_E": E, "DISTINCT": True}, {"num_warps": 4})
    assert frame_bytes(k) <= triton_ops.DRIVER_STACK_LIMIT


@pytest.mark.parametrize("env, want", [("16,256,4", (16, 256, 4)), ("", None), ("16,256", None), ("x,1,1", None),
                                       ("12,256,4", None), ("16,256,0", None)])
def test_qlinear_launch_constants_from_the_environment(env, want, monkeypatch, caplog):
    """MOESTREAM_QLINEAR_CFG sets the dense GEMVs' launch constants (benchmarks/qlinear_gpu.py); a malformed value is
    a warning and the defaults, never a failed step."""
    monkeypatch.setenv("MOESTREAM_QLINEAR_CFG", env)
    monkeypatch.setattr(qpairs, "_QLINEAR_CFG", {})
    assert qpairs.linear_config(8192, 2048, 1) == want
    assert ("not BN,BV,WARPS" in caplog.text) == (bool(env) and want is None)


@pytest.mark.parametrize("T, bs, env, want", [(4, 256, "8,256,4", (8, 256, 4, 4)), (3, 256, "", None),
                                              (9, 32, "", None), (2, 256, "4,128,4", (4, 256, 4, 2)),
                                              (16, 32, "4,256", None)])
def test_qlinear_rows_launch_constants(T, bs, env, want, monkeypatch):
    """The multi-row dense kernel's constants: RT = T rounded up to a power of two, at most LINEAR_MAX_RT; BV holds a
    whole block; by default ~8K products a step; MOESTREAM_QLINEAR_ROWS_CFG sets BN, BV, warps (malformed: defaults);
    MOESTREAM_QLINEAR_ROWS=0 sends T > 1 rows back to the pair kernel."""
    monkeypatch.setenv("MOESTREAM_QLINEAR_ROWS_CFG", env)
    monkeypatch.setattr(qpairs, "_QLINEAR_CFG", {})
    bn, bv, warps, rt = got = qpairs.linear_rows_config(8192, 2048, T, bs)
    assert rt == min(1 << (T - 1).bit_length(), qpairs.LINEAR_MAX_RT) and bv >= bs and bv % bs == 0
    if want is not None:
        assert got == want
    else:
        assert bn * bv * rt <= 8192 and warps == 4
    if not env:  # Q4_K's programs take twice the rows (the H100 sweep)
        q4 = qpairs.linear_rows_config(8192, 2048, T, bs, "Q4_K")
        assert q4[1:] == got[1:] and q4[0] == min(2 * bn, 8192)
    assert qpairs._rows_kernel(T) and not qpairs._rows_kernel(1)
    monkeypatch.setenv("MOESTREAM_QLINEAR_ROWS", "0")
    monkeypatch.setattr(qpairs, "_QLINEAR_CFG", {})
    assert not qpairs._rows_kernel(T)


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs an NVIDIA GPU and triton")
@pytest.mark.parametrize("types", ["Q8_0", "Q4_K/Q4_K/Q6_K", "fp8_block", "nvfp4", "mxfp4"])
def test_cuda_fetch_in_pairs_equals_staging(types, monkeypatch):
    """At the Qwen3.6 expert shape (H=2048, I=512, k=8, one token), pinned host rows: the fetch kernels (one-token
    decode calls by default, qpairs.fetches_in_pairs) leave the pool and the outputs bit-equal to the copy kernel
    followed by the plain kernels, eagerly and replayed from a CUDA graph on new routes."""
    from moestream.moe.pairs import pair_outputs, stage_experts

    name = f"qwen36:{types}"
    hf = {"fp8_block": FP8_BLOCK, "nvfp4": NVFP4, "mxfp4": MXFP4}.get(types)
    CASES[name] = _hf(hf, 2048, 512, torch.bfloat16) if hf else _gguf(types, 2048, 512, torch.bfloat16)
    try:
        fmt, bank = make_layer(name)
    finally:
        del CASES[name]
    host = {n: t[:, :fmt.shapes(fmt.hidden, fmt.inter)[n][0]].contiguous().pin_memory() for n, t in bank.items()}
    pool = {n: torch.full((12, t.shape[1] + PAD), 0xFF, dtype=torch.uint8, device="cuda") for n, t in host.items()}
    for n, t in pool.items():  # every row holds an expert (rows not staged by a route are hits)
        t[:, :host[n].shape[1]] = host[n][torch.arange(12) % ROWS].cuda()
    g = torch.Generator().manual_seed(0)
    x = (0.1 * torch.randn(1, 2048, generator=g)).to(torch.bfloat16).cuda()
    w = torch.rand(1, 8, generator=g).cuda()
    src, experts = torch.empty(8, dtype=torch.long, device="cuda"), torch.empty(8, dtype=torch.long, device="cuda")
    rows, count = torch.empty(8, dtype=torch.long, device="cuda"), torch.empty((), dtype=torch.long, device="cuda")

    def route(seed: int):  # 8 pairs: rows 0..7 of a permutation, the first `n` of them staged from experts 0..4
        r = torch.Generator().manual_seed(seed)
        src.copy_(torch.randperm(12, generator=r)[:8])
        n = 1 + seed % 4
        experts.copy_(torch.randint(0, ROWS, (8,), generator=r))
        rows.copy_(src[torch.randperm(8, generator=r)])
        count.fill_(n)

    monkeypatch.delenv("MOESTREAM_FETCH_IN_PAIRS", raising=False)
    assert qpairs.fetches_in_pairs(x, fmt, pool, 1) and not qpairs.fetches_in_pairs(x, fmt, pool, 2)
    monkeypatch.setenv("MOESTREAM_FETCH_IN_PAIRS", "0")
    assert not qpairs.fetches_in_pairs(x, fmt, pool, 1)
    monkeypatch.setenv("MOESTREAM_FETCH_IN_PAIRS", "1")
    route(1)
    staged = (host, experts, rows, count)
    pair_outputs(x, w, src, {n: t.clone() for n, t in pool.items()}, fmt, staged)  # compile, allocator
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = pair_outputs(x, w, src, pool, fmt, staged)
    for seed in (2, 3, 4, 5):
        route(seed)
        want_pool = {n: t.clone() for n, t in pool.items()}
        stage_experts(host, want_pool, experts, rows, count)
        want = pair_outputs(x, w, src, want_pool, fmt)
        eager_pool = {n: t.clone() for n, t in pool.items()}
        eager = pair_outputs(x, w, src, eager_pool, fmt, staged)
        graph.replay()
        for n in pool:
            assert torch.equal(pool[n], want_pool[n]) and torch.equal(eager_pool[n], want_pool[n]), (seed, n)
        assert torch.equal(y, want) and torch.equal(eager, want), seed

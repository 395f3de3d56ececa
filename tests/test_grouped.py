"""moestream.moe.grouped: the grouped routed-expert GEMM equals float64 math on the dequantized experts.

Reference: each expert dequantized by the torch decoders (moestream.quant) in float64, then the experts'
SwiGLU oracle (moe/swiglu.reference_pairs): y[t] = sum_j w[t, j] * down @ (silu(gate @ x[t]) * (up @ x[t])) in
float64 (x is the same bf16/fp16 input).

Tolerance (normwise |y - ref| / |ref|, and max |y - ref| / max |ref|): the kernel rounds (to nearest
even, also under the interpreter) where the torch loop rounds: each weight, g, u, silu(g), h and the
expert's output to the activation dtype, with fp32 sums in between. Each rounding adds a relative error
<= 2^-9 (bf16) or 2^-12 (fp16); six of them give ~0.5% (bf16) in these cases (measured 0.4-0.6%
normwise). Bounds: REL_TOL = 1.5e-2 / 4e-3 and MAX_TOL = 3e-2 / 8e-3 (fp16). A wrong expert row gives
errors of order 1 (two cases also check that rolled rows fail the bound).

* Interpreter: the cases run once in a subprocess with TRITON_INTERPRET=1 (tests/triton_harness.py).
* sm_90: both kernels compile with ptxas and use tensor-core mma.
* CUDA (skipped without a GPU): the same cases on the device, and the wiring in compute.DeviceExperts.

Run as a script (`python tests/test_grouped.py --worker OUT.json`) it is the interpreter worker.
"""
from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from triton_harness import (HAS_TRITON, assert_case, compile_sm90, frame_bytes, interpreted_results,  # noqa: E402
                            write_case_results)

REL_TOL = {torch.bfloat16: 1.5e-2, torch.float16: 4e-3}
MAX_TOL = {torch.bfloat16: 3e-2, torch.float16: 8e-3}

# case -> (gate/up type, down type or "", H, I, E, T, k, activation dtype, bytes of padding per bank row)
CASES = {
    "bf16": ("", "", 256, 128, 8, 23, 2, torch.bfloat16, 0),
    "fp16-k4": ("", "", 256, 128, 8, 5, 4, torch.float16, 0),
    "Q8_0": ("Q8_0", "Q8_0", 256, 128, 8, 40, 3, torch.bfloat16, 0),
    "Q8_0R-padded-rows": ("Q8_0R", "Q8_0R", 256, 128, 8, 19, 2, torch.bfloat16, 40),  # the GPU stores' Q8_0 layout
    "Q8_0R-scale": ("Q8_0R", "Q8_0R", 256, 128, 8, 13, 3, torch.bfloat16, 0),  # MOESTREAM_Q8R_GROUPED=scale
    "Q4_0-fp16": ("Q4_0", "Q4_0", 256, 128, 8, 12, 2, torch.float16, 0),
    "Q4_K": ("Q4_K", "Q4_K", 256, 256, 8, 17, 2, torch.bfloat16, 0),
    "Q6_K": ("Q6_K", "Q6_K", 256, 256, 8, 9, 4, torch.bfloat16, 0),
    "Q5_K": ("Q5_K", "Q5_K", 256, 256, 8, 11, 2, torch.bfloat16, 0),
    "IQ3_S": ("IQ3_S", "IQ3_S", 256, 256, 8, 9, 2, torch.bfloat16, 0),
    "IQ3_XXS": ("IQ3_XXS", "IQ3_S", 256, 256, 8, 7, 2, torch.bfloat16, 0),  # gate/up IQ3_XXS, down IQ3_S
    "IQ2_XS": ("IQ2_XS", "IQ2_S", 256, 256, 8, 7, 2, torch.bfloat16, 0),  # gate/up IQ2_XS, down IQ2_S
    "IQ1_M": ("IQ1_M", "TQ1_0", 256, 256, 8, 7, 2, torch.bfloat16, 0),  # gate/up IQ1_M, down TQ1_0
    # a Q4_K_M-style layer: Q6_K down, rows of a slot pool sized for a bigger type of another layer
    "Q4_K-Q6_K-padded-rows": ("Q4_K", "Q6_K", 256, 256, 8, 21, 3, torch.bfloat16, 96),
    # HF formats (HF_CASES: the format and its scales' stored dtype); gate/up [128, 256], down [256, 128]
    "fp8_block": ("hf", "", 256, 128, 8, 13, 2, torch.bfloat16, 0),  # two column blocks; down: two row blocks
    "fp8_block_16x16_bf16": ("hf", "", 256, 96, 8, 9, 2, torch.bfloat16, 0),  # scale blocks narrower than a K step
    "fp8_block-wider-than-rows": ("hf", "", 64, 32, 8, 9, 2, torch.bfloat16, 0),  # 128x128 blocks, H 64, I 32
    "fp8_channel-fp16": ("hf", "", 256, 128, 8, 9, 2, torch.float16, 0),
    "fp8_tensor": ("hf", "", 256, 128, 8, 9, 3, torch.bfloat16, 0),
    "nvfp4": ("hf", "", 256, 128, 8, 11, 2, torch.bfloat16, 0),
    "mxfp4": ("hf", "", 256, 128, 8, 9, 2, torch.bfloat16, 0),
    "block-table": None,  # the kernel's block table equals block_table_oracle
}
NEGATIVE = {"bf16", "Q4_K-Q6_K-padded-rows", "fp8_block", "nvfp4"}  # also check that wrong rows fail
SPLIT = {"bf16", "Q8_0", "Q4_K-Q6_K-padded-rows", "fp8_block"}  # also run compute.grouped_partials + the loop


def _hf_spec(case: str):
    """(QuantFormat, stored dtype of float32 scale parts or None) of an HF case."""
    from moestream.quant import FP8_BLOCK, FP8_CHANNEL, FP8_TENSOR, MXFP4, NVFP4, fp8_block_format

    return {"fp8_block": (FP8_BLOCK, None), "fp8_block-wider-than-rows": (FP8_BLOCK, None), "fp8_block_16x16_bf16": (fp8_block_format((16, 16)), torch.bfloat16),
            "fp8_channel-fp16": (FP8_CHANNEL, None), "fp8_tensor": (FP8_TENSOR, None), "nvfp4": (NVFP4, None),
            "mxfp4": (MXFP4, None)}[case]


# --------------------------------------------------------------------------- cases
def _gguf_rows(name: str, shape, seed: int) -> torch.Tensor:
    """[E, bytes] random GGUF blocks of an [E, N, K] weight: every field random but the fp16 scales
    (small finite), so every code path of the decoder is taken (synthetic.random_raw; no quantizer needed)."""
    from moestream.quant import gguf_format
    from moestream.quant.synthetic import random_raw

    return random_raw(gguf_format(name), shape, seed=seed).reshape(shape[0], -1)


def _bank_rows(per_expert: torch.Tensor, slot: torch.Tensor, n_rows: int, pad: int, g) -> torch.Tensor:
    """Bank [n_rows, ...] with expert e at row slot[e]; other rows and `pad` trailing bytes are noise."""
    shape = (n_rows, per_expert.shape[1] + pad, *per_expert.shape[2:])
    if per_expert.dtype == torch.uint8:
        bank = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    else:
        bank = torch.randn(shape, generator=g).to(per_expert.dtype) * 1e3  # noise: wrong rows show
    bank[slot, :per_expert.shape[1]] = per_expert
    return bank


def build_case(case: str):
    """(x, topk_ids, topk_w, bank, rows [E], fmt, (gate, up, down) float64 [E, ...])."""
    from moestream.moe.formats import gguf_expert_format

    gu_t, d_t, H, I, E, T, k, dt, pad = CASES[case]
    g = torch.Generator().manual_seed(zlib.crc32(case.encode()))
    used = E - 2  # experts E-2, E-1 are never routed
    ids = torch.stack([torch.randperm(used, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g) + 0.1
    x = torch.randn(T, H, generator=g).to(dt)
    wg, wu = (torch.randn(E, I, H, generator=g) * H ** -0.5 for _ in range(2))
    wd = torch.randn(E, H, I, generator=g) * I ** -0.5
    n_rows = E + 3
    slot = torch.randperm(n_rows, generator=g)[:E]  # bank row of each expert
    if not gu_t:
        gate_up = torch.cat([wg, wu], 1).to(dt)
        bank = {"gate_up": _bank_rows(gate_up, slot, n_rows, 0, g), "down": _bank_rows(wd.to(dt), slot, n_rows, 0, g)}
        ref_w = (gate_up[:, :I].double(), gate_up[:, I:].double(), wd.to(dt).double())
        return x, ids, w, bank, slot, None, ref_w
    shapes = {"gate": (E, I, H), "up": (E, I, H), "down": (E, H, I)}
    if gu_t == "hf":
        return (x, ids, w, *_hf_bank(case, shapes, slot, n_rows, g), )
    fmt = gguf_expert_format({"gate": gu_t, "up": gu_t, "down": d_t}, H, I)
    types = {"gate": gu_t, "up": gu_t, "down": d_t}
    raw = {p: _gguf_rows(types[p], shapes[p], seed=i + len(case)) for i, p in enumerate(shapes)}
    bank = {p: _bank_rows(r, slot, n_rows, pad, g) for p, r in raw.items()}
    ref_w = tuple(fmt.quant(p).dequantize(raw[p], shapes[p], torch.float64) for p in ("gate", "up", "down"))
    return x, ids, w, bank, slot, fmt, ref_w


def _hf_bank(case: str, shapes: dict, slot, n_rows: int, g):
    """(bank, slot, fmt, float64 weights) of an HF case: each part's stored bytes a uint8 row per expert (as the
    store keeps them), random valid codes and positive scales (quant.synthetic.random_raw), noise in other rows."""
    from moestream.moe.formats import hf_expert_format
    from moestream.quant.synthetic import random_raw

    qfmt, scale_dtype = _hf_spec(case)
    E, I, H = shapes["gate"]
    raw = {p: random_raw(qfmt, shapes[p], seed=i + len(case)) for i, p in enumerate(shapes)}
    dtypes = {f"{p}.{part.name}": (scale_dtype if scale_dtype and part.dtype == torch.float32 and part.row_block
                                   else part.dtype) for p in shapes for part in qfmt.parts}
    fmt = hf_expert_format(qfmt, dtypes, H, I)
    bank, ref_w = {}, []
    for p in shapes:
        stored = {}
        for part, t in raw[p].items():
            dt = dtypes[f"{p}.{part}"]
            t = t.to(dt) if t.is_floating_point() and t.element_size() > 1 else t
            stored[part] = t
            rows = t.reshape(E, -1).contiguous().view(torch.uint8)
            bank[f"{p}.{part}"] = _bank_rows(rows, slot, n_rows, 0, g)
        ref_w.append(qfmt.dequantize(stored, shapes[p], torch.float64))
    return bank, slot, fmt, tuple(ref_w)


def reference(x, ids, w, ref_w) -> torch.Tensor:
    """The float64 SwiGLU oracle (moe/swiglu.py) of every pair, each token's k pairs summed."""
    from moestream.moe.swiglu import reference_pairs

    T, k = ids.shape
    return reference_pairs(x, w, ids, *ref_w).view(T, k, -1).sum(1)


def errors(y: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    d = y.double().cpu() - ref
    return float(d.norm() / ref.norm()), float(d.abs().max() / ref.abs().max())


def check(y, ref, dt, what: str) -> list[str]:
    rel, mx = errors(y, ref)
    if rel > REL_TOL[dt] or mx > MAX_TOL[dt]:
        return [f"{what}: rel {rel:.2e} (tol {REL_TOL[dt]:.0e}), max {mx:.2e} (tol {MAX_TOL[dt]:.0e})"]
    return []


def check_case(case: str, device: str = "cpu") -> list[str]:
    if case.endswith("-scale"):  # the Q8_0R tiles' other form (env.q8r_grouped), read at each launch
        os.environ["MOESTREAM_Q8R_GROUPED"] = "scale"
        try:
            return _check_case(case, device)
        finally:
            del os.environ["MOESTREAM_Q8R_GROUPED"]
    return _check_case(case, device)


def _check_case(case: str, device: str = "cpu") -> list[str]:
    from moestream.moe.grouped import grouped_moe

    if case == "block-table":
        return check_block_table(device)
    x, ids, w, bank, slot, fmt, ref_w = build_case(case)
    dt = x.dtype
    dev = torch.device(device)
    bank_d = {n: a.to(dev) for n, a in bank.items()}
    ref = reference(x, ids, w, ref_w)
    errs = check(grouped_moe(x.to(dev), ids.to(dev), w.to(dev), bank_d, slot.to(dev), fmt), ref, dt, "grouped_moe")
    if case in NEGATIVE:
        wrong = torch.roll(slot, 1)  # every expert reads its neighbour's row: must fail the bound
        y_wrong = grouped_moe(x.to(dev), ids.to(dev), w.to(dev), bank_d, wrong.to(dev), fmt)
        if not check(y_wrong, ref, dt, "wrong rows"):
            errs.append("rolled bank rows still pass the tolerance: the check cannot fail")
    return errs + (check_wired_split(case, dev) + check_device_prefill_same(case, dev) if case in SPLIT else [])


def check_wired_split(case: str, dev: torch.device) -> list[str]:
    """compute.grouped_partials for half the experts (into groups.pair_out), the torch loop for the
    rest, accumulate: the mix equals the reference (the prefill path splits experts like this)."""
    from moestream.moe.compute import IN_PAIR_OUT, RouteGroups, WeightRef, accumulate, grouped_partials, partial_outputs

    x, ids, w, bank, slot, fmt, ref_w = build_case(case)
    x, ids, w = x.to(dev), ids.to(dev), w.to(dev)
    bank = {n: a.to(dev) for n, a in bank.items()}
    groups = RouteGroups.of(ids)
    refs = {e: WeightRef(bank, int(slot[e]), fmt) for e in groups.experts}
    half = groups.experts[::2]
    partials = grouped_partials(x, w, groups, {e: refs[e] for e in half})
    if set(partials.values()) != {IN_PAIR_OUT}:
        return ["grouped_partials did not write into pair_out"]
    partials.update(partial_outputs(x, w, groups, {e: refs[e] for e in groups.experts if e not in half}))
    return check(accumulate(x, groups, partials), reference(x.cpu(), ids.cpu(), w.cpu(), ref_w), x.dtype, "split")


def check_device_prefill_same(case: str, dev: torch.device) -> list[str]:
    """fused prefill's sync-free path (strategies.DeviceBankPrefill: grouped_moe, the route grouped on the device)
    gives the grouped path's values bit for bit (RouteGroups on the host, grouped_partials, accumulate), with the
    model's routing weights in the activations' dtype as the routers give them."""
    from moestream.moe.compute import RouteGroups, WeightRef, accumulate, grouped_partials
    from moestream.moe.grouped import grouped_moe

    x, ids, w, bank, slot, fmt, _ = build_case(case)
    x, ids, w = x.to(dev), ids.to(dev), w.to(dev).to(x.dtype)
    bank = {n: a.to(dev) for n, a in bank.items()}
    groups = RouteGroups.of(ids)
    want = accumulate(x, groups, grouped_partials(x, w, groups, {e: WeightRef(bank, int(slot[e]), fmt)
                                                                for e in groups.experts}))
    got = grouped_moe(x, ids, w, bank, slot.to(dev), fmt, pair_dtype=torch.promote_types(x.dtype, w.dtype))
    if not torch.equal(got, want):
        return [f"device prefill path differs from the grouped path: max {float((got - want).abs().max()):.3e}"]
    fp32 = grouped_moe(x, ids, w, bank, slot.to(dev), fmt)  # float32 pair outputs: a different rounding
    if torch.equal(fp32, want):
        return ["float32 pair outputs equal the bf16 ones: the comparison cannot tell the paths apart"]
    return []


# --------------------------------------------------------------------------- interpreter
FP4_CASES = ["nvfp4", "mxfp4"]


def _worker(out_path: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    from moestream.moe import grouped

    # MOESTREAM_GROUPED_FP4=elem: only the FP4 cases, whose tiles that setting decodes element by element
    cases = CASES if grouped.FP4_GROUPS else FP4_CASES
    write_case_results(cases, check_case, out_path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return interpreted_results(__file__, tmp_path_factory, timeout=900)


@pytest.mark.parametrize("case", list(CASES))
def test_interpreted_grouped(interpreted, case):
    assert_case(interpreted, case)


@pytest.fixture(scope="module")
def interpreted_fp4_elem(tmp_path_factory):
    return interpreted_results(__file__, tmp_path_factory, timeout=900, env={"MOESTREAM_GROUPED_FP4": "elem"})


@pytest.mark.parametrize("case", FP4_CASES)
def test_interpreted_fp4_tiles_element_by_element(interpreted_fp4_elem, case):
    """The NVFP4 / MXFP4 tiles decoded element by element (MOESTREAM_GROUPED_FP4=elem; the default decodes them a
    scale group at a time, 2.3-3.3x faster on an H100) give the same oracle agreement (a nibble order swapped fails
    both)."""
    assert interpreted_fp4_elem.keys() == set(FP4_CASES)
    assert_case(interpreted_fp4_elem, case)


def block_table_oracle(counts: torch.Tensor, rows: torch.Tensor, bm: int, max_blocks: int) -> torch.Tensor:
    """grouped.block_table in torch ops: per expert in order, ceil(count / bm) blocks (row, first, end)."""
    out, first = [], 0
    for c, r in zip(counts.tolist(), rows.tolist()):
        if r >= 0:
            out += [[r, first + j * bm, first + c] for j in range(-(-c // bm))]
        first += c
    out += [[-1, -1, -1]] * (max_blocks - len(out))
    return torch.tensor(out, dtype=torch.int32)


def test_block_table_oracle():
    t = block_table_oracle(torch.tensor([3, 0, 20, 5, 17]), torch.tensor([4, 1, -1, 0, 2]), 16, 5 + 4)
    want = [[4, 0, 3], [0, 23, 28], [2, 28, 45], [2, 44, 45]] + [[-1, -1, -1]] * 5  # end: the expert's end
    assert t.tolist() == want


def check_block_table(device: str) -> list[str]:
    from moestream.moe.grouped import block_table

    g = torch.Generator().manual_seed(7)
    errs = []
    for n_exp, bm, t in ((5, 16, 40), (37, 16, 300), (256, 32, 512), (3, 64, 1)):
        counts = torch.randint(0, t + 1, (n_exp,), generator=g)
        counts[0] = 0
        rows = torch.randint(-1, 3 * n_exp, (n_exp,), generator=g)
        max_blocks = -(-int(counts.sum()) // bm) + n_exp
        got = block_table(counts.to(device), rows.to(device), bm, max_blocks, t).cpu()
        if not torch.equal(got, block_table_oracle(counts, rows, bm, max_blocks)):
            errs.append(f"block table differs for {n_exp} experts, bm={bm}")
    return errs


def test_supports():
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    from moestream.moe.formats import dense_format, gguf_expert_format, hf_expert_format
    from moestream.moe.grouped import supports
    from moestream.quant import FP8_BLOCK, MXFP4

    bf16 = torch.bfloat16
    assert supports(None, 2048, 512, bf16) and supports(dense_format(bf16), 2048, 512, bf16)
    assert not supports(dense_format(torch.float16), 2048, 512, bf16)  # weights in another dtype
    assert not supports(None, 2048, 512, torch.float32)
    assert not supports(None, 2048, 500, bf16)  # I not a multiple of the K step
    assert supports(None, 64, 32, bf16)  # tiny test models: K step 32
    q4km = gguf_expert_format({"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}, 2048, 512)
    assert supports(q4km, 2048, 512, bf16)
    assert not supports(gguf_expert_format({"gate": "Q4_K", "up": "Q4_K", "down": "Q4_K"}, 256, 128), 256, 128, bf16)
    iq3 = gguf_expert_format({"gate": "IQ3_S", "up": "IQ3_S", "down": "IQ3_S"}, 2048, 512)
    assert supports(iq3, 2048, 512, bf16)
    assert supports(gguf_expert_format({"gate": "IQ1_S", "up": "IQ1_S", "down": "TQ2_0"}, 2048, 512), 2048, 512, bf16)
    assert not supports(gguf_expert_format({"gate": "Q4_K", "up": "Q5_K", "down": "Q6_K"}, 2048, 512), 2048, 512, bf16)
    fp8 = hf_expert_format(FP8_BLOCK, {f"{p}.{n}": torch.uint8 for p in ("gate", "up", "down")
                                       for n in ("weight", "weight_scale_inv")}, 2048, 512)
    assert supports(fp8, 2048, 512, bf16) and not supports(fp8, 2048, 512, torch.float32)
    tiny = hf_expert_format(FP8_BLOCK, {f"{p}.{n}": torch.uint8 for p in ("gate", "up", "down")
                                        for n in ("weight", "weight_scale_inv")}, 64, 32)
    assert supports(tiny, 64, 32, bf16)  # one partial 128x128 block a matrix (the tiny test checkpoints)
    mx = hf_expert_format(MXFP4, {f"{p}.{n}": torch.uint8 for p in ("gate", "up", "down")
                                  for n in ("blocks", "scales")}, 2048, 528)
    assert not supports(mx, 2048, 528, bf16)  # 528 columns of down: not whole 32-column scale groups


# --------------------------------------------------------------------------- compiled for sm_90 (no GPU needed)
_VARIANTS = {"bf16": None, "Q8_0": "Q8_0", "Q8_0R": "Q8_0R", "Q4_K": "Q4_K", "Q6_K": "Q6_K", "fp8_block": "hf", "nvfp4": "hf",
             "mxfp4": "hf"}


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("variant", list(_VARIANTS))
def test_kernels_compile_for_sm90_with_tensor_cores(variant):
    from types import SimpleNamespace

    from moestream.layers.triton_ops import DRIVER_STACK_LIMIT
    from moestream.moe import grouped as G
    from moestream.quant import gguf_format

    q = _VARIANTS[variant]
    w = "*u8" if q else "*bf16"
    scales = {"sg": w, "sg_stride": "i64", "gg": w, "gg_stride": "i64", "su": w, "su_stride": "i64", "gu": w,
              "gu_stride": "i64"}
    if q == "hf":
        qfmt = _hf_spec(variant)[0]
        consts = G._hf_consts(SimpleNamespace(qfmt=qfmt))
        sdt = "*fp32" if variant == "fp8_block" else "*u8"
        gdt = "*fp32" if variant == "nvfp4" else w
        scales = {"sg": sdt, "sg_stride": "i64", "gg": gdt, "gg_stride": "i64", "su": sdt, "su_stride": "i64",
                  "gu": gdt, "gu_stride": "i64"}
    else:
        consts = G._gguf_consts(gguf_format(q)) if q else dict(G._DENSE)
    tiles = {"BM": 32, "BN": G.CONFIG["bn"], "BK": G.CONFIG["bk"], "F32": False, "H": 2048, "I": 512}
    opts = {"num_warps": G.CONFIG["num_warps"], "num_stages": G.CONFIG["num_stages"]}
    gu_sig = {"x": "*bf16", "pairs": "*i64", "blocks": "*i32", "wg": w, "g_stride": "i64", "wu": w, "u_stride": "i64",
              "u_off": "i64", **scales, "lut": "*fp32", "h": "*bf16", "KTOP": "i32"}
    d_sig = {"h": "*bf16", "pairs": "*i64", "blocks": "*i32", "topk_w": "*fp32", "wd": w, "w_stride": "i64",
             "sd": scales["sg"], "sd_stride": "i64", "gd": scales["gg"], "gd_stride": "i64", "lut": "*fp32",
             "out": "*fp32"}
    for fn, sig, extra in ((G._gate_up_kernel, gu_sig, {}), (G._down_kernel, d_sig, {"SCATTER": True})):
        c = {**consts, **tiles, **extra}
        k = compile_sm90(fn, {**sig, **{n: "constexpr" for n in c}}, c, opts)
        assert "mma" in k.asm["ptx"], f"{fn.__name__} does not use tensor cores"
        assert frame_bytes(k) <= DRIVER_STACK_LIMIT, (fn.__name__, frame_bytes(k))  # tests/test_triton_frames.py


# --------------------------------------------------------------------------- CUDA
cuda = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs an NVIDIA GPU and triton")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_grouped(case):
    errs = check_case(case, "cuda")
    assert not errs, f"{case}: " + "; ".join(errs)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("case", ["bf16", "Q4_K-Q6_K-padded-rows"])
def test_cuda_device_experts_take_the_grouped_path(case, monkeypatch):
    """DeviceExperts.compute on CUDA: one bank -> the grouped kernels (no per-expert loop), and the
    layer result (accumulate) equals the reference; MOESTREAM_TRITON=0 gives the loop back."""
    from moestream.moe import compute

    x, ids, w, bank, slot, fmt, ref_w = build_case(case)
    dev = torch.device("cuda")
    x, ids, w = x.to(dev), ids.to(dev), w.to(dev)
    bank = {n: a.to(dev) for n, a in bank.items()}
    groups = compute.RouteGroups.of(ids)
    refs = {e: compute.WeightRef(bank, int(slot[e]), fmt) for e in groups.experts}
    monkeypatch.setattr(compute, "partial_outputs", lambda *a: pytest.fail("took the per-expert loop"))
    partials = compute.DeviceExperts().compute(x, w, groups, refs)
    assert set(partials.values()) == {compute.IN_PAIR_OUT}
    ref = reference(x.cpu(), ids.cpu(), w.cpu(), ref_w)
    assert not check(compute.accumulate(x, groups, partials), ref, x.dtype, case)
    monkeypatch.undo()
    monkeypatch.setenv("MOESTREAM_TRITON", "0")
    groups = compute.RouteGroups.of(ids)
    partials = compute.DeviceExperts().compute(x, w, groups, refs)
    assert all(isinstance(p, torch.Tensor) for p in partials.values())
    assert not check(compute.accumulate(x, groups, partials), ref, x.dtype, case + " loop")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("qtype", ["bf16", "Q8_0", "Q4_K"])
def test_cuda_qwen36_layer_shape(qtype):
    """H=2048, I=512, 32 experts, top-8 of 96 tokens: int64 offsets, many blocks per expert, vs the loop."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    import grouped_bench as B
    from moestream.moe.compute import RouteGroups, WeightRef, accumulate, partial_outputs
    from moestream.moe.grouped import grouped_moe

    dev = torch.device("cuda")
    bank, fmt = B.make_bank(qtype, dev, experts=32)
    g = torch.Generator(device=dev).manual_seed(3)
    x = torch.randn(96, B.H, device=dev, generator=g, dtype=torch.bfloat16)
    ids = torch.rand(96, 32, device=dev, generator=g).topk(8, dim=1).indices
    w = torch.softmax(torch.randn(96, 8, device=dev, generator=g), -1)
    y = grouped_moe(x, ids, w, bank, torch.arange(32, device=dev), fmt)
    groups = RouteGroups.of(ids)
    loop = accumulate(x, groups, partial_outputs(x, w, groups, {e: WeightRef(bank, e, fmt) for e in groups.experts}))
    rel, mx = errors(y, loop.double().cpu())
    assert rel < 1e-2 and mx < 2e-2, (rel, mx)  # both round weights and h to bf16, in different orders


@pytest.mark.cuda
@cuda
def test_cuda_backends_equal_fused_through_the_grouped_path(tiny_checkpoint, monkeypatch):
    """bf16 tiny Qwen3 (H=64, I=32: K step 32): prefill chunks of every GPU backend take the grouped
    kernels (counted), and offload gives fused's greedy tokens (a pair's value does not depend on which
    bank or call computed it; k-order sums everywhere). Hybrid is left out: its CPU experts round bf16
    differently."""
    from moestream import LLM, SamplingParams
    from moestream.moe import grouped

    calls = []
    real = grouped.grouped_pairs
    monkeypatch.setattr(grouped, "grouped_pairs", lambda *a, **k: calls.append(1) or real(*a, **k))
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    common = dict(device="cuda", dtype="bfloat16", chunked_prefill_size=7, max_running_requests=4)
    prompts = [[5 + i for i in range(n)] for n in (4, 17, 30)]

    def tokens(backend, **kw):
        llm = LLM(tiny_checkpoint("qwen3"), moe_backend=backend, **common, **kw)
        out = [o.token_ids for o in llm.generate(prompts, sp)]
        llm.engine.runtime.close()
        return out

    want = tokens("fused")
    assert calls, "fused prefill did not take the grouped kernels"
    for backend, kw in [("offload", {"moe_cache_size": 3, "moe_prefetch": "on"}),
                        ("offload", {"moe_cache_size": 5, "moe_prefetch": "off"})]:
        calls.clear()
        assert tokens(backend, **kw) == want, backend
        assert calls, f"{backend} did not take the grouped kernels"


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        _worker(sys.argv[2])
    else:
        sys.exit("usage: python tests/test_grouped.py --worker OUT.json (run the tests with pytest)")

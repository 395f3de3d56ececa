"""The Gated DeltaNet prefill chunk kernel (triton_ops.gdn_chunk_scan, taken by chunk_gated_delta_rule on
CUDA) against the torch loop over chunks it replaces: outputs, final state and the prefix-cache snapshot
states (`states_at`, computed from the chunk-start states the kernel writes).

* Interpreter: all cases run once in a subprocess with TRITON_INTERPRET=1, on CPU tensors (kernel=True).
* sm_75 / sm_86 / sm_90: the kernel compiled by the real compiler at the Qwen3.6 shape (no GPU needed) with
  the launch chosen for that GPU: it must fit in shared memory and spill no more than the driver's default
  stack limit.
* CUDA: the full shape (H = 32, Dk = Dv = 128, L = 512) against the loop; skipped without a GPU.

Tolerance: the largest error relative to the largest value of each tensor, 1e-4 (fp32 throughout;
the kernel sums the products in another order than torch's matmuls). Measured under the interpreter: <= 3e-7.

Run as a script (`python tests/test_gdn_triton.py --worker OUT.json`) it is the interpreter worker.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the worker runs as a script: find moestream
sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_harness import (HAS_TRITON, assert_case, compile_sm90, frame_bytes, interpreted_results,  # noqa: E402
                            write_case_results)

from moestream.layers import triton_ops  # noqa: E402
from moestream.layers.gdn import _chunk_terms, _l2norm, chunk_gated_delta_rule  # noqa: E402

RTOL = 1e-4


def _inputs(H, Dk, Dv, L, device="cpu", seed=0):
    """Normalised q (scaled) and k, decays in [-1, 0) per token (some near 1, some strong), beta in (0, 1)."""
    g = torch.Generator().manual_seed(seed)
    q = _l2norm(torch.randn(H, L, Dk, generator=g)) * Dk ** -0.5
    k = _l2norm(torch.randn(H, L, Dk, generator=g))
    v = torch.randn(H, L, Dv, generator=g)
    gate = -torch.rand(H, L, generator=g) ** 2
    beta = torch.rand(H, L, generator=g)
    state = torch.randn(H, Dk, Dv, generator=g) * 0.3
    return [t.to(device) for t in (q, k, v, gate, beta, state)]


def _rel_err(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def compare(H, Dk, Dv, L, states_at, device="cpu", prep: bool = False) -> list[str]:
    """The kernel path (the scan kernel after the torch terms, or after gdn_chunk_prep: prep) vs the loop: errors
    beyond RTOL, as messages."""
    import os

    args = _inputs(H, Dk, Dv, L, device)
    old = os.environ.get("MOESTREAM_GDN_PREP")
    os.environ["MOESTREAM_GDN_PREP"] = "1" if prep else "0"
    try:
        o1, s1, m1 = chunk_gated_delta_rule(*args, states_at=states_at, kernel=True)
    finally:
        if old is None:
            del os.environ["MOESTREAM_GDN_PREP"]
        else:
            os.environ["MOESTREAM_GDN_PREP"] = old
    o0, s0, m0 = chunk_gated_delta_rule(*args, states_at=states_at, kernel=False)
    errs = [] if o1.shape == o0.shape and len(m1) == len(m0) else [f"shapes {o1.shape} {o0.shape} {len(m1)}"]
    pairs = [("out", o1, o0), ("final state", s1, s0)] + [(f"state after {e}", a, b)
                                                           for e, a, b in zip(states_at, m1, m0)]
    for name, got, want in pairs:
        e = _rel_err(got, want)
        if not e <= RTOL:  # also catches nan
            errs.append(f"{name}: relative error {e:.2e}")
    if torch.equal(s1, args[-1]):
        errs.append("final state == initial state")
    return errs


def compare_prep(H, Dk, Dv, L, states_at, device="cpu", strided=True, precision=None) -> list[str]:
    """triton_ops.gdn_chunk_prep against `_chunk_terms` term by term (strided: q, k, v, g, beta as the layer hands
    them over, transposed views of [L, H, ...] rows), then chunk_gated_delta_rule with both kernels
    against the loop: errors beyond RTOL, as messages."""
    q, k, v, g, beta, state = _inputs(H, Dk, Dv, L, device, seed=1)
    if strided:
        q, k, v = (x.transpose(0, 1).contiguous().transpose(0, 1) for x in (q, k, v))
        g, beta = (x.t().contiguous().t() for x in (g, beta))
    got = triton_ops.gdn_chunk_prep(q, k, v, g, beta, 64, precision=precision)
    _, c, u0, w, qk, q_dec, k_dec, last = _chunk_terms(q, k, v, g, beta, 64)
    errs = []
    for name, a, b in zip(("c", "u0", "w", "q_dec", "k_dec", "qk", "last"), got, (c, u0, w, q_dec, k_dec, qk, last)):
        e = _rel_err(a, b) if a.shape == b.shape else float("nan")
        if not e <= RTOL:
            errs.append(f"prep {name}: {tuple(a.shape)} vs {tuple(b.shape)}, relative error {e:.2e}")
    return errs + compare(H, Dk, Dv, L, states_at, device, prep=True)


# --------------------------------------------------------------------------- interpreter cases
CASES = {  # (H, Dk, Dv, L, states_at): L = 1, within, at and just past a chunk, several chunks with a tail
    "L1": (2, 32, 32, 1, [1]),
    "L63": (3, 32, 64, 63, [1, 30, 63]),
    "L64": (4, 64, 64, 64, [64]),
    "L65": (2, 64, 32, 65, [65, 64, 1]),
    "L200": (3, 32, 64, 200, [1, 64, 100, 129, 192, 200]),
    "L200-no-snapshots": (2, 64, 64, 200, []),
    "L130-Dv128": (2, 32, 128, 130, [128]),  # 4 blocks of value dims
}
PREP_CASES = {  # the same shapes through gdn_chunk_prep (with the scan kernel after it)
    "prep-L1": (2, 32, 32, 1, [1]),
    "prep-L64": (2, 64, 32, 64, [64, 3]),
    "prep-L130": (3, 32, 64, 130, [1, 65, 130]),
    "prep-L200-no-snapshots": (2, 64, 128, 200, []),
}
# the launch GPUs before Hopper get (gdn_prep_launch: FMA dots, head dims in 16-column blocks; the interpreter's own
# capability picks the Hopper one): consumer Ampere / Ada cards run this form
PREP_IEEE_CASES = {"prep-ieee-L130": (3, 32, 64, 130, [1, 65, 130]), "prep-ieee-L64-Dk128": (2, 128, 128, 64, [64])}


def _worker(out_path: str) -> None:
    def run(case):
        if case in CASES:
            return compare(*CASES[case])
        if case in PREP_CASES:
            return compare_prep(*PREP_CASES[case])
        return compare_prep(*PREP_IEEE_CASES[case], precision="ieee")

    write_case_results({**CASES, **PREP_CASES, **PREP_IEEE_CASES}, run, out_path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return interpreted_results(__file__, tmp_path_factory)


@pytest.mark.parametrize("case", list(CASES))
def test_interpreted_kernel_equals_loop(interpreted, case):
    assert_case(interpreted, case)


@pytest.mark.parametrize("case", list(PREP_CASES) + list(PREP_IEEE_CASES))
def test_interpreted_prep_kernel_equals_chunk_terms(interpreted, case):
    assert_case(interpreted, case)


def test_prep_kernel_by_default_with_the_scan(monkeypatch):
    """gdn_chunk_prep is taken by default, and only with the scan kernel (never for CPU tensors);
    MOESTREAM_GDN_PREP=0 keeps the torch terms."""
    calls = []
    monkeypatch.setattr(triton_ops, "gdn_chunk_prep", lambda *a, **k: calls.append(1) or 1 / 0)
    args = _inputs(2, 32, 32, 70)
    monkeypatch.setenv("MOESTREAM_GDN_PREP", "0")
    monkeypatch.setattr(triton_ops, "gdn_chunk_scan", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # the scan kernel, after the torch terms
        chunk_gated_delta_rule(*args, kernel=True)
    assert calls == []
    monkeypatch.delenv("MOESTREAM_GDN_PREP")
    chunk_gated_delta_rule(*args)  # CPU tensors: the loop, no kernel
    assert calls == []
    with pytest.raises(ZeroDivisionError):
        chunk_gated_delta_rule(*args, kernel=True)
    assert calls == [1]


def test_cpu_tensors_take_the_loop(monkeypatch):
    """By default CPU tensors never reach the kernel (production gating: CUDA and Triton enabled)."""
    def boom(*a, **k):
        raise AssertionError("kernel called for CPU tensors")

    monkeypatch.setattr(triton_ops, "gdn_chunk_scan", boom)
    args = _inputs(2, 32, 32, 70)
    o, s, m = chunk_gated_delta_rule(*args, states_at=[10])
    o0, s0, m0 = chunk_gated_delta_rule(*args, states_at=[10], kernel=False)
    assert torch.equal(o, o0) and torch.equal(s, s0) and torch.equal(m[0], m0[0])


def test_shape_gate():
    assert triton_ops.gdn_chunk_ok(128, 128, 64) == HAS_TRITON
    assert not triton_ops.gdn_chunk_ok(96, 128, 64)  # not a power of two
    assert not triton_ops.gdn_chunk_ok(8, 128, 64)  # below tl.dot's 16
    assert not triton_ops.gdn_chunk_ok(128, 128, 32)


# --------------------------------------------------------------------------- sm_90
SIG = {**{p: "*fp32" for p in ("u0_ptr", "w_ptr", "qd_ptr", "qk_ptr", "kd_ptr", "last_ptr", "s0_ptr", "out_ptr",
                               "sn_ptr", "starts_ptr")},
       "snap_ptr": "*i32", "N": "i32", "H": "i32",
       **{c: "constexpr" for c in ("DK", "DV", "C", "BV", "SNAP", "PREC", "N_STATIC")}}
SM90_SHARED = 227 * 1024  # an H100/H200 block's most dynamic shared memory


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("arch", [75, 86, 90])
@pytest.mark.parametrize("snap", [False, True])
def test_kernel_compiles_within_shared_memory_and_without_a_big_frame(arch, snap):
    """The launch chosen for each GPU generation fits its shared memory and spills no more than the driver's
    default stack limit: a bigger frame would make the driver reserve frame x every thread the GPU holds
    (1.57 GiB on an H200 at the first launch's 7.2 KB), memory no plan counts."""
    launch = triton_ops.gdn_chunk_launch((arch // 10, arch % 10))
    consts = {"DK": 128, "DV": 128, "C": 64, "BV": launch.pop("bv"), "SNAP": snap,
              "PREC": launch.pop("precision"), "N_STATIC": 0}
    k = compile_sm90(triton_ops._gdn_chunk_kernel, SIG, consts, launch, arch=arch)
    assert f".target sm_{arch}" in k.asm["ptx"]
    assert k.metadata.shared <= (SM90_SHARED if arch >= 90 else 99 * 1024), k.metadata.shared
    assert frame_bytes(k) <= triton_ops.DRIVER_STACK_LIMIT, frame_bytes(k)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_frame_check_sees_a_spilling_launch():
    """The frame test can fail: ieee (FMA) dots at bv 32 with 4 warps spill kilobytes per thread."""
    consts = {"DK": 128, "DV": 128, "C": 64, "BV": 32, "SNAP": False, "PREC": "ieee", "N_STATIC": 0}
    k = compile_sm90(triton_ops._gdn_chunk_kernel, SIG, consts, {"num_warps": 4, "num_stages": 1})
    assert frame_bytes(k) > 4 * triton_ops.DRIVER_STACK_LIMIT


PREP_SIG = {**{p: "*fp32" for p in ("q_ptr", "k_ptr", "v_ptr", "g_ptr", "b_ptr", "u0_ptr", "w_ptr", "qk_ptr", "qd_ptr",
                                    "kd_ptr", "last_ptr", "c_ptr")},
            **{a: "i32" for a in ("L", "N", "sq_h", "sq_l", "sk_h", "sk_l", "sv_h", "sv_l", "sg_h", "sg_l", "sb_h",
                                  "sb_l")},
            **{c: "constexpr" for c in ("DK", "DV", "C", "PREC", "BD")}}


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("arch,precision", [(75, None), (86, None), (90, None), (90, "ieee"), (90, "tf32x3")])
def test_prep_kernel_compiles_within_shared_memory_and_without_a_big_frame(arch, precision):
    """The prep kernel at the Qwen3.6 shape with each generation's launch (and a forced precision, as the tests'
    GDN_CHUNK_PRECISION): within shared memory, no big frame."""
    launch = triton_ops.gdn_prep_launch((arch // 10, arch % 10), precision)
    consts = {"DK": 128, "DV": 128, "C": 64, "PREC": launch.pop("precision"), "BD": launch.pop("bd")}
    k = compile_sm90(triton_ops._gdn_prep_kernel, PREP_SIG, consts, launch, arch=arch)
    assert f".target sm_{arch}" in k.asm["ptx"]
    assert k.metadata.shared <= (SM90_SHARED if arch >= 90 else 99 * 1024), k.metadata.shared
    assert frame_bytes(k) <= triton_ops.DRIVER_STACK_LIMIT, frame_bytes(k)


FRONT_SIG = {**{p: "*bf16" for p in ("mixed_ptr", "conv_ptr", "convw_ptr", "braw_ptr", "a_ptr")},
             **{p: "*fp32" for p in ("alog_ptr", "dtb_ptr", "q_ptr", "k_ptr", "v_ptr", "g_ptr", "beta_ptr")},
             **{a: "i32" for a in ("MIXED_STRIDE", "B_STRIDE", "A_STRIDE", "L", "KEY_DIM", "HV", "REP")},
             "scale": "fp32", **{c: "constexpr" for c in ("DK", "DV", "KW", "BT")}}


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("arch", [75, 86, 90])
def test_front_kernel_compiles_without_a_big_frame(arch):
    """The GDN prefill front (triton_ops.gdn_prefill_front) at the Qwen3.6 shape, bf16 rows: no big frame."""
    k = compile_sm90(triton_ops._gdn_front_kernel, FRONT_SIG, {"DK": 128, "DV": 128, "KW": 4, "BT": 16},
                     {"num_warps": 4, "num_stages": 1}, arch=arch)
    assert f".target sm_{arch}" in k.asm["ptx"]
    assert frame_bytes(k) <= triton_ops.DRIVER_STACK_LIMIT, frame_bytes(k)


def test_front_kernel_is_opt_in(monkeypatch):
    """MOESTREAM_GDN_FRONT=1 alone sends a prefill through gdn_prefill_front, and only where the decode kernel's
    gate holds (CUDA, Triton, its shapes): CPU tensors keep the torch front."""
    from moestream.layers.gdn import GatedDeltaNet

    m = GatedDeltaNet(64, 2, 4, 32, 64, 4, 1e-6)
    mixed, conv = torch.zeros(3, m.conv_dim), torch.zeros(2, m.conv_dim, 3)
    monkeypatch.delenv("MOESTREAM_GDN_FRONT", raising=False)
    monkeypatch.setattr(m, "_triton_decode", lambda mixed, conv_state: True)
    assert not m._triton_front(mixed, conv)
    monkeypatch.setenv("MOESTREAM_GDN_FRONT", "1")
    assert m._triton_front(mixed, conv)
    monkeypatch.setattr(m, "_triton_decode", lambda mixed, conv_state: False)
    assert not m._triton_front(mixed, conv)
    monkeypatch.undo()
    monkeypatch.setenv("MOESTREAM_GDN_FRONT", "1")
    assert not m._triton_front(mixed, conv)  # CPU tensors


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_prep_frame_check_sees_a_spilling_launch():
    """The prep frame test can fail: ieee dots in column blocks of 32 spill kilobytes a thread on sm_90."""
    consts = {"DK": 128, "DV": 128, "C": 64, "PREC": "ieee", "BD": 32}
    k = compile_sm90(triton_ops._gdn_prep_kernel, PREP_SIG, consts, {"num_warps": 8, "num_stages": 1})
    assert frame_bytes(k) > 2 * triton_ops.DRIVER_STACK_LIMIT


# --------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs an NVIDIA GPU and triton")
@pytest.mark.parametrize("precision", ["ieee", "tf32x3"])
@pytest.mark.parametrize("check", [compare, compare_prep], ids=["scan", "prep"])
def test_cuda_full_shape_equals_loop(monkeypatch, precision, check):
    """Qwen3.6's GDN shape, pp512 with snapshots, vs the loop (torch matmuls in full fp32, no TF32): the scan kernel
    after the torch terms, and (prep) the prep kernel's terms against the torch terms, then both kernels."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(triton_ops, "GDN_CHUNK_PRECISION", precision)
    assert triton_ops.enabled(torch.empty(1, device="cuda")) and triton_ops.gdn_chunk_ok(128, 128, 64)
    errs = check(32, 128, 128, 512, [100, 256, 512], device="cuda")
    assert not errs, errs


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs an NVIDIA GPU and triton")
def test_cuda_front_kernel_qwen36_layer(monkeypatch):
    """A Qwen3.6-shaped GDN layer (16 key / 32 value heads of 128, bf16) prefilling 300 tokens with snapshots: the
    front kernel (MOESTREAM_GDN_FRONT=1) against the torch front, outputs and states."""
    from moestream.layers.gdn import GatedDeltaNet

    torch.manual_seed(0)
    m = GatedDeltaNet(2048, 16, 32, 128, 128, 4, 1e-6).to("cuda", torch.bfloat16)
    for p in m.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    L = 300
    fused = torch.randn(L, m.conv_dim + m.value_dim + 2 * m.hv, device="cuda").to(torch.bfloat16) * 2
    mixed, _, b, a = torch.split(fused, [m.conv_dim, m.value_dim, m.hv, m.hv], dim=-1)
    conv = torch.randn(4, m.conv_dim, 3, device="cuda").to(torch.bfloat16)
    rec = torch.randn(4, m.hv, m.dk, m.dv, device="cuda") * 0.1
    snaps = [(64, 1), (299, 3)]
    c1, r1 = conv.clone(), rec.clone()
    o1 = m._prefill_front(mixed, b, a, 2, c1, r1, snaps)
    c2, r2 = conv.clone(), rec.clone()
    g, beta = m._gates(b, a)
    o2 = m._prefill_one(mixed, g, beta, 2, c2, r2, None, snaps)
    assert torch.equal(c1, c2)
    torch.testing.assert_close(r1, r2, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(o1.float(), o2.float(), rtol=3e-2, atol=3e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs an NVIDIA GPU and triton")
def test_cuda_default_path_is_the_kernel(monkeypatch):
    calls = []
    real = triton_ops.gdn_chunk_scan
    monkeypatch.setattr(triton_ops, "gdn_chunk_scan", lambda *a, **k: calls.append(1) or real(*a, **k))
    chunk_gated_delta_rule(*_inputs(4, 128, 128, 100, "cuda"))
    assert calls == [1]


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker(sys.argv[sys.argv.index("--worker") + 1])

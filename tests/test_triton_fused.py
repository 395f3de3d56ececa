"""The decode-step fusions of layers/triton_ops.py against their torch references:
router softmax + top-k (+ renormalisation), shared-expert silu(gate) * up (alone, and with the down projection in
the same launch), the MoE combine + residual,
the Gated DeltaNet decode kernel computing its own gates from the raw projections (on views of a fused
projection), the gated RMSNorm reading its gate through a strided view, and the decoder's residual add
fused into the post-attention RMSNorm, the MoE combine with the next layer's input norm, and attention's q/k norm + rotary + KV-cache write.

* Interpreter: all cases run once in a subprocess with TRITON_INTERPRET=1, on CPU tensors.
* sm_90: each kernel is compiled by the real compiler (no GPU needed).
* CUDA: the kernels recorded in a CUDA graph and replayed on new inputs; skipped without a GPU.

Tolerances: float32 cases agree to ~1e-6 relative (exp/log differ by an ulp between libraries). The
kernels round 16-bit values at the same points as torch; on CUDA (round to nearest even) outputs agree to
one unit in the last place. The interpreter truncates float32 -> bfloat16 (numpy has no bfloat16), so
its bf16 cases allow two units per rounding point (BF16_INTERP).
Router ids are compared exactly where the probabilities have no ties (float32 logits).

Run as a script (`python tests/test_triton_fused.py --worker OUT.json`) it is the interpreter worker.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the worker runs as a script: find moestream
sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_harness import HAS_TRITON, assert_case, compile_sm90, interpreted_results, write_case_results  # noqa: E402

from moestream.layers import triton_ops  # noqa: E402
from moestream.layers.attention import kv_write  # noqa: E402
from moestream.layers.gdn import GatedDeltaNet  # noqa: E402
from moestream.layers.norm import GatedRMSNorm, RMSNorm  # noqa: E402

BF16_ULP = dict(rtol=2 ** -7, atol=1e-6)  # one bf16 ulp relative
BF16_INTERP = dict(rtol=2 ** -5, atol=1e-6)  # truncation at up to two rounding points (module docstring)
F32 = dict(rtol=2e-6, atol=1e-7)


def _close(name, got, want, tol) -> list[str]:
    try:
        torch.testing.assert_close(got.float(), want.float(), **tol)
        return []
    except AssertionError as e:
        return [f"{name}: {str(e).splitlines()[0:4]}"]


# --------------------------------------------------------------------------- cases
def case_route(T, E, k, normalize, dtype) -> list[str]:
    g = torch.Generator().manual_seed(E * 31 + k)
    logits = (torch.randn(T, E, generator=g) * 2).to(dtype)
    ids, w = triton_ops.route_topk(logits, k, normalize)
    rids, rw = triton_ops.route_topk_torch(logits, k, normalize)
    errs = [] if ids.dtype == rids.dtype and w.dtype == rw.dtype else [f"dtypes {ids.dtype} {w.dtype}"]
    if dtype == torch.float32:  # no ties: the same experts in the same order
        if not torch.equal(ids, rids):
            errs.append(f"ids {ids.tolist()} != {rids.tolist()}")
        return errs + _close("weights", w, rw, F32)
    # 16-bit logits can tie: the chosen probabilities must be the reference's (ids may swap within a tie)
    probs = torch.softmax(logits, -1, dtype=torch.float32)
    errs += _close("chosen probabilities", probs.gather(1, ids), probs.gather(1, rids), F32)
    return errs + _close("weights", w, rw, BF16_INTERP)


def case_silu_mul(dtype) -> list[str]:
    g = torch.Generator().manual_seed(1)
    inter = 96  # not a power of two: masked tail
    gu = (torch.randn(3, 2 * inter + 1, generator=g) * 3).to(dtype)  # gate | up | shared-expert gate logit
    got = triton_ops.silu_mul(gu, inter, force=True)
    return _close("silu_mul", got, triton_ops.silu_mul_torch(gu, inter), F32 if dtype == torch.float32 else BF16_INTERP)


def case_shared_down(T, dtype) -> list[str]:
    """silu(gate) * up and the down projection in one launch against silu_mul then an fp32 GEMM of the same
    rounded activations: each product's error is bounded by the activations' rounding (two bf16 units under the
    interpreter's truncation: 2^-6 of |h| |w| summed) plus the output's one rounding."""
    g = torch.Generator().manual_seed(11 + T)
    inter, N = 96, 80  # neither a multiple of the kernel's blocks: masked tails in k and n
    gu = (torch.randn(T, 2 * inter + 1, generator=g) * 2).to(dtype)
    w = (torch.randn(N, inter, generator=g) / inter ** 0.5).to(dtype)
    assert triton_ops.shared_down_ok(gu, inter, w, force=True)
    got = triton_ops.shared_down(gu, inter, w, force=True).float()
    h = triton_ops.silu_mul_torch(gu, inter).float()
    want = h @ w.float().t()
    bound = 2 ** -6 * (h.abs() @ w.float().abs().t()) + 2 ** -7 * want.abs() + 1e-6
    err = (got - want).abs()
    return [] if got.shape == want.shape and bool((err <= bound).all()) else \
        [f"shared_down: max err {float(err.max()):.3g}, worst err/bound {float((err / bound).max()):.3g}"]


def case_combine(dtype, residual: bool) -> list[str]:
    g = torch.Generator().manual_seed(2)
    T, N = 3, 80
    y, s, r = (torch.randn(T, N, generator=g).to(dtype) for _ in range(3))
    gate = torch.randn(T, 7, generator=g).to(dtype)[:, 6:]  # a strided [T, 1] column, as in the fused GEMM
    got = triton_ops.gated_combine(y, s, gate, r if residual else None, force=True)
    want = triton_ops.gated_combine_torch(y, s, gate, r if residual else None)
    # sums cancel: a rounding error of an addend (|addend| < 4 here) is absolute, not relative to the sum
    return _close("combine", got, want, F32 if dtype == torch.float32 else dict(BF16_INTERP, atol=2 ** -5))


def case_combine_norm(dtype, zero_centered) -> list[str]:
    """The combine with the next layer's input RMSNorm in the same launch: h and norm(h) against torch."""
    g = torch.Generator().manual_seed(7)
    T, N = 3, 80  # not a power of two: masked tail inside the one block of a row
    y, s, r = (torch.randn(T, N, generator=g).to(dtype) for _ in range(3))
    gate = torch.randn(T, 7, generator=g).to(dtype)[:, 6:]
    n = RMSNorm(N, 1e-6, zero_centered).to(dtype)
    torch.nn.init.normal_(n.weight, 0.3, 0.2)
    assert triton_ops.gated_combine_norm_ok(y, s, r, force=True)
    h, xn = triton_ops.gated_combine_norm(y, s, gate, r, n.weight, n.eps, zero_centered)
    hr = triton_ops.gated_combine_torch(y, s, gate, r)
    tol = F32 if dtype == torch.float32 else dict(BF16_INTERP, atol=2 ** -5)
    # the norm of the kernel's own h (the reference h may differ by the tolerance above)
    return _close("h", h, hr, tol) + _close("norm", xn, n(h), tol)


def _gdn(dtype):
    torch.manual_seed(0)
    m = GatedDeltaNet(64, 2, 4, 32, 64, 4, 1e-6).to(dtype)
    for p in m.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    torch.nn.init.normal_(m.dt_bias, 0, 3.0)  # softplus over a wide range, both sides of the threshold
    return m


def case_gdn_raw_gates(dtype, state_dtype) -> list[str]:
    """Kernel with the gates computed inside from b/a views of one fused product vs _gates + torch _decode."""
    m = _gdn(dtype)
    B, slots_n, K = 3, 5, m.kernel
    g = torch.Generator().manual_seed(3)
    fused = (torch.randn(B, m.conv_dim + m.value_dim + 2 * m.hv, generator=g) * 2).to(dtype)
    mixed, _, b, a = torch.split(fused, [m.conv_dim, m.value_dim, m.hv, m.hv], dim=-1)
    a = a * 8  # wide softplus range (a copy: contiguous, the unfused layout)
    conv = torch.randn(slots_n, m.conv_dim, K - 1, generator=g).to(dtype)
    rec = (torch.randn(slots_n, m.hv, m.dk, m.dv, generator=g) * 0.1).to(state_dtype)
    slots = torch.tensor([4, 0, 2])
    c1, r1, o1 = conv.clone(), rec.clone(), torch.empty(B, m.hv, m.dv, dtype=dtype)
    triton_ops.gdn_decode(mixed, c1, m.conv1d.weight[:, 0, :], slots, None, None, r1, o1, m.key_dim, m.hk, m.hv,
                          m.dk, m.dv, raw_gates=(b, a, m.A_log, m.dt_bias))
    c2, r2, o2 = conv.clone(), rec.clone(), torch.empty(B, m.hv, m.dv, dtype=dtype)
    gg, beta = m._gates(b, a)
    m._decode(mixed, gg, beta, slots, c2, r2, o2)  # torch path: CPU tensors
    tol = F32 if dtype == torch.float32 and state_dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    tol = dict(rtol=1e-4, atol=1e-5) if tol is F32 else tol  # a recurrence of reductions: summation order
    errs = _close("out", o1, o2, tol) + _close("rec", r1, r2, tol) + _close("conv", c1, c2, dict(rtol=0, atol=0))
    untouched = [1, 3]
    if not (torch.equal(c1[untouched], conv[untouched]) and torch.equal(r1[untouched], rec[untouched])):
        errs.append("states of other slots changed")
    return errs


def case_gdn_prefill_front(dtype, state_dtype, L, snapshots) -> list[str]:
    """triton_ops.gdn_prefill_front inside GatedDeltaNet._prefill_front against _gates + _prefill_one (the torch
    front) on one slot: the chunk's output, the slot's conv window (bit for bit) and recurrent state, the snapshots'
    windows and states; L from 1 (shorter than the conv's K-1 kept inputs) to past a 64-token chunk. b, a are views of
    a fused projection row, as the layer passes them."""
    m = _gdn(dtype)
    slots_n, K = 6, m.kernel
    g = torch.Generator().manual_seed(11)
    fused = (torch.randn(L, m.conv_dim + m.value_dim + 2 * m.hv, generator=g) * 2).to(dtype)
    mixed, _, b, a = torch.split(fused, [m.conv_dim, m.value_dim, m.hv, m.hv], dim=-1)
    conv = torch.randn(slots_n, m.conv_dim, K - 1, generator=g).to(dtype)
    rec = (torch.randn(slots_n, m.hv, m.dk, m.dv, generator=g) * 0.1).to(state_dtype)
    snaps = [(e, dst) for e, dst in zip(snapshots, (1, 3, 5))]
    c1, r1 = conv.clone(), rec.clone()
    o1 = m._prefill_front(mixed, b, a, 2, c1, r1, snaps)
    c2, r2 = conv.clone(), rec.clone()
    gg, beta = m._gates(b, a)
    o2 = m._prefill_one(mixed, gg, beta, 2, c2, r2, None, snaps)
    f32 = dtype == torch.float32 and state_dtype == torch.float32
    # bf16: the interpreter truncates at the two rounding points where torch rounds to nearest (the points themselves:
    # case_gdn_front_rounding, bit for bit)
    tol = dict(rtol=1e-4, atol=1e-5) if f32 else dict(rtol=3e-2, atol=3e-2)
    errs = _close("out", o1, o2, tol) + _close("rec", r1, r2, tol) + _close("conv", c1, c2, dict(rtol=0, atol=0))
    if not (torch.equal(c1[[0, 4]], conv[[0, 4]]) and torch.equal(r1[[0, 4]], rec[[0, 4]])):
        errs.append("states of other slots changed")
    if torch.equal(c1[2], conv[2]):
        errs.append("the slot's conv window did not move")
    return errs


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _round_probe_kernel(x_ptr, y_ptr):
        tl.store(y_ptr, tl.load(x_ptr).to(tl.bfloat16).to(tl.float32))


def _as_backend_rounds(x: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16 -> float32 as this Triton backend converts (the interpreter truncates; a GPU rounds to
    nearest even): found from a probe the backend converts, so the reference rounds where and as the kernel does."""
    probe = torch.tensor([1.0 + 2 ** -8 + 2 ** -12], dtype=torch.float32)  # past half an ulp: truncation keeps 1.0
    got = torch.empty(1, dtype=torch.float32)
    _round_probe_kernel[(1,)](probe, got)
    if float(got) == 1.0:
        return (x.float().contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32)
    return x.to(torch.bfloat16).float()


def case_gdn_front_rounding() -> list[str]:
    """The front's 16-bit rounding points: the conv's sums rounded to the rows' dtype (F.conv1d's bf16 output), then
    SiLU rounded again, as the torch front (and HF) computes them; v, which only the conv and SiLU touch, must equal
    that reference bit for bit, and must not equal the one-rounding form (SiLU of the fp32 sums) the kernel had when a
    bf16 model's prefill logits came out 15 % from HF bf16's on an H100 (thirty-seventh session)."""
    m = _gdn(torch.bfloat16)
    L, K = 40, m.kernel
    g = torch.Generator().manual_seed(5)
    fused = (torch.randn(L, m.conv_dim + m.value_dim + 2 * m.hv, generator=g) * 2).to(torch.bfloat16)
    mixed, _, b, a = torch.split(fused, [m.conv_dim, m.value_dim, m.hv, m.hv], dim=-1)
    kept = torch.randn(m.conv_dim, K - 1, generator=g).to(torch.bfloat16)
    _, _, v, _, _ = triton_ops.gdn_prefill_front(mixed, kept, m.conv1d.weight[:, 0, :], b, a, m.A_log, m.dt_bias,
                                                 m.key_dim, m.hk, m.hv, m.dk, m.dv)
    window = torch.cat([kept, mixed.t()], dim=-1).float()
    sums = torch.nn.functional.conv1d(window.unsqueeze(0), m.conv1d.weight.float(), groups=m.conv_dim)[0].t()
    r = _as_backend_rounds
    errs = []
    for name, out in (("two roundings", r(torch.nn.functional.silu(r(sums)))),
                      ("one rounding", r(torch.nn.functional.silu(sums)))):
        want = out[:, 2 * m.key_dim:].unflatten(-1, (m.hv, m.dv)).transpose(0, 1)
        same = torch.equal(v, want)
        if same != (name == "two roundings"):
            errs.append(f"v {'equals' if same else 'differs from'} the {name} reference")
    return errs


def case_gated_norm_strided(dtype) -> list[str]:
    """GatedRMSNorm's gate as GatedDeltaNet passes it: z [T, Hv, Dv] inside a wider fused row."""
    g = torch.Generator().manual_seed(4)
    T, hv, dv = 3, 4, 64
    n = GatedRMSNorm(dv, 1e-6).to(dtype)
    torch.nn.init.normal_(n.weight, 1.0, 0.2)
    x = torch.randn(T, hv, dv, generator=g).to(dtype)
    z = torch.randn(T, 7 + hv * dv + 5, generator=g).to(dtype)[:, 7:7 + hv * dv].unflatten(-1, (hv, dv))
    got = triton_ops.rms_norm(x, n.weight, n.eps, False, z)
    return _close("gated norm", got, n(x, z), F32 if dtype == torch.float32 else BF16_INTERP)


def case_add_rms_norm(dtype, zero_centered) -> list[str]:
    """The decoder's residual add fused into the post-attention norm: both outputs against torch."""
    g = torch.Generator().manual_seed(5)
    n = RMSNorm(96, 1e-6, zero_centered).to(dtype)
    torch.nn.init.normal_(n.weight, 0.3, 0.2)
    x, r = (torch.randn(3, 96, generator=g).to(dtype) for _ in range(2))
    y, h = triton_ops.add_rms_norm(x, r, n.weight, n.eps, zero_centered)
    yr, hr = n.add_forward(x, r)  # CPU tensors: the torch path
    errs = [] if torch.equal(h, hr) or dtype != torch.float32 else ["h != r + x"]
    tol = F32 if dtype == torch.float32 else BF16_INTERP
    return errs + _close("h", h, hr, tol) + _close("norm", y, yr, dict(tol, atol=2 ** -6))


def case_qk_norm_rope_cache(dtype, zero_centered, output_gate, rotary_dim, cache_dtype) -> list[str]:
    """Attention's q/k norm + rotary + KV write (one kernel) against the module's torch path, on q/k/v views
    of one fused projection row (Qwen3.5: [query | gate] per head)."""
    from moestream.layers.attention import Attention
    from moestream.layers.rotary import Rotary

    torch.manual_seed(6)
    T, H, Hk, D, hidden = 3, 4, 2, 64, 32
    a = Attention(hidden, H, Hk, D, 1e-6, output_gate, zero_centered).to(dtype)
    for n in (a.q_norm, a.k_norm):
        torch.nn.init.normal_(n.weight, 0.2, 0.3)
    rot = Rotary(rotary_dim, 1e4, 64, "cpu", dtype)
    qw = H * D * (2 if output_gate else 1)
    row = (torch.randn(T, qw + 2 * Hk * D + 3) * 2).to(dtype)  # + 3: the fused row is wider than q | k | v
    q, k, v = torch.split(row[:, :qw + 2 * Hk * D], [qw, Hk * D, Hk * D], dim=-1)
    q = q.view(T, H, 2 * D)[..., :D] if output_gate else q.view(T, H, D)
    k, v = k.view(T, Hk, D), v.view(T, Hk, D)
    pos, write = torch.tensor([5, 0, 63]), torch.tensor([7, 2, 4])
    caches = [torch.zeros(9, Hk, D, dtype=cache_dtype) for _ in range(4)]
    got = triton_ops.qk_norm_rope_cache(q, k, v, a.q_norm.weight, a.k_norm.weight, a.q_norm.eps, zero_centered, rot,
                                        pos, write, caches[0], caches[1])
    want, kr = rot.apply(a.q_norm(q.reshape(T, H, D)), a.k_norm(k), pos)
    kv_write(caches[2], write, kr)
    kv_write(caches[3], write, v)
    tol = F32 if dtype == torch.float32 else BF16_INTERP
    tol = dict(tol, atol=2 ** -6 if dtype != torch.float32 else 1e-6)  # rotary sums cancel
    errs = _close("q", got, want, tol)
    if cache_dtype == torch.float8_e4m3fn:
        # a key the kernel rounds one bf16 ulp apart may land on the neighbouring fp8 code (2^-3 relative); the value
        # is only encoded: its bytes are the torch path's
        tol = dict(rtol=2 ** -3, atol=2 ** -8)
        caches = [c.view(torch.uint8) if i % 2 else c.float() for i, c in enumerate(caches)]
    errs += _close("k cache", caches[0], caches[2], tol)
    if not torch.equal(caches[1], caches[3]):
        errs.append("v cache differs")
    return errs


CASES = {
    "route-E256-k8-norm": lambda: case_route(5, 256, 8, True, torch.float32),
    "route-E512-k16": lambda: case_route(3, 512, 16, False, torch.float32),
    "route-E60-k4-norm": lambda: case_route(4, 60, 4, True, torch.float32),  # E not a power of two
    "route-E128-k8-bf16": lambda: case_route(6, 128, 8, True, torch.bfloat16),
    "silu_mul-f32": lambda: case_silu_mul(torch.float32),
    "silu_mul-bf16": lambda: case_silu_mul(torch.bfloat16),
    "shared-down-3-bf16": lambda: case_shared_down(3, torch.bfloat16),
    "shared-down-16-bf16": lambda: case_shared_down(16, torch.bfloat16),  # the most rows one launch takes
    "shared-down-1-f16": lambda: case_shared_down(1, torch.float16),
    "combine-residual-f32": lambda: case_combine(torch.float32, True),
    "combine-residual-bf16": lambda: case_combine(torch.bfloat16, True),
    "combine-bf16": lambda: case_combine(torch.bfloat16, False),
    "combine-norm-f32": lambda: case_combine_norm(torch.float32, False),
    "combine-norm-zc-bf16": lambda: case_combine_norm(torch.bfloat16, True),
    "combine-norm-bf16": lambda: case_combine_norm(torch.bfloat16, False),
    "gdn-raw-gates-f32": lambda: case_gdn_raw_gates(torch.float32, torch.float32),
    "gdn-raw-gates-bf16": lambda: case_gdn_raw_gates(torch.bfloat16, torch.float32),
    "gdn-front-L1-f32": lambda: case_gdn_prefill_front(torch.float32, torch.float32, 1, []),
    "gdn-front-L2-snap1-f32": lambda: case_gdn_prefill_front(torch.float32, torch.float32, 2, [1]),
    "gdn-front-L37-f32": lambda: case_gdn_prefill_front(torch.float32, torch.float32, 37, [5, 36]),
    "gdn-front-L70-bf16": lambda: case_gdn_prefill_front(torch.bfloat16, torch.float32, 70, [1, 64, 69]),
    "gdn-front-L20-bf16-state": lambda: case_gdn_prefill_front(torch.bfloat16, torch.bfloat16, 20, []),
    "gdn-front-rounding-bf16": case_gdn_front_rounding,
    "gated-norm-strided-f32": lambda: case_gated_norm_strided(torch.float32),
    "gated-norm-strided-bf16": lambda: case_gated_norm_strided(torch.bfloat16),
    "add-rms-norm-f32": lambda: case_add_rms_norm(torch.float32, False),
    "add-rms-norm-zc-f32": lambda: case_add_rms_norm(torch.float32, True),
    "add-rms-norm-bf16": lambda: case_add_rms_norm(torch.bfloat16, False),
    "add-rms-norm-zc-bf16": lambda: case_add_rms_norm(torch.bfloat16, True),
    # Qwen3.5/3.6: zero-centred norms, output gate, partial rotary (a quarter of the head)
    "qk-rope-qwen35-bf16": lambda: case_qk_norm_rope_cache(torch.bfloat16, True, True, 16, torch.bfloat16),
    "qk-rope-qwen35-f32": lambda: case_qk_norm_rope_cache(torch.float32, True, True, 16, torch.float32),
    # Qwen3: plain norms, full rotary; a float32 cache under bf16 activations
    "qk-rope-qwen3-bf16": lambda: case_qk_norm_rope_cache(torch.bfloat16, False, False, 64, torch.float32),
    "qk-rope-qwen3-f32": lambda: case_qk_norm_rope_cache(torch.float32, False, False, 64, torch.float32),
    # --kv-cache-dtype fp8: the key and value encoded in the kernel (fp8_encode) as kv_write encodes them
    "qk-rope-qwen35-bf16-fp8": lambda: case_qk_norm_rope_cache(torch.bfloat16, True, True, 16, torch.float8_e4m3fn),
    "qk-rope-qwen3-f32-fp8": lambda: case_qk_norm_rope_cache(torch.float32, False, False, 64, torch.float8_e4m3fn),
}


def _worker(out_path: str) -> None:
    write_case_results(CASES, lambda case: CASES[case](), out_path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return interpreted_results(__file__, tmp_path_factory)


@pytest.mark.parametrize("case", list(CASES))
def test_interpreted_equals_torch(interpreted, case):
    assert_case(interpreted, case)


def test_cpu_tensors_take_the_torch_path(monkeypatch):
    """Without CUDA (or with MOESTREAM_TRITON=0) the wrappers are their torch references."""
    gu = torch.randn(2, 9)
    y, s = torch.randn(2, 4), torch.randn(2, 4)
    assert torch.equal(triton_ops.silu_mul(gu, 4), triton_ops.silu_mul_torch(gu, 4))
    w = torch.randn(5, 4)
    assert not triton_ops.shared_down_ok(gu, 4, w)
    assert torch.equal(triton_ops.shared_down(gu, 4, w), triton_ops.silu_mul_torch(gu, 4) @ w.t())
    assert torch.equal(triton_ops.gated_combine(y, s, gu[:, 8:], y), triton_ops.gated_combine_torch(y, s, gu[:, 8:], y))


def test_shared_down_takes_the_fused_launch_only_when_asked(tiny_checkpoint, monkeypatch):
    """MOESTREAM_SHARED_DOWN=1 sends the shared expert's activation + down projection of every decode call the kernel
    takes to triton_ops.shared_down (stood in for here by its torch reference: a CPU has no Triton launch); unset,
    never. The tokens are the same either way."""
    from moestream import LLM, SamplingParams

    calls = []

    def stand_in(gu, inter, w, force=False):
        calls.append(gu.shape[0])
        return triton_ops.silu_mul_torch(gu, inter) @ w.t()

    monkeypatch.setattr(triton_ops, "shared_down_ok", lambda gu, inter, w, force=False: gu.shape[0] <= 16)
    monkeypatch.setattr(triton_ops, "shared_down", stand_in)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("MOESTREAM_SHARED_DOWN", flag)
        calls.clear()
        llm = LLM(tiny_checkpoint("qwen35"), device="cpu", dtype="bfloat16", moe_backend="fused")
        tokens[flag] = llm.generate([[3, 5, 7]], sp)[0].token_ids
        if flag == "0":
            assert not calls
        else:  # the 3-row prompt's call and the decode steps' 1-row calls
            assert calls and set(calls) <= {1, 3} and 1 in calls
    assert tokens["0"] == tokens["1"]


# --------------------------------------------------------------------------- sm_90
RMS_SIG = {**{p: "*bf16" for p in ("x_ptr", "w_ptr", "g_ptr", "y_ptr", "r_ptr", "h_ptr")}, "N": "i32", "eps": "fp32",
           "G_INNER": "i32", "G_STRIDE": "i32", **{c: "constexpr" for c in ("ZERO_CENTERED", "GATED", "ADD", "BLOCK")}}
QK_SIG = {**{p: "*bf16" for p in ("q_ptr", "k_ptr", "v_ptr", "qw_ptr", "kw_ptr", "cos_ptr", "sin_ptr", "qout_ptr",
                                   "kc_ptr", "vc_ptr")}, "pos_ptr": "*i64", "write_ptr": "*i64",
          **{p: "i32" for p in ("H", "HK", "Q_T", "Q_H", "K_T", "V_T")}, "eps": "fp32",
          **{c: "constexpr" for c in ("D", "RD", "ZERO_CENTERED")}}
COMBINE_SIG = {**{p: "*bf16" for p in ("y_ptr", "s_ptr", "gate_ptr", "r_ptr", "out_ptr", "nw_ptr", "n_ptr")},
               "N": "i32", "GATE_STRIDE": "i32", "eps": "fp32",
               **{c: "constexpr" for c in ("RESIDUAL", "NORM", "ZERO_CENTERED", "BLOCK")}}
SM90 = {
    "route": lambda: (triton_ops._route_topk_kernel,
                      {"logits_ptr": "*bf16", "ids_ptr": "*i64", "w_ptr": "*bf16", "E": "i32", "STRIDE": "i32",
                       "K": "constexpr", "KP": "constexpr", "NORMALIZE": "constexpr", "BLOCK_E": "constexpr"},
                      {"K": 8, "KP": 8, "NORMALIZE": True, "BLOCK_E": 256}),
    "route-512-16": lambda: (triton_ops._route_topk_kernel,
                             {"logits_ptr": "*bf16", "ids_ptr": "*i64", "w_ptr": "*bf16", "E": "i32", "STRIDE": "i32",
                              "K": "constexpr", "KP": "constexpr", "NORMALIZE": "constexpr", "BLOCK_E": "constexpr"},
                             {"K": 16, "KP": 16, "NORMALIZE": False, "BLOCK_E": 512}),
    "silu_mul": lambda: (triton_ops._silu_mul_kernel,
                         {"gu_ptr": "*bf16", "out_ptr": "*bf16", "INTER": "i32", "STRIDE": "i32", "BLOCK": "constexpr"},
                         {"BLOCK": 512}),
    "shared-down": lambda: (triton_ops._shared_down_kernel,
                            {"gu_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "T": "i32", "STRIDE": "i32",
                             "N": "i32", **{c: "constexpr" for c in ("INTER", "BT", "BN", "BK")}},
                            {"INTER": 512, "BT": 16, "BN": 16, "BK": 128}),
    "combine": lambda: (triton_ops._gated_combine_kernel, COMBINE_SIG,
                        {"RESIDUAL": True, "NORM": False, "ZERO_CENTERED": False, "BLOCK": 1024}),
    "combine-norm": lambda: (triton_ops._gated_combine_kernel, COMBINE_SIG,
                             {"RESIDUAL": True, "NORM": True, "ZERO_CENTERED": True, "BLOCK": 2048}),
    "gdn-raw-gates": lambda: (triton_ops._gdn_decode_kernel,
                              {**{p: "*bf16" for p in ("mixed_ptr", "conv_ptr", "convw_ptr", "out_ptr", "a_ptr",
                                                       "braw_ptr", "alog_ptr", "dtb_ptr")},
                               "slots_ptr": "*i64", "g_ptr": "*fp32", "beta_ptr": "*fp32", "rec_ptr": "*fp32",
                               **{p: "i32" for p in ("CONV_DIM", "KEY_DIM", "HV", "REP", "MIXED_STRIDE", "A_STRIDE",
                                                     "B_STRIDE")},
                               "scale": "fp32", **{c: "constexpr" for c in ("DK", "DV", "KW", "BV", "RAW_GATES")}},
                              {"DK": 128, "DV": 128, "KW": 4, "BV": 32, "RAW_GATES": True}),
    "gated-norm": lambda: (triton_ops._rms_kernel, RMS_SIG, {"ZERO_CENTERED": False, "GATED": True, "ADD": False,
                                                             "BLOCK": 128}),
    "qk-norm-rope-cache": lambda: (triton_ops._qk_norm_rope_cache_kernel, QK_SIG,
                                   {"D": 256, "RD": 64, "ZERO_CENTERED": True}),
    "add-rms-norm": lambda: (triton_ops._rms_kernel, RMS_SIG, {"ZERO_CENTERED": True, "GATED": False, "ADD": True,
                                                               "BLOCK": 2048}),
}


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("name", list(SM90))
def test_kernel_compiles_for_sm90(name):
    fn, sig, consts = SM90[name]()
    k = compile_sm90(fn, sig, consts)
    assert ".target sm_90" in k.asm["ptx"]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_shared_down_kernel_stays_within_the_default_frame():
    """The new one-launch shared expert (not in tests/data/triton_launches_qwen36_sm90.json, recorded before it):
    no local memory past the driver's default stack frame at the Qwen3.6 shape (tests/test_triton_frames.py)."""
    from triton_harness import frame_bytes

    fn, sig, consts = SM90["shared-down"]()
    assert frame_bytes(compile_sm90(fn, sig, consts)) <= triton_ops.DRIVER_STACK_LIMIT


# --------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs an NVIDIA GPU and triton")
def test_cuda_graph_replay_equals_torch():
    """route_topk, silu_mul and gated_combine recorded once, replayed on new inputs, equal to torch."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    T, E, k, inter, H = 4, 256, 8, 512, 2048
    logits = torch.randn(T, E, device=dev, dtype=dt)
    gu = torch.randn(T, 2 * inter + 1, device=dev, dtype=dt)
    y, s, r = (torch.randn(T, H, device=dev, dtype=dt) for _ in range(3))

    wd = torch.randn(H, inter, device=dev, dtype=dt) / inter ** 0.5

    def step():
        ids, w = triton_ops.route_topk(logits, k, True)
        return (ids, w, triton_ops.silu_mul(gu, inter), triton_ops.gated_combine(y, s, gu[:, 2 * inter:], r),
                triton_ops.shared_down(gu, inter, wd))

    step()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(3):
        for t in (logits, gu, y, s, r):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        rids, rw = triton_ops.route_topk_torch(logits, k, True)
        probs = torch.softmax(logits, -1, dtype=torch.float32)
        assert not _close("probs", probs.gather(1, outs[0]), probs.gather(1, rids), F32)
        assert not _close("w", outs[1], rw, BF16_ULP)
        assert not _close("act", outs[2], triton_ops.silu_mul_torch(gu, inter), BF16_ULP)
        assert not _close("combine", outs[3], triton_ops.gated_combine_torch(y, s, gu[:, 2 * inter:], r),
                             dict(BF16_ULP, atol=2 ** -6))
        want = triton_ops.silu_mul_torch(gu, inter).float() @ wd.float().t()  # the same rounded activations
        assert not _close("shared_down", outs[4], want, dict(BF16_ULP, atol=2 ** -6))


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker(sys.argv[sys.argv.index("--worker") + 1])

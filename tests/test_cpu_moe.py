"""One compiled call per MoE layer for the CPU's (token, expert) pairs (kernels/cpu_quant.moe_layer,
moe/cpu_moe.py): against a float64 reference, against the per-matmul kernel it fuses, independent of
which pairs share a call, refusing bad input, and wired into every CPU path with fused's tokens."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moestream.kernels import cpu_quant
from moestream.moe.swiglu import reference, swiglu
from moestream.quant import gguf_format
from test_cpu_kernels import _quantized_x, _weights, act_block

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="CPU quant kernels could not be built here")

H, I, E = 512, 256, 4
MIXES = [("Q8_0",) * 3, ("Q4_K", "Q4_K", "Q6_K"), ("Q4_1", "Q5_0", "Q5_K"), ("Q5_1", "Q4_0", "Q8_0"),
         ("BF16", "F16", "Q4_0"), ("IQ4_XS", "IQ4_XS", "MXFP4"), ("MXFP4", "IQ4_NL", "IQ3_S")]
SHAPES = ((I, H), (I, H), (H, I))


def _banks(types, seed=0):
    return [_weights(t, E * n, k, seed=seed + j).reshape(E, -1) for j, (t, (n, k)) in enumerate(zip(types, SHAPES))]


def _ptrs(banks, experts):
    return np.stack([b.data_ptr() + np.asarray(experts) * b.stride(0) for b in banks], 1)


# a layer call: 3 experts, 5 pairs over 3 x rows, outputs written out of order
EXPERTS, STARTS, ROWS, DST = np.array([2, 0, 3]), np.array([0, 2, 3, 5]), np.array([0, 2, 1, 0, 1]), np.array([4, 1, 0, 2, 3])


def _call(types, banks, x, w, h_dtype=torch.float32, force_scalar=False, experts=EXPERTS, starts=STARTS, rows=ROWS,
          dst=DST, n_out=5):
    out = torch.full((n_out, H), float("nan"))
    return cpu_quant.moe_layer(x, _ptrs(banks, experts), types, starts, rows, w, dst, out, I, h_dtype=h_dtype,
                               force_scalar=force_scalar)


def _dequant(types, banks, e):
    return [gguf_format(t).dequantize(b[e], s, torch.float64) for t, b, s in zip(types, banks, SHAPES)]


def _round_x(t, v):
    return v.double() if t in ("F16", "BF16") else _quantized_x(v, act_block(t))[0]


@pytest.mark.parametrize("force_scalar", [False, True])
@pytest.mark.parametrize("types", MIXES)
def test_layer_call_matches_float64_model(types, force_scalar):
    """Exact model: x and h rounded to int8 per 32 as the kernel does, float64 products; the kernel agrees
    to float32 accumulation error (catches any unpacking, grouping, scatter or weight bug). Against the
    true float64 MLP the error stays within the activation rounding (a few % of the output scale)."""
    banks = _banks(types)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(1))
    w = np.random.default_rng(2).random(5).astype(np.float32)
    y = _call(types, banks, x, w, force_scalar=force_scalar).double()
    for g in range(3):
        wg, wu, wd = _dequant(types, banks, EXPERTS[g])
        for p in range(STARTS[g], STARTS[g + 1]):
            xr = x[ROWS[p]:ROWS[p] + 1]
            gv, uv = _round_x(types[0], xr) @ wg.T, _round_x(types[1], xr) @ wu.T
            h = swiglu(gv, uv).float()
            ref = (_round_x(types[2], h) @ wd.T)[0] * float(w[p])
            scale = (h.double().abs() @ wd.abs().T)[0] * float(w[p])  # float32 rounding scale of the down sums
            err = (y[DST[p]] - ref).abs()
            # g/u carry float32 error into h (and so into h's int8 rounding): 1e-4 of the scale is ample
            assert (err <= 1e-4 * scale + 1e-30).all(), (types, p, (err / scale).max().item())
            true = reference(xr, wg, wu, wd) * float(w[p])
            rel = ((y[DST[p]] - true[0]).norm() / true.norm()).item()
            assert rel < 0.05, (types, p, rel)


def _torch_silu_is_libm() -> bool:
    """Whether torch's float32 silu rounds like g / (1 + expf(-g)) of the C library: true of its AVX2 kernels
    (checked bit for bit by the test below on AVX2 machines), not of its AVX-512 ones."""
    return torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AMX")


@pytest.mark.parametrize("types", MIXES)
def test_layer_call_equals_the_matmuls_it_fuses(types):
    """The composition of three qmatmul calls with torch's silu (what QuantPairMlp computed): bit for bit
    where torch's silu rounds like the C library's expf (AVX2 builds of torch); torch's AVX-512 silu (the H200
    host) differs in the last bit of some h values, and a last-bit change of h can move one of its int8 codes
    for the down projection, so there the bound is that one code step of h times the down weights' scale."""
    banks = _banks(types, seed=5)
    x = torch.randn(3, H)
    w = np.random.default_rng(0).random(5).astype(np.float32)
    y = _call(types, banks, x, w)
    for g in range(3):
        e = EXPERTS[g]
        for p in range(STARTS[g], STARTS[g + 1]):
            xr = x[ROWS[p]:ROWS[p] + 1]
            gv, uv = (cpu_quant.qmatmul(xr, banks[j][e].reshape(I, -1), types[j]) for j in (0, 1))
            h = swiglu(gv, uv)
            ref = cpu_quant.qmatmul(h, banks[2][e].reshape(H, -1), types[2])[0] * w[p]
            if _torch_silu_is_libm():
                assert torch.equal(y[DST[p]], ref), (types, p)
            else:
                wd = _dequant(types, banks, e)[2].abs()
                step = float(h.abs().max()) / 127 * w[p]  # one int8 code of h (per-32 or per-256 scale)
                assert ((y[DST[p]] - ref).abs() <= 2 * step * wd.max(1).values + 1e-6 * ref.abs().max()).all()


@pytest.mark.parametrize("h_dtype", [torch.bfloat16, torch.float16])
def test_h_rounded_to_the_activation_dtype(h_dtype):
    types = ("Q8_0", "Q8_0", "BF16")  # a float down projection: h enters it exactly as rounded
    banks = _banks(types)
    x = torch.randn(3, H).to(h_dtype)
    y = _call(types, banks, x, None, h_dtype=h_dtype)
    wd = _dequant(types, banks, EXPERTS[0])[2]
    xr = x[ROWS[0]:ROWS[0] + 1].float()
    gv, uv = (cpu_quant.qmatmul(xr, banks[j][EXPERTS[0]].reshape(I, -1), "Q8_0") for j in (0, 1))
    h = swiglu(gv, uv, h_dtype)
    scale = (h.double().abs() @ wd.abs().T)[0]  # float32 rounding scale of the down sums
    assert ((y[DST[0]].double() - (h.double() @ wd.T)[0]).abs() <= 2e-6 * scale).all()
    h32 = swiglu(gv, uv)  # unrounded h gives a different answer: the rounding is really there
    assert ((y[DST[0]].double() - (h32.double() @ wd.T)[0]).abs() > 2e-6 * scale).any()


def test_pairs_do_not_depend_on_their_company():
    """A pair's output is the same whether its expert shares the call with others, alone, or with more rows
    (placements split a layer's experts differently; they must agree bit for bit)."""
    types = ("Q4_K", "Q4_K", "Q6_K")
    banks = _banks(types)
    x = torch.randn(6, H)
    w = np.linspace(0.1, 1, 9).astype(np.float32)
    rows = np.array([0, 1, 2, 3, 4, 5, 0, 3, 5])
    full = _call(types, banks, x, w, experts=np.array([1, 3]), starts=np.array([0, 6, 9]), rows=rows,
                 dst=np.arange(9), n_out=9)
    alone = _call(types, banks, x, w[6:], experts=np.array([3]), starts=np.array([0, 3]), rows=rows[6:],
                  dst=np.arange(3), n_out=3)
    assert torch.equal(full[6:], alone)
    single = _call(types, banks, x, w[:1], experts=np.array([1]), starts=np.array([0, 1]), rows=rows[:1],
                   dst=np.arange(1), n_out=1)
    assert torch.equal(full[:1], single)


def test_bad_input_is_refused():
    types = ("Q8_0",) * 3
    banks = _banks(types)
    x = torch.randn(3, H)
    with pytest.raises(ValueError, match="out of range"):
        _call(types, banks, x, None, rows=np.array([0, 2, 1, 0, 3]))  # x has 3 rows
    with pytest.raises(ValueError, match="out of range"):
        _call(types, banks, x, None, dst=np.array([4, 1, 0, 2, 5]))  # out has 5 rows
    with pytest.raises(ValueError, match="weights"):
        _call(types, banks, x, np.ones(4, dtype=np.float32))
    with pytest.raises(ValueError, match="groups"):
        _call(types, banks, x, None, starts=np.array([0, 3, 2, 5]))  # decreasing
    with pytest.raises(ValueError, match="lack"):
        cpu_quant.moe_layer(torch.randn(1, 80), _ptrs(banks, [0]), types, np.array([0, 1]), np.array([0]), None,
                            np.array([0]), torch.empty(1, 80), I)  # K=80 is not a whole number of Q8_0 blocks
    with pytest.raises(ValueError, match="x must be"):
        _call(types, banks, torch.randn(3, H, dtype=torch.float64), None)
    with pytest.raises(KeyError):
        _call(("Q8_0", "Q3_K", "Q8_0"), banks, x, None)


def test_cpu_moe_checks_bank_rows():
    from moestream.moe import cpu_moe
    from moestream.moe.formats import gguf_expert_format

    fmt = gguf_expert_format({"gate": "Q8_0", "up": "Q8_0", "down": "Q8_0"}, H, I)
    bank = dict(zip(("gate", "up", "down"), _banks(("Q8_0",) * 3)))
    with pytest.raises(IndexError):
        cpu_moe.expert_ptrs(bank, fmt, np.array([0, E]))
    short = {n: b[:, :-1] for n, b in bank.items()}
    with pytest.raises(ValueError, match="bytes"):
        cpu_moe.expert_ptrs(short, fmt, np.array([0]))


# ---- wired in: every placement policy on a CPU device, kernels on ---------------------------------------
SP_KW = dict(max_tokens=10, temperature=0.0, ignore_eos=True)
COMMON = dict(device="cpu", dtype="float32", chunked_prefill_size=7, max_running_requests=4, moe_cpu_threads=1)
BACKENDS = [
    ("offload", {"moe_cache_size": 3, "moe_prefetch": "on"}),
    ("cpu", {}),
    ("hybrid", {"moe_cache_size": 3, "moe_prefetch": "on"}),
    ("fused", {"moe_decode_kernel": "pairs"}),
    ("offload", {"moe_cache_size": 3, "moe_decode_kernel": "pairs"}),
    ("cpu", {"moe_decode_kernel": "pairs"}),
    ("hybrid", {"moe_cache_size": 3, "moe_decode_kernel": "pairs"}),
]


@pytest.mark.usefixtures("one_torch_thread")
def test_every_backend_gives_fused_tokens_with_the_layer_kernel(tiny_checkpoint, tmp_path, monkeypatch):
    """Q4_K_M-style type mixes per layer (Q8_0 down in even layers), kernels on: every placement runs its
    CPU pairs through the one-call kernel and gives fused's greedy tokens."""
    import gguf_writer
    from gguf import GGMLQuantizationType as Q

    from moestream import LLM, SamplingParams

    def mix(layer, proj):
        return Q.Q8_0 if proj == "down_proj" and layer % 2 == 0 else Q.Q4_1

    path, _ = gguf_writer.write_gguf(tiny_checkpoint("qwen3"), tmp_path / "m.gguf", Q.Q4_1, expert_qtype=mix)
    # the per-op MoE path (a CPU decode step's one-call block, models/cpu_decode.py, has tests/test_cpu_decode.py)
    monkeypatch.setenv("MOESTREAM_CPU_DECODE_LAYER", "0")
    calls = []
    # checked calls, the bridge's per-layer LayerCall, and its compiled worker (all layers of a step in one call)
    for name in ("moe_layer", "moe_layer_unchecked", "bridge_step"):
        real = getattr(cpu_quant, name)
        monkeypatch.setattr(cpu_quant, name, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    sp = SamplingParams(**SP_KW)

    def tokens(llm):
        g = torch.Generator().manual_seed(5)
        ps = [torch.randint(0, llm.model_config.vocab_size, (n,), generator=g).tolist() for n in (4, 17, 30)]
        return [o.token_ids for o in llm.generate(ps, sp)]

    fused = LLM(path, moe_backend="fused", **COMMON)
    want = tokens(fused)
    assert calls, "fused on CPU did not take the layer kernel"
    for backend, kw in BACKENDS:
        calls.clear()
        llm = LLM(path, moe_backend=backend, **COMMON, **kw)
        assert tokens(llm) == want, (backend, kw)
        assert calls, (backend, kw)
        llm.engine.runtime.close()
    # the torch path (kernels off) is a different rounding of the activations, close to the same model
    monkeypatch.setenv("MOESTREAM_CPU_KERNELS", "0")
    calls.clear()
    tokens(LLM(path, moe_backend="cpu", **COMMON))
    assert not calls


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("qname", ["IQ4_XS", "MXFP4", "IQ4_NL"])
def test_codebook_experts_take_the_layer_kernel(qname, tiny_checkpoint, tmp_path, monkeypatch):
    """Routed experts stored as IQ4_XS / MXFP4 / IQ4_NL (hidden and expert widths 256: whole IQ4_XS
    super-blocks) stay in that format, run through the layer kernel with its type id on --moe-backend cpu,
    and give the fused backend's greedy tokens."""
    import gguf_writer
    from gguf import GGMLQuantizationType as Q

    from moestream import LLM, SamplingParams

    hf = tiny_checkpoint("qwen3", hidden_size=256, moe_intermediate_size=256)
    path, _ = gguf_writer.write_gguf(hf, tmp_path / "m.gguf", Q.Q8_0, expert_qtype=lambda layer, proj: Q[qname])
    monkeypatch.setenv("MOESTREAM_CPU_DECODE_LAYER", "0")  # the per-op MoE path
    tid, seen = cpu_quant.TYPES[qname], []
    ids = {"moe_layer": lambda a: [cpu_quant.TYPES[t] for t in a[2]], "moe_layer_unchecked": lambda a: list(a[2]),
           "bridge_step": lambda a: list(np.asarray(a[1]["wtype"]).ravel())}
    for name, get in ids.items():
        real = getattr(cpu_quant, name)
        monkeypatch.setattr(cpu_quant, name,
                            lambda *a, _real=real, _get=get, **k: seen.extend(_get(a)) or _real(*a, **k))
    sp = SamplingParams(**SP_KW)

    def tokens(llm):
        g = torch.Generator().manual_seed(7)
        ps = [torch.randint(0, llm.model_config.vocab_size, (n,), generator=g).tolist() for n in (4, 15)]
        return [o.token_ids for o in llm.generate(ps, sp)]

    want = tokens(LLM(path, moe_backend="fused", **COMMON))
    assert seen and set(seen) == {tid}, seen
    seen.clear()
    llm = LLM(path, moe_backend="cpu", **COMMON)
    assert tokens(llm) == want
    assert seen and set(seen) == {tid}, seen
    llm.engine.runtime.close()


# ---- the CPU bridge's worker (cpu / hybrid decode on a GPU), here on a CPU device -------------------------
class _Store:
    def __init__(self, fmt, banks):
        self.fmt, self.banks, self.moe_layers, self.hidden = fmt, banks, [0], 64

    def bank(self, layer):
        return self.banks


def _bridge_step(store, x, ids, w, cpu, dtype):
    from moestream.moe.bridge import CpuBridge

    bridge = CpuBridge(store, torch.device("cpu"), max_pairs=ids.numel(), dtype=dtype)
    try:
        bridge.begin_step()
        bridge.post(0, x, ids, w, cpu)
        y = torch.full((ids.numel(), x.shape[1]), 7.0)
        bridge.collect(0, y, cpu)
        bridge.end_step()
        bridge.finish_step()
    finally:
        bridge.close()
    return y


def test_bridge_worker_takes_the_layer_call(monkeypatch):
    """GGUF experts: the worker's rows are bit for bit the pair path's CPU dispatch (same kernel, same pairs),
    the GPU's rows untouched; dense bf16 banks: PairMlp's bf16 roundings, within bf16 of the torch GEMMs."""
    from moestream.moe import qpairs
    from moestream.moe.formats import dense_format, gguf_expert_format
    from moestream.moe.pairs import _pair_outputs_torch

    calls = []
    # checked calls, the bridge's per-layer LayerCall, and its compiled worker (all layers of a step in one call)
    for name in ("moe_layer", "moe_layer_unchecked", "bridge_step"):
        real = getattr(cpu_quant, name)
        monkeypatch.setattr(cpu_quant, name, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    h, i, e, k, T = 64, 32, 6, 3, 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g)
    cpu = torch.tensor([1, 0, 1, 1, 1, 0], dtype=torch.bool)

    fmt = gguf_expert_format({"gate": "Q4_1", "up": "Q4_1", "down": "Q8_0"}, h, i)
    banks = {p: _weights(t, e * n, kk, seed=j).reshape(e, -1)
             for j, (p, t, (n, kk)) in enumerate(zip(("gate", "up", "down"), ("Q4_1", "Q4_1", "Q8_0"),
                                                     ((i, h), (i, h), (h, i))))}
    y = _bridge_step(_Store(fmt, banks), x, ids, w, cpu, torch.float32)
    assert calls
    want = qpairs.quant_pair_outputs(x, w, torch.where(cpu, ids.reshape(-1), -1), banks, fmt)
    assert torch.equal(y[cpu], want[cpu]) and torch.all(y[~cpu] == 7.0)

    calls.clear()
    xb = x.to(torch.bfloat16)
    dense = {"gate_up": (torch.randn(e, 2 * i, h, generator=g) * 0.2).to(torch.bfloat16),
             "down": (torch.randn(e, h, i, generator=g) * 0.2).to(torch.bfloat16)}
    y = _bridge_step(_Store(dense_format(torch.bfloat16), dense), xb, ids, w, cpu, torch.bfloat16)
    assert calls
    want = _pair_outputs_torch(xb, w, ids.reshape(-1), dense)
    torch.testing.assert_close(y[cpu], want[cpu], rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    assert torch.all(y[~cpu] == 7.0)


def test_bridge_step_on_the_held_pool_gives_the_same_rows(monkeypatch):
    """A GPU's bridge runs its layer calls on the kernels' pool held spinning for the step (hold_pool): every row
    bit for bit what the same calls give on OpenMP threads. The layer is large enough for several threads."""
    from moestream.moe.formats import gguf_expert_format

    if not cpu_quant.available():
        pytest.skip("CPU kernels not built")
    h, i, e, k, T = 512, 256, 8, 4, 3
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g)
    cpu = torch.ones(T * k, dtype=torch.bool)
    cpu[::5] = False
    types = {"gate": "Q4_K", "up": "Q4_K", "down": "Q8_0"}
    fmt = gguf_expert_format(types, h, i)
    banks = {p: _weights(t, e * n, kk, seed=j).reshape(e, -1)
             for j, (p, t, (n, kk)) in enumerate(zip(("gate", "up", "down"), types.values(), ((i, h), (i, h), (h, i))))}
    store = _Store(fmt, banks)
    store.hidden = h
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # two threads at least, on any machine
    real, held = cpu_quant.bridge_step, []

    def step(*a, hold_pool=False, ahead=(-1, -1), **kw):
        held.append(want_hold)
        aheads.append(ahead)
        return real(*a, hold_pool=want_hold, ahead=ahead, **kw)

    aheads = []

    monkeypatch.setattr(cpu_quant, "bridge_step", step)
    out = {}
    for want_hold in (False, True, False):
        out[want_hold] = _bridge_step(store, x, ids, w, cpu, torch.float32)
    assert held == [False, True, False]
    assert torch.equal(out[True], out[False]) and torch.all(out[True][~cpu] == 7.0)
    assert not torch.all(out[True][cpu] == 7.0)
    # the bridge's layer calls read BRIDGE_AHEAD ahead, unless the env names a read-ahead: then the library's
    from moestream.env import BRIDGE_AHEAD

    assert aheads == [BRIDGE_AHEAD] * 3 and BRIDGE_AHEAD[1] > 2
    monkeypatch.setenv("MOESTREAM_CPU_LAYER_TUNING", "rowsahead=2")
    want_hold = False
    assert torch.equal(_bridge_step(store, x, ids, w, cpu, torch.float32), out[False])
    assert aheads[-1] == (BRIDGE_AHEAD[0], -1)


def test_portable_f16_rounding_matches_f16c(tmp_path):
    """Builds without AVX2 round h to float16 in portable C++: it must round exactly as the F16C instruction
    (nearest even, subnormals, overflow to inf). A small harness built with -mf16c only (so the portable path
    is compiled) compares both on 2M values over float16's whole range and beyond."""
    import shutil
    import subprocess

    from moestream.hardware import cpu_flags

    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None or "f16c" not in cpu_flags():
        pytest.skip("needs a C++ compiler and an F16C CPU")
    src = tmp_path / "rf16.cpp"
    src.write_text(f'#include "{cpu_quant._SRC}"\n' + r'''
#include <immintrin.h>
#include <cstdio>
#include <random>
int main() {
#ifdef MS_AVX2
  return 2;  // the harness must compile the portable path
#endif
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> ex(-30.f, 17.f), m(1.f, 2.f);
  long bad = 0;
  for (int i = 0; i < 2000000; ++i) {
    float f = std::ldexp(m(rng), (int)ex(rng)) * (i & 1 ? -1 : 1);
    if (i % 1000 == 0) f = (float)(i % 7) * 0.5f;
    float a = round_f16(f), b = _cvtsh_ss(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
    bad += std::memcmp(&a, &b, 4) != 0 && !(a == 0 && b == 0);
  }
  std::printf("%ld\n", bad);
  return bad != 0;
}
''')
    exe = tmp_path / "rf16"
    subprocess.run([cxx, "-O2", "-std=c++17", "-mf16c", str(src), "-o", str(exe)], check=True, capture_output=True)
    r = subprocess.run([str(exe)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "0", (r.returncode, r.stdout)


@pytest.mark.parametrize("types", [("Q8_0",) * 3, ("Q4_K", "Q4_K", "Q6_K"), ("BF16", "F16", "Q4_0")])
@pytest.mark.parametrize("n_x", [3, 200])
def test_layer_call_does_not_depend_on_threads(types, n_x):
    """Rows are handed to the threads in chunks from a counter, and each thread quantizes the h rows of the experts
    it reaches: any thread count (and any order the chunks are taken in) gives the same floats. 200 x rows take the
    in-region x pass (a barrier), 3 rows are prepared before the threads start."""
    banks = _banks(types, seed=7)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(n_x, H, generator=gen)
    rows = torch.randint(0, n_x, (3 * n_x,), generator=gen).numpy()
    starts = np.array([0, n_x, n_x + n_x // 2 + 1, 3 * n_x])
    w = np.random.default_rng(9).random(3 * n_x).astype(np.float32)
    args = dict(experts=EXPERTS, starts=starts, rows=rows, dst=np.arange(3 * n_x)[::-1].copy(), n_out=3 * n_x)
    got = []
    try:
        for threads in (1, 2, 3, 7):
            torch.set_num_threads(threads)
            got.append(_call(types, banks, x, w, **args))
    finally:
        torch.set_num_threads(1)
    assert not got[0].isnan().any()
    assert all(torch.equal(y, got[0]) for y in got[1:])


@pytest.mark.parametrize("threads", [2, 3, 7])
def test_own_pool_and_openmp_agree(threads, monkeypatch):
    """The kernels' own thread pool and OpenMP (default) split rows the same way: bit-equal layer calls and
    matmuls at any thread count (more threads than cores too), over many calls in a row (the pool's workers
    go from spinning to sleeping and back: MOESTREAM_CPU_SPIN_US=0 makes every call wake them)."""
    types = ("Q4_K", "Q4_K", "Q6_K")
    banks = _banks(types, seed=3)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(4))
    w = np.random.default_rng(5).random(5).astype(np.float32)
    raw = banks[0][0].reshape(I, -1)
    torch.set_num_threads(threads)
    try:
        got = {}
        for mode, spin in (("omp", "300"), ("pool", "300"), ("pool", "0")):
            monkeypatch.setenv("MOESTREAM_CPU_POOL", mode)
            monkeypatch.setenv("MOESTREAM_CPU_SPIN_US", spin)
            ys = [_call(types, banks, x, w) for _ in range(20)]
            ms = [cpu_quant.qmatmul(x, raw, types[0]) for _ in range(20)]
            assert all(torch.equal(y, ys[0]) for y in ys) and all(torch.equal(m, ms[0]) for m in ms)
            got[(mode, spin)] = (ys[0], ms[0])
        first = got[("omp", "300")]
        for y, m in got.values():
            assert torch.equal(y, first[0]) and torch.equal(m, first[1])
    finally:
        torch.set_num_threads(1)


def test_concurrent_callers_share_the_pool(monkeypatch):
    """Two Python threads calling the kernels at once (MOESTREAM_CPU_POOL=pool): one gets the pool, the other
    runs on OpenMP (the pool takes one job at a time); both get exactly the single-caller results."""
    import threading

    monkeypatch.setenv("MOESTREAM_CPU_POOL", "pool")
    types = ("Q8_0",) * 3
    banks = _banks(types, seed=6)
    xs = [torch.randn(3, H, generator=torch.Generator().manual_seed(7 + i)) for i in range(2)]
    w = np.random.default_rng(8).random(5).astype(np.float32)
    want = [_call(types, banks, x, w) for x in xs]
    bad = []

    def hammer(i):
        torch.set_num_threads(2)
        for _ in range(40):
            if not torch.equal(_call(types, banks, xs[i], w), want[i]):
                bad.append(i)

    ts = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in ts), "a kernel call hung"
    assert not bad


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("BF16", "F16", "Q4_0")])
def test_layer_call_object_equals_run(types):
    """cpu_moe.LayerCall (addresses worked out once per layer, the bridge's per-step call) gives run()'s
    output bit for bit, and refuses an expert outside the bank."""
    from moestream.moe import cpu_moe
    from moestream.moe.formats import GGUFExpertFormat

    banks = _banks(types, seed=9)
    bank = dict(zip(("gate", "up", "down"), banks))
    fmt = GGUFExpertFormat(name="gguf:mix", dtype=torch.bfloat16, hidden=H, inter=I,
                           types=tuple(zip(("gate", "up", "down"), types)))
    x = torch.randn(3, H).to(torch.bfloat16)
    w = np.random.default_rng(10).random(5).astype(np.float32)
    experts, starts = np.sort(EXPERTS), STARTS.astype(np.int64)
    want = cpu_moe.run(x, bank, fmt, experts, starts, ROWS, w, DST, torch.zeros(5, H))
    call = cpu_moe.LayerCall(bank, fmt, x.dtype)
    got = call(x, experts.astype(np.int64), starts, ROWS.astype(np.int64), w, DST.astype(np.int64), torch.zeros(5, H))
    assert torch.equal(got, want)
    with pytest.raises(IndexError):
        call(x, np.array([0, 1, E], dtype=np.int64), starts, ROWS.astype(np.int64), w, DST.astype(np.int64),
             torch.zeros(5, H))


@pytest.mark.usefixtures("one_torch_thread")
def test_bridge_worker_in_c_equals_the_python_loop(tiny_checkpoint, tmp_path, monkeypatch):
    """The cpu backend's decode pairs through the bridge: the compiled worker (one call per step, default) and
    the Python loop (MOESTREAM_BRIDGE_C=0) give the same tokens and count the same experts; the compiled one
    ran (its tables built, the layer seconds counted)."""
    import gguf_writer
    from gguf import GGMLQuantizationType as Q

    from moestream import LLM, SamplingParams

    path, _ = gguf_writer.write_gguf(tiny_checkpoint("qwen3"), tmp_path / "m.gguf", Q.Q4_1,
                                   expert_qtype=lambda layer, proj: Q.Q8_0)
    sp = SamplingParams(**SP_KW)

    def run(flag):
        monkeypatch.setenv("MOESTREAM_BRIDGE_C", flag)
        llm = LLM(path, moe_backend="cpu", moe_decode_kernel="pairs", **COMMON)
        g = torch.Generator().manual_seed(11)
        ps = [torch.randint(0, llm.model_config.vocab_size, (n,), generator=g).tolist() for n in (5, 12, 21)]
        out = [o.token_ids for o in llm.generate(ps, sp)]
        bridge = llm.engine.runtime.bridge
        res = out, list(bridge.cpu_experts), bool(bridge._tables), sum(bridge.kernel_seconds)
        llm.engine.runtime.close()
        return res

    c_tokens, c_experts, c_tables, c_secs = run("1")
    py_tokens, py_experts, py_tables, _ = run("0")
    assert c_tables and not py_tables and c_secs > 0
    assert c_tokens == py_tokens and c_experts == py_experts and sum(c_experts) > 0


# ---- HF FP4 experts (NVFP4, MXFP4 safetensors) in the layer call: each matrix a descriptor of its parts ----------
def _fp4_bank(name: str, seed: int = 0):
    """(bank {proj.part: uint8 [E, bytes]}, its HFExpertFormat, float64 {proj: [E, n, k]}) of random HF FP4
    experts, each part's rows stored as the checkpoint's bytes (hf_expert_format's layout)."""
    from moestream.moe.formats import hf_expert_format
    from test_cpu_kernels import _fp4_format, _fp4_raw

    fmt = _fp4_format(name)
    bank, dtypes, dense = {}, {}, {}
    for j, (proj, (n, k)) in enumerate(zip(("gate", "up", "down"), SHAPES)):
        raw = _fp4_raw(name, n, k, seed=seed + j, lead=(E,))
        dense[proj] = fmt.dequantize(raw, (E, n, k), torch.float64)
        for part, t in raw.items():
            dtypes[f"{proj}.{part}"] = t.dtype
            bank[f"{proj}.{part}"] = t.contiguous().view(torch.uint8).reshape(E, -1)
    return bank, hf_expert_format(fmt, dtypes, H, I), dense


def _hf_layer_call(bank, fmt, name: str, force_scalar: bool):
    """(x, w, y float64, out) of one layer call of HF experts (EXPERTS / STARTS / ROWS / DST) through cpu_moe's
    descriptors; checks the format is offered to the kernel as `name`."""
    from moestream.moe import cpu_moe

    assert cpu_moe.kernel_types(fmt) == (name,) * 3
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(1))
    w = np.random.default_rng(2).random(5).astype(np.float32)
    ptrs, types, inter, _ = cpu_moe.expert_ptrs(bank, fmt, EXPERTS)
    out = torch.full((5, H), float("nan"))
    y = cpu_quant.moe_layer(x, ptrs, types, STARTS, ROWS, w, DST, out, inter, force_scalar=force_scalar).double()
    return x, w, y, out


def _hf_same_bits_every_way(bank, fmt, name: str, x, w, out) -> None:
    """cpu_moe.run and the bridge's LayerCall give `out`'s bits; the CPU decode plan's table covers every expert."""
    from moestream.moe import cpu_moe

    order = np.argsort(EXPERTS, kind="stable")  # run / LayerCall take experts in ascending order
    experts = EXPERTS[order].astype(np.int64)
    counts = np.diff(STARTS)[order]
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    pairs = np.concatenate([np.arange(STARTS[g], STARTS[g + 1]) for g in order])
    rows, dst, pw = ROWS[pairs].astype(np.int64), DST[pairs].astype(np.int64), w[pairs]
    via_run = cpu_moe.run(x, bank, fmt, experts, starts, rows, pw, dst, torch.zeros(5, H))
    via_call = cpu_moe.LayerCall(bank, fmt, x.dtype)(x, experts, starts, rows, pw, dst, torch.zeros(5, H))
    assert torch.equal(via_run, out) and torch.equal(via_call, out)
    table, tids, inter_t, arrays = cpu_moe.layer_table(bank, fmt)
    assert table.shape == (E, 3) and tids == (cpu_quant.HF_TYPES[name],) * 3 and inter_t == I and arrays is None


@pytest.mark.parametrize("force_scalar", [False, True])
@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_fp4_layer_call_matches_float64_model(name, force_scalar):
    """HF FP4 experts through one layer call (descriptors of codes / scales / global scale per matrix): the exact
    model (x and h rounded to int8 per 16, float64 products) to float32 accumulation error, the true float64 MLP
    within the rounding; cpu_moe.run and the bridge's LayerCall give the same bits."""
    bank, fmt, dense = _fp4_bank(name)
    x, w, y, out = _hf_layer_call(bank, fmt, name, force_scalar)
    for g in range(3):
        e = EXPERTS[g]
        wg, wu, wd = (dense[p][e] for p in ("gate", "up", "down"))
        for p in range(STARTS[g], STARTS[g + 1]):
            xr = x[ROWS[p]:ROWS[p] + 1]
            xq = _quantized_x(xr, 16)[0]
            h = swiglu(xq @ wg.T, xq @ wu.T).float()
            ref = (_quantized_x(h, 16)[0] @ wd.T)[0] * float(w[p])
            scale = (h.double().abs() @ wd.abs().T)[0] * float(w[p])
            err = (y[DST[p]] - ref).abs()
            assert (err <= 1e-4 * scale + 1e-30).all(), (name, p, (err / scale).max().item())
            true = reference(xr, wg, wu, wd) * float(w[p])
            assert ((y[DST[p]] - true[0]).norm() / true.norm()).item() < 0.05
    if not force_scalar:
        _hf_same_bits_every_way(bank, fmt, name, x, w, out)


# ---- HF FP8 experts in the layer call: e4m3 codes and float32 scales per block / row / matrix ----------------------
def _fp8_bank(qfmt, seed: int = 0, scale_dtype=torch.float32):
    """(bank {proj.part: uint8 [E, bytes]}, its HFExpertFormat, float64 {proj: [E, n, k]}) of random FP8 experts,
    their scales stored as scale_dtype."""
    from moestream.moe.formats import hf_expert_format
    from moestream.quant.synthetic import random_raw

    bank, dtypes, dense = {}, {}, {}
    for j, (proj, (n, k)) in enumerate(zip(("gate", "up", "down"), SHAPES)):
        raws = [random_raw(qfmt, (n, k), seed=10 * (seed + j) + e) for e in range(E)]
        raws = [{p: t.to(scale_dtype) if t.dtype == torch.float32 else t for p, t in r.items()} for r in raws]
        dense[proj] = torch.stack([qfmt.dequantize(r, (n, k), torch.float64) for r in raws])
        for part in raws[0]:
            dtypes[f"{proj}.{part}"] = raws[0][part].dtype
            bank[f"{proj}.{part}"] = torch.stack([r[part].contiguous().reshape(-1).view(torch.uint8) for r in raws])
    return bank, hf_expert_format(qfmt, dtypes, H, I), dense


def _fp8_formats():
    from moestream.quant import FP8_BLOCK, FP8_CHANNEL, FP8_TENSOR, fp8_block_format

    # 128 x 128 blocks (Qwen3 / DeepSeek FP8), blocks that do not divide I = 256 rows / H = 512 columns evenly
    # (96 x 80: partial last blocks, 80 not a multiple of 16: the scalar tail), a scale per row, one per matrix
    return {"block": FP8_BLOCK, "block_96x80": fp8_block_format((96, 80)), "channel": FP8_CHANNEL, "tensor": FP8_TENSOR,
            "block_bf16": FP8_BLOCK}


@pytest.mark.parametrize("force_scalar", [False, True])
@pytest.mark.parametrize("mode", ["block", "block_96x80", "channel", "tensor", "block_bf16"])
def test_fp8_layer_call_matches_float64_model(mode, force_scalar):
    """HF FP8 experts through one layer call (a descriptor of codes, scales and scale layout per matrix): float32
    activations, so the float64 MLP of the dequantized experts to float32 accumulation error; cpu_moe.run, the
    bridge's LayerCall and the CPU decode plan's table read the same descriptors."""
    bank, fmt, dense = _fp8_bank(_fp8_formats()[mode], scale_dtype=torch.bfloat16 if mode.endswith("bf16") else torch.float32)
    x, w, y, out = _hf_layer_call(bank, fmt, "fp8", force_scalar)
    for g in range(3):
        e = EXPERTS[g]
        wg, wu, wd = (dense[p][e] for p in ("gate", "up", "down"))
        for p in range(STARTS[g], STARTS[g + 1]):
            xr = x[ROWS[p]:ROWS[p] + 1].double()
            true = reference(xr, wg, wu, wd)[0] * float(w[p])
            # float32 sums of K terms: within ~K * 2^-24 of |terms|, through gate/up into h and then down
            h = swiglu(xr @ wg.T, xr @ wu.T)
            scale = ((h.abs() + 1e-3 * (xr.abs() @ (wg.abs() + wu.abs()).T)) @ wd.abs().T)[0] * float(w[p])
            err = (y[DST[p]] - true).abs()
            assert (err <= 1e-4 * scale + 1e-30).all(), (mode, p, (err / scale).max().item())
            assert ((y[DST[p]] - true).norm() / true.norm()).item() < 1e-5
    if not force_scalar:
        _hf_same_bits_every_way(bank, fmt, "fp8", x, w, out)


def test_fp8_scales_other_than_float32_or_bf16_stay_off_the_layer_call():
    """The layer call reads float32 or bf16 scales: float16 ones keep the per-matrix path."""
    from moestream.moe import cpu_moe
    from moestream.moe.formats import hf_expert_format
    from moestream.quant import FP8_BLOCK

    dtypes = {f"{p}.{part}": dt for p in ("gate", "up", "down")
              for part, dt in (("weight", torch.float8_e4m3fn), ("weight_scale_inv", torch.float16))}
    assert cpu_moe.kernel_types(hf_expert_format(FP8_BLOCK, dtypes, H, I)) is None


def test_fp4_expert_ptrs_check_the_bank():
    """A part's rows shorter than the format's bytes, or an expert outside the bank, are refused before C reads
    them; an HF FP4 format the layer call lacks (H not a multiple of 32) is not offered to it."""
    from moestream.moe import cpu_moe
    from moestream.moe.formats import hf_expert_format

    bank, fmt, _ = _fp4_bank("nvfp4")
    with pytest.raises(IndexError):
        cpu_moe.expert_ptrs(bank, fmt, np.array([0, E]))
    short = {**bank, "down.weight_scale": bank["down.weight_scale"][:, :-1]}
    with pytest.raises(ValueError, match="down.weight_scale"):
        cpu_moe.expert_ptrs(short, fmt, np.array([0]))
    odd = hf_expert_format(fmt.qfmt, dict(fmt.parts), H, 48)  # I = 48: NVFP4's 16-blocks, not the kernels' 32
    assert cpu_moe.kernel_types(odd) is None


def test_layer_call_tuning_changes_no_result(monkeypatch):
    """MOESTREAM_CPU_LAYER_TUNING (chunks a thread, least chunk bytes, interleaved groups read ahead) moves work
    between threads and hints the caches, nothing else: the layer call's rows are bit for bit the default's under
    every setting, on Q4_K / Q6_K experts of the Qwen3.6 shape (large enough to read ahead) in the file's layout and
    interleaved, and two threads; a malformed setting is refused naming it."""
    from moestream.env import cpu_layer_tuning
    from moestream.quant import gguf_format
    from moestream.quant.synthetic import random_raw

    if not cpu_quant.available():
        pytest.skip("CPU kernels not built")
    rng = np.random.default_rng(3)
    Hq, Iq, E, G = 2048, 512, 6, 4
    mats = {"gate": ("Q4_K", Iq, Hq), "up": ("Q4_K", Iq, Hq), "down": ("Q6_K", Hq, Iq)}
    plain = {p: [m.numpy() for m in random_raw(gguf_format(t), (E, n, k), seed=j)]  # E [n, row bytes] each
             for j, (p, (t, n, k)) in enumerate(mats.items())}
    x8 = {p: [cpu_quant.repack_x8(m.ctypes.data, n, k, m.shape[1], t)[0] for m in plain[p]]
          for p, (t, n, k) in mats.items()}
    names = ("gate", "up", "down")
    experts = [4, 0, 5, 2]
    layouts = {  # the file's rows (read ahead by rows) and the interleaved copies (by groups)
        "plain": (np.array([[plain[p][e].ctypes.data for p in names] for e in experts], dtype=np.int64),
                  np.array([cpu_quant.type_id(mats[p][0]) for p in names], dtype=np.int64)),
        "x8": (np.array([[x8[p][e].ctypes.data for p in names] for e in experts], dtype=np.int64),
               np.array([cpu_quant.X8_TYPES[mats[p][0]][0] for p in names], dtype=np.int64))}
    x = torch.randn(3, Hq).to(torch.bfloat16)
    starts = np.array([0, 2, 3, 5, 6])  # pairs grouped by expert: rows of x each reads
    rows = np.array([0, 2, 1, 0, 1, 2])
    dst = np.arange(6)
    w = rng.random(6).astype(np.float32)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)

    def call(layout):
        wptr, tids = layouts[layout]
        out = torch.zeros(6, Hq)
        rc = cpu_quant.module().ms_moe_layer(x.data_ptr(), 1, 3, Hq, Iq, G, wptr.ctypes.data, tids.ctypes.data,
                                             starts.ctypes.data, rows.ctypes.data, w.ctypes.data, dst.ctypes.data,
                                             out.data_ptr(), 6, Hq, 1, 0, cpu_quant.threads(), 0)
        assert rc == 0
        return out

    monkeypatch.delenv("MOESTREAM_CPU_LAYER_TUNING", raising=False)
    want = {layout: call(layout) for layout in layouts}
    assert all(torch.isfinite(y).all() and y.abs().sum() > 0 for y in want.values())
    for setting in ("chunks=1,kb=1024", "kb=32", "chunks=32,kb=1,x8ahead=2", "x8ahead=1", "kb=4", "rowsahead=16", "flow=0",
                    "flow=0,chunks=32,kb=1", "flow=0,chunks=1,kb=1024,x8ahead=1", "tail=4",
                    "tail=3,chunks=1,kb=1024", "tail=2,flow=0,kb=1,x8ahead=1"):
        monkeypatch.setenv("MOESTREAM_CPU_LAYER_TUNING", setting)
        assert cpu_quant.layer_tuning() == cpu_layer_tuning() != (8, 0, 0, 2, 1, 1)  # in force in the library
        for layout in layouts:
            assert torch.equal(call(layout), want[layout]), (setting, layout)
    for bad in ("chunks=0", "flow=2", "tail=0"):
        monkeypatch.setenv("MOESTREAM_CPU_LAYER_TUNING", bad)
        with pytest.raises(ValueError, match=f"'{bad}'"):
            cpu_layer_tuning()
    monkeypatch.delenv("MOESTREAM_CPU_LAYER_TUNING")
    assert cpu_layer_tuning() == (8, 0, 0, 2, 1, 1) == cpu_quant.layer_tuning()  # the defaults back for later tests


def test_bridge_interleaved_copies(monkeypatch):
    """MOESTREAM_BRIDGE_X8=1: the bridge gives the host banks 8-row interleaved copies of every projection with that
    layout (Q4_K, Q6_K) and its worker reads them (the interleaved type ids in its table), the file's bytes left as
    they were; its rows equal the file layout's but for float summation order; off (the default), nothing copied."""
    from moestream.moe import cpu_moe
    from moestream.moe.formats import gguf_expert_format

    tables = []
    real = cpu_quant.bridge_step
    monkeypatch.setattr(cpu_quant, "bridge_step",
                        lambda *a, **k: tables.append(np.asarray(a[1]["wtype"]).ravel().tolist()) or real(*a, **k))
    h, i, e, k, T = 256, 256, 5, 3, 2
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g)
    cpu = torch.ones(T * k, dtype=torch.bool)  # every pair the worker's
    types = {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}
    fmt = gguf_expert_format(types, h, i)

    def run(flag):
        monkeypatch.setenv("MOESTREAM_BRIDGE_X8", flag)
        banks = {p: _weights(types[p], e * n, kk, seed=j).reshape(e, -1)
                 for j, (p, (n, kk)) in enumerate(zip(("gate", "up", "down"), ((i, h), (i, h), (h, i))))}
        before = {p: b.clone() for p, b in banks.items()}
        store = _Store(fmt, banks)
        store.hidden = h
        y = _bridge_step(store, x, ids, w, cpu, torch.float32)
        assert all(torch.equal(banks[p], before[p]) for p in banks)
        return y, [cpu_moe.x8_copy(banks[p]) for p in ("gate", "up", "down")]

    plain, none = run("0")
    assert none == [None] * 3 and tables[-1] == [cpu_quant.TYPES[types[p]] for p in ("gate", "up", "down")]
    y, copies = run("1")
    assert [c[1] for c in copies] == ["Q4_K_x8", "Q4_K_x8", "Q6_K_x8"]
    assert tables[-1] == [cpu_quant.X8_TYPES[types[p]][0] for p in ("gate", "up", "down")]
    torch.testing.assert_close(y, plain, rtol=1e-5, atol=1e-5 * float(plain.abs().max()))


def test_layer_flow_matches_the_barrier_with_empty_groups(monkeypatch):
    """flow=1 (the default: an expert's down rows start once its gate/up rows are counted done): the same products
    as the barrier (flow=0), bit for bit, where groups are empty (their rows skipped in both phases: nothing may wait
    on them), with 1-4 threads and chunks that split experts."""
    from moestream.quant import gguf_format
    from moestream.quant.synthetic import random_raw

    if not cpu_quant.available():
        pytest.skip("CPU kernels not built")
    H, I, E = 256, 256, 5
    mats = {"gate": ("Q4_K", I, H), "up": ("Q4_K", I, H), "down": ("Q6_K", H, I)}
    banks = {p: [m.numpy() for m in random_raw(gguf_format(t), (E, n, k), seed=j + 7)]
             for j, (p, (t, n, k)) in enumerate(mats.items())}
    names = ("gate", "up", "down")
    wptr = np.array([[banks[p][e].ctypes.data for p in names] for e in range(E)], dtype=np.int64)
    tids = np.array([cpu_quant.type_id(mats[p][0]) for p in names], dtype=np.int64)
    x = torch.randn(2, H)
    starts = np.array([0, 2, 2, 3, 3, 4])  # experts 1 and 3 have no pairs
    rows, dst = np.array([0, 1, 0, 1]), np.arange(4)
    w = np.linspace(0.5, 1.0, 4).astype(np.float32)

    def call(nt):
        out = torch.zeros(4, H)
        rc = cpu_quant.module().ms_moe_layer(x.data_ptr(), 0, 2, H, I, E, wptr.ctypes.data, tids.ctypes.data,
                                             starts.ctypes.data, rows.ctypes.data, w.ctypes.data, dst.ctypes.data,
                                             out.data_ptr(), 4, H, 1, 0, nt, 0)
        assert rc == 0
        return out

    cpu_quant.layer_profile(True)  # the profile's sums of a call: ordered, and cleared when read
    call(2)
    prof = cpu_quant.layer_profile(False)
    assert prof["calls"] == 1 and 0 <= prof["setup"] <= prof["total"]
    assert 0 < prof["p1_first"] <= prof["p1_last"] <= prof["p2_last"] <= prof["total"]
    assert prof["p2_first"] <= prof["p2_last"] and cpu_quant.layer_profile(False)["calls"] == 0
    call(2)
    assert cpu_quant.layer_profile(False)["calls"] == 0  # off: nothing summed
    for nt in (1, 2, 4):
        monkeypatch.setenv("MOESTREAM_CPU_LAYER_TUNING", "chunks=32,kb=1,flow=0")
        cpu_quant.threads()
        want = call(nt)
        monkeypatch.setenv("MOESTREAM_CPU_LAYER_TUNING", "chunks=32,kb=1,flow=1")
        cpu_quant.threads()
        assert cpu_quant.layer_tuning()[4] == 1
        assert torch.equal(call(nt), want) and want.abs().sum() > 0
    monkeypatch.delenv("MOESTREAM_CPU_LAYER_TUNING")
    assert cpu_quant.layer_tuning()[4] == 1  # the default


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_dense_banks_take_the_layer_kernel_up_to_a_few_rows(x_dtype):
    """16-bit expert banks through compute.partial_outputs on a CPU with float32 activations (a float32 model whose
    experts kept the checkpoint's bf16 rows): an expert of at most DENSE_KERNEL_MAX_ROWS rows by the layer kernel,
    one of more by the torch GEMM, both within float32 rounding of a float64 model; bf16 activations stay on
    torch's bf16 GEMMs (HF's numerics), within bf16 rounding."""
    from moestream.moe import cpu_moe
    from moestream.moe.compute import RouteGroups, WeightRef, partial_outputs

    g = torch.Generator().manual_seed(3)
    bank = {"gate_up": (torch.randn(E, 2 * I, H, generator=g) * 0.05).to(torch.bfloat16),
            "down": (torch.randn(E, H, I, generator=g) * 0.05).to(torch.bfloat16)}
    n = cpu_moe.DENSE_KERNEL_MAX_ROWS + 4
    x = torch.randn(n, H, generator=g).to(x_dtype)
    ids = torch.stack([torch.zeros(n, dtype=torch.long), 1 + torch.arange(n) % 3], 1)  # expert 0: every row
    w = torch.rand(n, 2, generator=g).to(x_dtype)
    groups = RouteGroups.of(ids)
    refs = {e: WeightRef(bank, e) for e in groups.experts}
    kernel = {1, 2, 3} if x_dtype == torch.float32 else set()  # expert 0 has n rows: left to torch
    assert set(cpu_moe.layer_partials(x, w, groups, refs)) == kernel
    out = partial_outputs(x, w, groups, refs)
    where = groups.index()
    tol = 1e-5 if x_dtype == torch.float32 else 2e-2
    for e in range(E):
        rows, pos = groups.members(where[e])
        gate, up = bank["gate_up"][e].double().chunk(2)
        want = reference(x[rows].double(), gate, up, bank["down"][e].double()) * w[rows, pos, None].double()
        got = out[e].double()
        assert (got - want).abs().max() <= tol * want.abs().max(), (e, x_dtype)


def test_omp_release_team_frees_the_calling_threads_team():
    """kernels/cpu_quant.omp_release_team (the bridge's stepping thread before its steps, MOESTREAM_OMP_RELEASE): the
    calling thread's OpenMP team's threads exit (the process's thread count drops by all but the caller), a later
    parallel region starts a new team, and kernel results do not change."""
    import os

    tasks = lambda: len(os.listdir("/proc/self/task"))  # noqa: E731
    types = ("Q8_0",) * 3
    banks = _banks(types, seed=9)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(10))
    w = np.random.default_rng(11).random(5).astype(np.float32)
    torch.set_num_threads(2)
    try:
        want = _call(types, banks, x, w)  # a parallel region of 2 on this thread: its team holds 1 thread or more
        before = tasks()                  # besides (more where an earlier test ran a larger team here)
        assert cpu_quant.omp_release_team()
        freed = tasks()
        assert freed < before
        assert cpu_quant.omp_release_team()  # nothing left to free: still fine
        assert tasks() == freed
        assert torch.equal(_call(types, banks, x, w), want)  # a new team of 2: one thread besides this one
        assert tasks() == freed + 1
    finally:
        torch.set_num_threads(1)

"""moestream.kernels.linear: 16-bit weights on a CPU without native 16-bit GEMMs are multiplied in float32
for 16+ rows, a block of weight rows at a time; the result is F.linear's up to one rounding of the output."""
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moestream import hardware  # noqa: E402
from moestream.kernels import linear as L  # noqa: E402


@pytest.fixture
def no_native(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_native", lambda dtype: False)


def exact(x, w, b=None):
    """float64 reference rounded once to the activations' dtype."""
    y = x.double() @ w.double().t()
    if b is not None:
        y = y + b.double()
    return y.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [16, 37, 300])
def test_widened_matches_reference(no_native, dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    w = (torch.randn(200, 96, generator=g) * 0.1).to(dtype)
    b = torch.randn(200, generator=g).to(dtype)
    assert hardware.widen_gemm(x, w.dtype)
    got = L.linear(x, w, b)
    assert got.dtype == dtype and got.shape == (rows, 200)
    want = exact(x, w, b)
    # float32 accumulation then one rounding: at most one unit in the last place away from exact
    ulp = (want.float().abs() * (2 ** -7 if dtype == torch.bfloat16 else 2 ** -10)).clamp_min(1e-6)
    assert torch.all((got.float() - want.float()).abs() <= ulp)
    torch.testing.assert_close(got.float(), F.linear(x, w, b).float(), rtol=2e-2, atol=2e-2)


def test_blocks_do_not_change_the_result(no_native, monkeypatch):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 20, 64, generator=g).to(torch.bfloat16)  # leading dims kept
    w = torch.randn(130, 64, generator=g).to(torch.bfloat16)
    whole = L.linear(x, w)
    monkeypatch.setattr(L, "WIDEN_BLOCK_BYTES", 4 * 64 * 7)  # 7 weight rows per block, a ragged last one
    blocks = L.linear(x, w)
    assert blocks.shape == (2, 20, 130)
    assert torch.equal(whole, blocks)


def test_small_batches_native_cpus_and_float32_keep_torchs_kernel(monkeypatch):
    x = torch.randn(8, 64).to(torch.bfloat16)
    w = torch.randn(32, 64).to(torch.bfloat16)
    monkeypatch.setattr(hardware, "cpu_has_native", lambda dtype: False)
    assert not hardware.widen_gemm(x, w.dtype)  # 8 rows: bound by reading the weight, the 16-bit kernel reads half
    assert torch.equal(L.linear(x, w), F.linear(x, w))
    assert not hardware.widen_gemm(torch.randn(64, 64), torch.float32)  # float32 weights
    assert hardware.widen_gemm(torch.randn(64, 64).to(torch.bfloat16), w.dtype)
    monkeypatch.setattr(hardware, "cpu_has_native", lambda dtype: True)
    assert not hardware.widen_gemm(torch.randn(64, 64).to(torch.bfloat16), w.dtype)


def test_linear_module_keeps_nn_linear_state_dict(no_native):
    m = L.Linear(64, 32, bias=False).to(torch.bfloat16)
    assert list(m.state_dict()) == ["weight"]
    x = torch.randn(40, 64).to(torch.bfloat16)
    torch.testing.assert_close(m(x).float(), F.linear(x, m.weight).float(), rtol=2e-2, atol=2e-2)



def test_quantized_rows_widened_too(monkeypatch):
    """qlinear (compressed experts and GGUF weights on a CPU): 16+ bf16 rows multiply float32 tiles, the
    result rounded once to bf16 and the same whatever the tiling; fewer rows keep bf16 tiles."""
    from moestream.quant import base, gguf_format
    from moestream.quant.synthetic import random_raw

    monkeypatch.setattr(hardware, "cpu_has_native", lambda dtype: False)
    monkeypatch.setenv("MOESTREAM_CPU_KERNELS", "0")  # the tile path (few rows would take the int8 kernel)
    q = gguf_format("Q4_K")
    raw = random_raw(q, (96, 256), seed=1)
    w = q.dequantize(raw, (96, 256))  # float32, exact
    g = torch.Generator().manual_seed(2)
    x = torch.randn(20, 256, generator=g).to(torch.bfloat16)
    got = base.qlinear(x, q, raw, (96, 256))
    assert got.dtype == torch.bfloat16
    want = (x.double() @ w.double().t()).to(torch.bfloat16)
    ulp = (want.float().abs() * 2 ** -7).clamp_min(1e-6)
    assert torch.all((got.float() - want.float()).abs() <= ulp)
    assert torch.equal(base.qlinear(x, q, raw, (96, 256), tile_rows=16), got)
    few = x[:4]
    assert torch.equal(base.qlinear(few, q, raw, (96, 256)), few @ w.to(torch.bfloat16).t())


def test_dense_experts_use_the_widening_linear(monkeypatch):
    """Routed dense experts (the format's SwiGLU and compute's, both moe/swiglu.py's) go through kernels.linear:
    a twin with its own F.linear calls kept CPU prefill experts on the slow bf16 kernel once."""
    from moestream.moe import compute, formats, swiglu

    calls = []

    def spy(x, w, bias=None):
        calls.append(tuple(w.shape))
        return L.linear(x, w, bias)

    monkeypatch.setattr(swiglu, "linear", spy)
    g = torch.Generator().manual_seed(4)
    gate_up, down = torch.randn(64, 32, generator=g), torch.randn(32, 32, generator=g)
    x = torch.randn(5, 32, generator=g)
    a = formats.dense_format(torch.float32).expert_mlp(x, {"gate_up": gate_up, "down": down})
    b = compute.expert_mlp(x, gate_up, down)
    assert calls == [(64, 32), (32, 32)] * 2
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_float32_activations_against_16_bit_weights(dtype, rows):
    """A CPU's routed experts may stay in a checkpoint's 16-bit rows while the model computes in float32: linear
    takes float32 x against them at any row count (F.linear refuses mixed dtypes), exact weights, float32 out."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g)
    w = (torch.randn(70, 96, generator=g) * 0.1).to(dtype)
    with pytest.raises(RuntimeError):
        F.linear(x, w)
    got = L.linear(x, w)
    assert got.dtype == torch.float32 and got.shape == (rows, 70)
    torch.testing.assert_close(got, F.linear(x, w.float()), rtol=1e-6, atol=1e-6)

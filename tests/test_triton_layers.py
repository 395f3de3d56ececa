"""Triton decode kernels (layers/triton_ops.py) against the torch reference paths (CUDA only)."""
from __future__ import annotations

import pytest
import torch

from moestream.layers import triton_ops
from moestream.layers.gdn import GatedDeltaNet
from moestream.layers.norm import GatedRMSNorm, RMSNorm

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and triton_ops.triton is not None),
                                reason="needs a CUDA GPU and Triton")


@pytest.fixture
def torch_path(monkeypatch):
    def run(fn):
        monkeypatch.setenv("MOESTREAM_TRITON", "0")
        try:
            return fn()
        finally:
            monkeypatch.setenv("MOESTREAM_TRITON", "1")
    return run


@pytest.mark.parametrize("zc", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm(zc, dtype, torch_path):
    n = RMSNorm(256, 1e-6, zc).cuda().to(dtype)
    torch.nn.init.normal_(n.weight, 0.3, 0.2)
    x = torch.randn(5, 3, 256, device="cuda", dtype=dtype) * 3
    torch.testing.assert_close(n(x), torch_path(lambda: n(x)), rtol=1e-2 if dtype != torch.float32 else 1e-5,
                               atol=1e-2 if dtype != torch.float32 else 1e-5)
    g = GatedRMSNorm(128, 1e-6).cuda().to(dtype)
    torch.nn.init.normal_(g.weight, 1.0, 0.2)
    x, gate = torch.randn(7, 128, device="cuda", dtype=dtype), torch.randn(7, 128, device="cuda", dtype=dtype)
    torch.testing.assert_close(g(x, gate), torch_path(lambda: g(x, gate)), rtol=2e-2, atol=2e-2)


def test_gated_rms_norm_writes_heads_where_told(torch_path):
    """GatedRMSNorm with dest (GatedDeltaNet.absorb_out_perm): head g of each token written at head dest[g], in the
    kernel as by the torch path, and the values of the plain norm moved."""
    g = GatedRMSNorm(128, 1e-6).cuda().to(torch.bfloat16)
    torch.nn.init.normal_(g.weight, 1.0, 0.2)
    x = torch.randn(3, 8, 128, device="cuda", dtype=torch.bfloat16)
    gate = torch.randn(3, 8, 128, device="cuda", dtype=torch.bfloat16)
    dest = torch.randperm(8, generator=torch.Generator().manual_seed(1)).to(torch.int32).cuda()
    got, plain = g(x, gate, dest), g(x, gate)
    assert torch.equal(got[:, dest.long()], plain)
    torch.testing.assert_close(got, torch_path(lambda: g(x, gate, dest)), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype,state_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                               (torch.bfloat16, torch.bfloat16)])
def test_gdn_decode(dtype, state_dtype, torch_path):
    torch.manual_seed(0)
    hk, hv, dk, dv, K = 2, 4, 32, 64, 4
    m = GatedDeltaNet(64, hk, hv, dk, dv, K, 1e-6).cuda().to(dtype)
    for p in m.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    B, slots_n = 3, 5
    conv_dim = m.conv_dim
    conv = torch.randn(slots_n, conv_dim, K - 1, device="cuda", dtype=dtype)
    rec = torch.randn(slots_n, hv, dk, dv, device="cuda", dtype=state_dtype) * 0.1
    slots = torch.tensor([4, 0, 2], device="cuda")
    mixed = torch.randn(B, conv_dim, device="cuda", dtype=dtype)
    g = -torch.rand(B, hv, device="cuda")
    beta = torch.rand(B, hv, device="cuda")

    outs = {}
    for name, run in (("triton", lambda f: f()), ("torch", torch_path)):
        c, r = conv.clone(), rec.clone()
        core = torch.empty(B, hv, dv, device="cuda", dtype=dtype)
        run(lambda: m._decode(mixed, g, beta, slots, c, r, core))
        outs[name] = (core, c, r)
    tol = dict(rtol=3e-2, atol=3e-2) if dtype != torch.float32 or state_dtype != torch.float32 else dict(rtol=1e-4, atol=1e-4)
    for a, b in zip(outs["triton"], outs["torch"]):
        torch.testing.assert_close(a.float(), b.float(), **tol)
    untouched = [1, 3]
    assert torch.equal(outs["triton"][1][untouched], conv[untouched]) and torch.equal(outs["triton"][2][untouched], rec[untouched])

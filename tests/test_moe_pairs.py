"""The pair kernels' contract and the device-side slot cache (moe/pairs.py, moe/device_cache.py).

The torch reference runs here and equals the experts' SwiGLU oracle (moe/swiglu.py); the Triton kernels are
checked against both on CUDA (skipped without)."""
from __future__ import annotations

import pytest
import torch

from moestream.engine.graphs import kv_bucket
from moestream.moe.compute import moe_reference
from moestream.moe.device_cache import DeviceSlotCache
from moestream.moe.pairs import _pair_outputs_torch, pair_moe, pair_moe_torch, pair_outputs, stage_experts, triton_ready
from moestream.moe.swiglu import reference_pairs, split_gate_up

E, H, I = 12, 32, 16


def bank(n, seed, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return {"gate_up": (torch.randn(n, 2 * I, H, generator=g) * 0.2).to(device, dtype),
            "down": (torch.randn(n, H, I, generator=g) * 0.2).to(device, dtype)}


def route(T, k, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(device)
    w = torch.rand(T, k, generator=g).to(device)
    return ids, w / w.sum(-1, keepdim=True)


@pytest.mark.parametrize("T,k", [(1, 4), (3, 2), (5, 4)])
def test_pairs_equal_grouped_reference(T, k):
    b = bank(E, 0)
    x = torch.randn(T, H)
    ids, w = route(T, k, T)
    want = moe_reference(x, ids, w, b["gate_up"], b["down"])
    got = pair_moe_torch(x, w, ids.reshape(-1), b)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_pair_reference_is_the_swiglu_oracle(dtype, tol):
    """The pair contract's torch reference computes w * down(silu(gate x) * up x) with h rounded to the
    activations' dtype: the float64 oracle within the dtype's rounding (g, u and the outputs rounded there)."""
    b = bank(E, 7, dtype=dtype)
    x = torch.randn(3, H).to(dtype)
    ids, w = route(3, 4, 5)
    got = _pair_outputs_torch(x, w, ids.reshape(-1), b)
    want = reference_pairs(x, w, ids, *split_gate_up(b["gate_up"]), b["down"], h_dtype=dtype)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * float(want.abs().max()))
    wrong = reference_pairs(x, w, ids.roll(1, dims=1), *split_gate_up(b["gate_up"]), b["down"], h_dtype=dtype)
    assert (got.double() - wrong).abs().max() > 10 * tol * float(want.abs().max())  # the check sees wrong experts


def test_stage_then_pairs():
    """Staged experts land in their rows; pairs over those rows give the grouped reference."""
    host, pool = bank(E, 1), bank(6, 2)
    x = torch.randn(2, H)
    ids, w = route(2, 3, 7)
    experts = torch.tensor([ids[0, 0], ids[0, 1], ids[1, 2], 0])
    rows = torch.tensor([4, 0, 2, 5])
    stage_experts(host, pool, experts, rows, torch.tensor(3))
    for e, r in zip(experts[:3].tolist(), rows[:3].tolist()):
        assert torch.equal(pool["gate_up"][r], host["gate_up"][e]) and torch.equal(pool["down"][r], host["down"][e])
    assert not torch.equal(pool["down"][5], host["down"][0])  # beyond count: untouched
    src_of = {e: r for e, r in zip(experts[:3].tolist(), rows[:3].tolist())}
    for e in ids.reshape(-1).tolist():
        if e not in src_of:
            r = [q for q in (1, 3, 5) if q not in src_of.values()][0]
            pool["gate_up"][r], pool["down"][r] = host["gate_up"][e], host["down"][e]
            src_of[e] = r
    src = torch.tensor([src_of[e] for e in ids.reshape(-1).tolist()])
    got = pair_moe_torch(x, w, src, pool)
    want = moe_reference(x, ids, w, host["gate_up"], host["down"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("slots", [3, 8, 30])
def test_device_cache_bookkeeping(slots):
    """Random decode steps over 3 layers: counts match the resident set seen before each call,
    admitted experts become resident, routed residents are never evicted by their own call, and
    table/slot_key stay inverse maps."""
    layers, k = [0, 2, 5], 3
    c = DeviceSlotCache(slots, layers, E, max_pairs=2 * k, device=torch.device("cpu"))
    for step in range(40):
        c.begin_step()
        for layer in layers:
            ids, _ = route(2, k, 100 * step + layer)
            before = c.resident_rows(layer)
            counts0 = c.counts()[layer]
            src, experts, rows, count = c.route(layer, ids)
            after = c.resident_rows(layer)
            routed = set(ids.reshape(-1).tolist())
            d = [a - b for a, b in zip(c.counts()[layer], counts0)]
            assert d[0] == len(routed & set(before)) and d[1] == len(routed - set(before))
            staged = dict(zip(experts[:int(count)].tolist(), rows[:int(count)].tolist()))
            assert set(staged) == routed - set(before)  # exactly the misses are staged, once each
            assert len(set(staged.values())) == len(staged)  # into distinct rows
            for p, e in enumerate(ids.reshape(-1).tolist()):
                if e in before:
                    assert src[p] == before[e]
                    assert after.get(e) == before[e]  # a routed resident is never the victim of its own call
                else:
                    assert src[p] == staged[e]
                    # admitted into a slot (then resident there) or staged in a scratch row
                    assert after.get(e) == staged[e] if staged[e] < slots else staged[e] < slots + c.scratch
            c.check_integrity()
            assert c.num_resident() <= slots
    if slots < 30:
        assert c.num_resident() == slots  # misses filled every slot
    # /v1/stats's map: the resident (layer, expert) pairs, the most recently used slot brightest
    rows = c.resident_map()
    assert set(rows) == {str(layer) for layer in layers} and all(len(r) == E for r in rows.values())
    for layer in layers:
        assert {e for e, ch in enumerate(rows[str(layer)]) if ch != "0"} == set(c.resident_rows(layer))
    assert "9" in "".join(rows.values())


def test_kv_bucket():
    assert [kv_bucket(n) for n in (1, 256, 257, 384, 385, 600, 1025, 2100)] == [256, 256, 384, 384, 512, 768, 1536,
                                                                                 3072]


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.skipif(not triton_ready(torch.device("cuda")) if torch.cuda.is_available() else True,
                    reason="needs Triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_stage_and_pairs_match_reference(dtype):
    host = {n: t.pin_memory() for n, t in bank(E, 3, dtype=dtype).items()}
    pool = bank(8, 4, "cuda", dtype)
    ref_pool = {n: t.clone() for n, t in pool.items()}
    experts = torch.tensor([3, 7, 1, 0, 0], device="cuda")
    rows = torch.tensor([6, 2, 7, 0, 1], device="cuda")
    count = torch.tensor(3, device="cuda")
    stage_experts(host, pool, experts, rows, count)
    for n in pool:
        ref_pool[n][rows[:3]] = host[n][experts[:3].cpu()].cuda()
        assert torch.equal(pool[n], ref_pool[n])  # exactly the staged rows changed, bit for bit
    x = torch.randn(3, H, device="cuda", dtype=dtype)
    _, w = route(3, 4, 11, "cuda")
    src = torch.randint(0, 8, (12,), generator=torch.Generator().manual_seed(1)).cuda()
    got = pair_moe(x, w.to(dtype), src, pool)
    want = pair_moe_torch(x, w.to(dtype), src, pool)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got, want, **tol)
    oracle = reference_pairs(x, w.to(dtype), src.view(3, 4), *split_gate_up(pool["gate_up"]), pool["down"],
                             h_dtype=dtype)  # the float64 SwiGLU of every pair's row
    torch.testing.assert_close(got.double().cpu(), oracle.view(3, 4, H).sum(1), **tol)


@cuda
@pytest.mark.skipif(not triton_ready(torch.device("cuda")) if torch.cuda.is_available() else True,
                    reason="needs Triton")
def test_triton_pair_outputs_skip_rowless_pairs():
    """Pairs with src < 0 (the CPU's, moe/bridge.py) are not computed; the others equal the reference."""
    pool = bank(8, 5, "cuda", torch.float32)
    x = torch.randn(2, H, device="cuda")
    _, w = route(2, 4, 13, "cuda")
    src = torch.tensor([3, -1, 0, 7, -1, -1, 2, 5], device="cuda")
    got = pair_outputs(x, w, src, pool)
    want = _pair_outputs_torch(x, w, src, pool)
    keep = src >= 0
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-4, atol=1e-5)
    assert torch.all(want[~keep] == 0)


def test_torch_pair_outputs_with_rowless_pairs():
    """The torch reference computes only pairs with a row; those equal the all-rows computation."""
    pool = bank(8, 6)
    x = torch.randn(2, H)
    _, w = route(2, 4, 14)
    src = torch.tensor([3, -1, 0, 7, -1, 1, 2, 5])
    part = _pair_outputs_torch(x, w, src, pool)
    full = _pair_outputs_torch(x, w, src.clamp(min=0), pool)
    keep = src >= 0
    torch.testing.assert_close(part[keep], full[keep], rtol=1e-6, atol=1e-7)
    assert torch.all(part[~keep] == 0)

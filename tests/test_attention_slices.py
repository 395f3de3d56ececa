"""Prefill attention of a chunk after cached tokens: query slices bounded by SCORES_BYTES and KV heads shared
without repetition give the plain causal softmax attention (float64 reference)."""
from __future__ import annotations

import pytest
import torch

from moestream.layers import attention as attn_mod
from moestream.layers.attention import Attention


def reference(q, k, v, cached, scale, groups):
    """q [L, H, D], k/v [cached + L, Hk, D] -> [L, H, D] in float64."""
    L, H, _ = q.shape
    kk = k.double().repeat_interleave(groups, dim=1)
    vv = v.double().repeat_interleave(groups, dim=1)
    s = torch.einsum("lhd,shd->hls", q.double(), kk) * scale
    pos = cached + torch.arange(L)
    s = s.masked_fill(torch.arange(k.shape[0])[None, None, :] > pos[None, :, None], float("-inf"))
    return torch.einsum("hls,shd->lhd", torch.softmax(s, -1), vv)


@pytest.mark.parametrize("L,cached", [(1, 0), (7, 0), (40, 0), (40, 25), (5, 300), (64, 1000)])
@pytest.mark.parametrize("budget", [attn_mod.SCORES_BYTES, 16 * 4 * 8 * 50])  # the second forces many slices
def test_sliced_gqa_attention_equals_reference(L, cached, budget, monkeypatch):
    monkeypatch.setattr(attn_mod, "SCORES_BYTES", budget)
    torch.manual_seed(L * 7 + cached)
    H, Hk, D = 8, 2, 32
    a = Attention(H * D, H, Hk, D, 1e-6, False, False, True)
    q = torch.randn(L, H, D)
    k, v = torch.randn(cached + L, Hk, D), torch.randn(cached + L, Hk, D)
    got = a._attend(q, k, v, cached)
    want = reference(q, k, v, cached, a.scale, H // Hk)
    assert torch.allclose(got.double(), want, atol=2e-5, rtol=1e-4)
    if budget != attn_mod.SCORES_BYTES and L > 16:  # the slicing was taken: a wrong offset would not match
        wrong = reference(q, k, v, 0 if cached else 1, a.scale, H // Hk)
        assert not torch.allclose(got.double(), wrong, atol=1e-3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("L,cached", [(64, 0), (512, 3000), (300, 20000)])
def test_cuda_lower_right_gqa_attention_equals_reference(L, cached):
    """On CUDA a chunk after cached tokens takes the bottom-right causal bias with shared KV heads (flash /
    efficient kernels, no [L, S] mask): bf16 within rounding of the float64 reference (Qwen3.6 heads)."""
    torch.manual_seed(L)
    H, Hk, D = 16, 2, 256
    a = Attention(H * D, H, Hk, D, 1e-6, False, False, True)
    q = torch.randn(L, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(cached + L, Hk, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(cached + L, Hk, D, device="cuda", dtype=torch.bfloat16)
    got = a._attend(q, k, v, cached).double().cpu()
    want = reference(q.cpu(), k.cpu(), v.cpu(), cached, a.scale, H // Hk)
    assert (got - want).abs().max() < 2e-2


@pytest.mark.parametrize("L,cached", [(1, 0), (40, 0), (40, 25), (5, 300), (64, 1000), (33, 95)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
def test_kv_blocked_attention_equals_reference(L, cached, kv_dtype, monkeypatch):
    """A long context attends block by block over the pool (no whole-context gather): keys in blocks of 40 and
    query slices of 16 rows (both forced small) against the float64 reference over the rows the pool holds."""
    H, Hk, D = 8, 2, 32
    monkeypatch.setattr(attn_mod, "GATHER_BYTES", 2 * Hk * D * 4 * 40)
    monkeypatch.setattr(attn_mod, "SCORES_BYTES", 4 * H * 40 * 16)
    torch.manual_seed(L * 3 + cached)
    a = Attention(H * D, H, Hk, D, 1e-6, False, False, True)
    N = cached + L + 50
    k_pool = (torch.randn(N, Hk, D) * 2).to(kv_dtype)
    v_pool = (torch.randn(N, Hk, D) * 2).to(kv_dtype)
    index = torch.randperm(N)[:cached + L]
    q = torch.randn(L, H, D)
    got = a._attend_blocks(q, k_pool, v_pool, index, cached)
    want = reference(q, k_pool[index].float(), v_pool[index].float(), cached, a.scale, H // Hk)
    assert got.dtype == q.dtype and got.shape == q.shape
    assert torch.allclose(got.double(), want, atol=2e-5, rtol=1e-4)
    if cached:  # the query positions matter: an offset of one off does not match
        wrong = reference(q, k_pool[index].float(), v_pool[index].float(), cached - 1, a.scale, H // Hk)
        assert not torch.allclose(got.double(), wrong, atol=1e-3)


def test_forward_takes_the_blocks_past_the_gather_bound(monkeypatch):
    """Attention.forward of a prefill chunk whose context passes the gather bound (HOST_GATHER_BYTES in host memory,
    GATHER_BYTES on a GPU) attends block by block, and equals the gathered path's output (the bound lowered so a
    200-token context passes it)."""
    from moestream.batch import ForwardBatch, SeqMeta
    from moestream.layers.rotary import Rotary
    H, Hk, D = 4, 2, 16
    torch.manual_seed(0)
    a = Attention(H * D, H, Hk, D, 1e-6, False, False, True)
    with torch.no_grad():  # (the module's tensors are allocated, not initialised)
        for p in a.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    rot = Rotary(D, 10000.0, 4096, "cpu", torch.float32)
    cached, L, N = 180, 20, 256
    k_pool, v_pool = torch.randn(N, Hk, D), torch.randn(N, Hk, D)
    index = torch.randperm(N)[:cached + L]
    x = torch.randn(L, H * D)

    def run():
        kc, vc = k_pool.clone(), v_pool.clone()
        seq = SeqMeta(start=0, length=L, cached=cached, state_slot=-1, kv_index=index)
        batch = ForwardBatch(input_ids=torch.zeros(L, dtype=torch.long), positions=torch.arange(cached, cached + L),
                             seqs=[seq], kv_write_index=index[cached:], logits_index=torch.tensor([L - 1]))
        return a(x, batch, kc, vc, rot)

    calls = []
    orig = Attention._attend_long
    monkeypatch.setattr(Attention, "_attend_long", lambda self, *args: calls.append(1) or orig(self, *args))
    plain = run()
    assert not calls
    monkeypatch.setattr(attn_mod, "GATHER_BYTES", 2 * Hk * D * 4 * 64)  # 200 keys of 4-byte K and V pass it
    assert not calls and torch.equal(run(), plain)  # (the GPU's bound: not this CPU's)
    monkeypatch.setattr(attn_mod, "HOST_GATHER_BYTES", 2 * Hk * D * 4 * 64)
    blocked = run()
    assert calls and plain.isfinite().all()
    assert torch.allclose(blocked, plain, atol=1e-5, rtol=1e-4)

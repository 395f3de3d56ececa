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

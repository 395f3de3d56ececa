"""models/fuse.py: the fused projections compute what the unfused ones did, hold each weight once, and
leave groups with a part that is not a plain dense Linear alone."""
from __future__ import annotations

import torch
from torch import nn

from moestream import LLM, SamplingParams
from moestream.models.fuse import FusedLinear, fuse_projections

SP = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 50))]


def _unfused(path, monkeypatch) -> LLM:
    monkeypatch.setenv("MOESTREAM_FUSE", "0")
    llm = LLM(path, device="cpu", dtype="float32")
    monkeypatch.delenv("MOESTREAM_FUSE")
    return llm


def _tokens(llm):
    return [o.token_ids for o in llm.generate(PROMPTS, SP)]


def test_fused_model_generates_the_unfused_tokens(tiny_checkpoint, monkeypatch):
    for variant in ("qwen35", "qwen3"):
        path = tiny_checkpoint(variant)
        fused, ref = LLM(path, device="cpu", dtype="float32"), _unfused(path, monkeypatch)
        assert any(isinstance(m, FusedLinear) for m in fused.engine.model.modules())
        assert not any(isinstance(m, FusedLinear) for m in ref.engine.model.modules())
        assert _tokens(fused) == _tokens(ref), variant


class Wrapped(nn.Module):
    """Stands for a compressed-weight module: not a plain Linear."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def test_only_plain_groups_fuse_and_weights_are_held_once(tiny_checkpoint, monkeypatch):
    llm = _unfused(tiny_checkpoint("qwen35"), monkeypatch)
    model = llm.engine.model
    before = _tokens(llm)
    numel = sum(p.numel() for p in model.parameters())
    gdn = model.layers[0].linear_attn
    gdn.in_proj_z = Wrapped(gdn.in_proj_z)
    done = fuse_projections(model)
    assert gdn.in_proj is None and isinstance(gdn.in_proj_z, Wrapped)  # the group with a wrapped part
    gdn_layers = sum(layer.kind == "linear_attention" for layer in model.layers)
    assert done["gdn"] == gdn_layers - 1 and done["attention"] >= 1 and done["shared_expert"] >= 1
    assert sum(p.numel() for p in model.parameters()) == numel  # no unfused copies left behind
    assert _tokens(llm) == before


def test_fused_rows_are_the_parts_in_order(tiny_checkpoint, monkeypatch):
    llm = _unfused(tiny_checkpoint("qwen35"), monkeypatch)
    a = next(layer.self_attn for layer in llm.engine.model.layers if layer.kind != "linear_attention")
    parts = [a.q_proj.weight.clone(), a.k_proj.weight.clone(), a.v_proj.weight.clone()]
    fuse_projections(llm.engine.model)
    x = torch.randn(3, parts[0].shape[1])
    for got, w in zip(a.qkv_proj.split(a.qkv_proj(x)), parts):
        torch.testing.assert_close(got, x @ w.t())


def test_compressed_projections_of_several_types_stay_compressed_and_unfused():
    """q/k Q4_K with v Q6_K (a Q4_K_M file's attention): the group is left as three QuantLinears (each read
    compressed; densifying gave bf16 weights under a float32 CPU model: a dtype error at the first step). One
    type: fused by byte rows. With a plain Linear among them: densified to that Linear's dtype, fused dense."""
    from moestream.layers.quant_linear import FusedQuantLinear, QuantLinear
    from moestream.models.fuse import _fuse
    from moestream.quant import gguf_format
    from moestream.quant.synthetic import random_raw

    H = 256

    def ql(t, n, seed):
        return QuantLinear(t, random_raw(gguf_format(t), (n, H), seed=seed), n, H)

    x = torch.randn(2, H)
    for types, fused in ((("Q4_K", "Q4_K", "Q6_K"), None), (("Q4_K",) * 3, FusedQuantLinear)):
        owner = nn.Module()
        for i, (name, t) in enumerate(zip("qkv", types)):
            setattr(owner, name, ql(t, 64, i))
        want = torch.cat([getattr(owner, n)(x) for n in "qkv"], dim=-1)
        ok = _fuse(owner, [(owner, n) for n in "qkv"], "qkv")
        if fused is None:
            assert not ok and all(isinstance(getattr(owner, n), QuantLinear) for n in "qkv")
        else:
            assert ok and isinstance(owner.qkv, fused)
            torch.testing.assert_close(owner.qkv(x), want, rtol=1e-5, atol=1e-5)
    from moestream.kernels.linear import Linear

    # compressed and dense together: the compressed rows the smaller part -> densified, fused dense
    owner = nn.Module()
    owner.q, owner.k = ql("Q4_K", 16, 0), ql("Q6_K", 16, 1)
    owner.v = Linear(H, 64, bias=False)
    nn.init.normal_(owner.v.weight)
    want = x @ torch.cat([owner.q.dense(torch.float32), owner.k.dense(torch.float32), owner.v.weight]).t()
    assert _fuse(owner, [(owner, n) for n in "qkv"], "qkv")
    assert isinstance(owner.qkv, FusedLinear) and owner.qkv.weight.dtype == torch.float32
    torch.testing.assert_close(owner.qkv(x), want, rtol=1e-4, atol=1e-4)
    # ... the compressed rows most of the group (a Qwen3.6 GGUF's GDN in-projections: qkv, z compressed, the
    # 32-row b and a float32): left unfused, each as it is (densified they were ~3.5x the bytes)
    owner = nn.Module()
    owner.q, owner.k = ql("Q4_K", 64, 0), ql("Q6_K", 64, 1)
    owner.v = Linear(H, 16, bias=False)
    assert not _fuse(owner, [(owner, n) for n in "qkv"], "qkv")
    assert isinstance(owner.q, QuantLinear) and isinstance(owner.k, QuantLinear) and type(owner.v) is Linear

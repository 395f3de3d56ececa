"""GGUF routed experts stay compressed (host banks, copies, device slots) and are dequantized inside
the expert computation: every backend gives the tokens of the dequantize-at-load path."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

import gguf_writer
from moestream import LLM, SamplingParams
from moestream.quant import gguf_format

SP = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
COMMON = dict(device="cpu", dtype="float32", chunked_prefill_size=7, max_running_requests=4, moe_cpu_threads=1)
BACKENDS = [
    ("fused", {}),
    ("offload", {"moe_cache_size": 3, "moe_prefetch": "on"}),
    ("cpu", {}),
    ("hybrid", {"moe_cache_size": 3, "moe_prefetch": "on"}),
    # the decode path of CUDA (pair kernels over compressed rows, device slot cache, CPU bridge), run here
    # through its torch references
    ("fused", {"moe_decode_kernel": "pairs"}),
    ("offload", {"moe_cache_size": 3, "moe_decode_kernel": "pairs"}),
    ("cpu", {"moe_decode_kernel": "pairs"}),
    ("hybrid", {"moe_cache_size": 3, "moe_decode_kernel": "pairs"}),
]


pytestmark = pytest.mark.usefixtures("one_torch_thread", "torch_tiles")


@pytest.fixture
def torch_tiles(monkeypatch):
    """The torch tile decoders: these tests hold compressed experts to the dequantize-at-load tokens
    exactly. The compiled CPU kernels round activations to int8 per block (llama.cpp's way), so they
    are held to a logit tolerance instead (tests/test_cpu_kernels.py::test_tiny_gguf_with_kernels)."""
    monkeypatch.setenv("MOESTREAM_CPU_KERNELS", "0")


def _prompts(vocab):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (4, 17, 30)]


def _tokens(llm):
    return [o.token_ids for o in llm.generate(_prompts(llm.model_config.vocab_size), SP)]


@pytest.mark.parametrize("variant", ["qwen3", "qwen35_causal"])
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1])
def test_compressed_experts_every_backend(variant, qtype, tiny_checkpoint, tmp_path):
    path, _ = gguf_writer.write_gguf(tiny_checkpoint(variant), tmp_path / "m.gguf", qtype)
    dense = LLM(path, moe_backend="fused", moe_expert_format="dense", **COMMON)
    assert not dense.engine.runtime.store.fmt.quantized
    want = _tokens(dense)
    dense_store = dense.engine.runtime.store
    for backend, kw in BACKENDS:
        llm = LLM(path, moe_backend=backend, **COMMON, **kw)
        store = llm.engine.runtime.store
        cfg = llm.model_config
        H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        q = gguf_format(qtype.name)
        assert store.fmt.quantized and store.fmt.name == f"gguf:{qtype.name}"
        per_expert = 2 * q.nbytes((I, H)) + q.nbytes((H, I))
        assert store.bytes_per_expert() == per_expert < dense_store.bytes_per_expert() // 2  # smaller than bf16
        layer = store.moe_layers[0]
        for name, bank in store.bank(layer).items():
            assert bank.dtype == torch.uint8 and bank.shape[0] == E
        assert sum(b.numel() for b in store.bank(layer).values()) == E * per_expert
        # the compressed rows hold exactly the weights the dense path dequantized at load
        for got, ref in zip(store.weights(layer, torch.float32), dense_store.weights(layer)):
            assert torch.equal(got, ref)
        assert _tokens(llm) == want, (backend, kw)
        t = llm.stats()["total"]
        rt = llm.engine.runtime
        pairs = kw.get("moe_decode_kernel") == "pairs"
        # the pair path is taken where asked for (asserted, not assumed)
        assert (getattr(rt, "pairs", False) or getattr(rt, "bridge", None) is not None) == pairs, (backend, kw)
        if not pairs or backend in ("offload", "hybrid"):
            assert t["gpu_experts"] + t["cpu_experts"] == t["expert_calls"] > 0
        if backend in ("offload", "hybrid"):
            assert all(a.dtype == torch.uint8 for a in rt.pool.arrays.values())
            assert t["misses"] > 0 and t["evictions"] > 0
            # pairs: every pair that read its expert over the bus counts its compressed bytes
            assert t["bytes_h2d"] == (t["bytes_h2d"] // per_expert if pairs else t["copies"]) * per_expert > 0
        llm.engine.runtime.close()


def test_float_expert_types_fall_back_to_dense(tiny_checkpoint, tmp_path):
    path, _ = gguf_writer.write_gguf(tiny_checkpoint("qwen3"), tmp_path / "m.gguf", Q.F32)
    llm = LLM(path, moe_backend="fused", **COMMON)
    assert not llm.engine.runtime.store.fmt.quantized


def test_put_raw_checks_name_the_tensor():
    from moestream.core import CheckpointError
    from moestream.moe import ExpertStore
    from moestream.moe.formats import gguf_expert_format

    fmt = gguf_expert_format({"gate": "Q8_0", "up": "Q8_0", "down": "Q4_1"}, 64, 32)
    st = ExpertStore([0], 4, 64, 32, fmt, "cpu")
    assert st.bank(0)["down"].shape == (4, gguf_format("Q4_1").nbytes((64, 32)))
    with pytest.raises(CheckpointError, match="blk.0.ffn_up_exps.weight"):
        st.put_raw(0, "up", torch.zeros(10, dtype=torch.uint8), "blk.0.ffn_up_exps.weight")
    with pytest.raises(CheckpointError, match="blk.0.ffn_gate_exps.weight"):
        st.put_raw(0, "gate", torch.zeros(st.bank(0)["gate"].numel()), "blk.0.ffn_gate_exps.weight")
    st.put_raw(0, "gate", torch.zeros(st.bank(0)["gate"].numel(), dtype=torch.uint8), "g")
    assert "p.mlp.experts.0.up_proj.weight" in st.missing(lambda layer: "p.")


def test_expert_mlp_dense_is_compute_and_quantized_is_tiled_exactly(monkeypatch):
    """Dense formats run compute.expert_mlp's ops (bit-identical); quantized formats decode row tiles
    (forced small here) and match a float64 SwiGLU on the gguf package's dequantized weights."""
    import numpy as np
    from gguf import quants

    import moestream.quant.base as qbase
    from moestream.moe.compute import expert_mlp
    from moestream.moe.formats import dense_format, gguf_expert_format
    from moestream.moe.swiglu import reference

    g = torch.Generator().manual_seed(0)
    H, I = 256, 96
    w = {"gate": torch.randn(I, H, generator=g), "up": torch.randn(I, H, generator=g),
         "down": torch.randn(H, I, generator=g)}
    x = torch.randn(5, H, generator=g)
    gate_up = torch.cat([w["gate"], w["up"]])
    assert torch.equal(dense_format(torch.float32).expert_mlp(x, {"gate_up": gate_up, "down": w["down"]}),
                       expert_mlp(x, gate_up, w["down"]))
    types = {"gate": Q.Q8_0, "up": Q.Q4_1, "down": Q.Q8_0}
    fmt = gguf_expert_format({n: t.name for n, t in types.items()}, H, I)
    raw = {n: quants.quantize(w[n].numpy(), types[n]) for n in w}
    deq = {n: torch.from_numpy(quants.dequantize(raw[n], types[n]).astype(np.float64)).reshape(w[n].shape) for n in w}
    want = reference(x, deq["gate"], deq["up"], deq["down"])  # the float64 SwiGLU oracle (moe/swiglu.py)
    monkeypatch.setattr(qbase, "TILE_BYTES", 16 * H * 4)  # 16-row tiles: several per matrix
    got = fmt.expert_mlp(x, {n: torch.from_numpy(r).reshape(-1) for n, r in raw.items()})
    assert (got.double() - want).abs().max() < 1e-5 * want.abs().max()  # fp32 GEMM rounding only


@pytest.mark.parametrize("variant", ["qwen3", "qwen35_causal"])
def test_per_layer_types_stay_compressed(variant, tiny_checkpoint, tmp_path):
    """Q4_K_M-style files give some layers' down projections a bigger type: each layer keeps its own
    bytes, slot rows fit the largest, and every backend still gives the dequantize-at-load tokens."""
    def mix(layer, proj):
        return Q.Q8_0 if proj == "down_proj" and layer % 2 == 0 else Q.Q4_1

    path, _ = gguf_writer.write_gguf(tiny_checkpoint(variant), tmp_path / "m.gguf", Q.Q4_1, expert_qtype=mix)
    want = _tokens(LLM(path, moe_backend="fused", moe_expert_format="dense", **COMMON))
    for backend, kw in BACKENDS:
        llm = LLM(path, moe_backend=backend, **COMMON, **kw)
        store = llm.engine.runtime.store
        cfg = llm.model_config
        H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        q8, q4 = gguf_format("Q8_0"), gguf_format("Q4_1")
        assert store.fmt.quantized and "per layer" in store.fmt.name
        for layer in store.moe_layers:
            down = (q8 if layer % 2 == 0 else q4).nbytes((H, I))
            assert store.bank(layer)["down"].shape == (E, down)
            assert store.bytes_per_expert(layer) == 2 * q4.nbytes((I, H)) + down
        assert store.bytes_per_expert() == 2 * q4.nbytes((I, H)) + q8.nbytes((H, I))  # a slot row fits the largest
        assert _tokens(llm) == want, backend
        t = llm.stats()["total"]
        if backend in ("offload", "hybrid"):
            assert t["misses"] > 0 and t["evictions"] > 0
            per = {layer: llm.stats()["layers"][str(layer)] for layer in store.moe_layers}
            if kw.get("moe_decode_kernel") == "pairs":  # pairs read over the bus, each its layer's compressed bytes
                assert all(s["bytes_h2d"] % store.bytes_per_expert(layer) == 0 for layer, s in per.items())
                assert t["bytes_h2d"] > 0
            else:
                assert all(s["bytes_h2d"] == s["copies"] * store.bytes_per_expert(layer) for layer, s in per.items())
        llm.engine.runtime.close()

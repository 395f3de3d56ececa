"""Q8_0 experts row-planar (Q8_0R) where only the GPU reads them: the layout, its decoders, and the store that
converts to it and back as the backend changes (the kernels: tests/test_qpairs.py, test_grouped.py and
test_triton_dequant.py take Q8_0R cases; on a GPU, test_cuda_planar_q8_experts below)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

import gguf_writer
from moestream import LLM, SamplingParams
from moestream.moe import backends
from moestream.quant import QuantFormatError, gguf_format, qlinear
from moestream.quant.gguf_formats import q8_0_row_planar

SP = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _q8(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """(Q8_0 bytes [n, k / 32 * 34] from the gguf package's quantizer, its float32 dequantization)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = quants.quantize(w, Q.Q8_0)
    return torch.from_numpy(raw.copy()).reshape(n, -1), quants.dequantize(raw, Q.Q8_0).reshape(n, k)


def test_row_layout_holds_the_same_bytes_and_values():
    raw, want = _q8(6, 256)
    planar = q8_0_row_planar(raw.clone(), 256)
    # the layout's definition: a row's 8 block scales (2 bytes each, in block order), then its 256 codes
    blocks = raw.reshape(6, 8, 34)
    assert torch.equal(planar[:, :16], blocks[:, :, :2].reshape(6, 16))
    assert torch.equal(planar[:, 16:], blocks[:, :, 2:].reshape(6, 256))
    assert torch.equal(q8_0_row_planar(planar.clone(), 256, planar=False), raw)  # and back
    fmt = gguf_format("Q8_0R")
    assert fmt.nbytes((6, 256)) == gguf_format("Q8_0").nbytes((6, 256)) == raw.numel()
    got = fmt.dequantize(planar, (6, 256))
    assert torch.equal(got, torch.from_numpy(want))  # the gguf package's values, bit for bit
    assert torch.equal(fmt.dequantize_rows(planar, (6, 256), [4, 1]), got[[4, 1]])
    assert torch.equal(fmt.dequantize_tile(planar, (6, 256), slice(2, 5), slice(64, 160)), got[2:5, 64:160])
    x = torch.randn(3, 256)  # a CPU expert's product of it: torch tiles (the compiled kernels read Q8_0 only)
    torch.testing.assert_close(qlinear(x, fmt, planar, (6, 256)), x @ got.t(), rtol=1e-5, atol=1e-4)


def test_row_layout_refuses_partial_rows():
    raw, _ = _q8(2, 64)
    with pytest.raises(QuantFormatError, match="whole rows"):
        q8_0_row_planar(raw.reshape(-1)[:-34].clone(), 64)
    with pytest.raises(QuantFormatError, match="row layout"):
        gguf_format("Q8_0R").dequantize_blocks(raw)


@pytest.fixture
def planar_on_cpu(monkeypatch):
    """The store's rule as on a GPU (a backend whose CPU threads compute nothing gets Q8_0R), here on a CPU: the
    torch decoders read the layout, so the engine's layout switching runs in CI."""
    monkeypatch.setattr(backends, "q8_planar_wanted",
                        lambda comp, device, mapped_bytes=0: comp.cache == "none" and comp.cpu == "none")
    monkeypatch.setenv("MOESTREAM_CPU_KERNELS", "0")  # torch tiles: the tokens of dequantize-at-load exactly


@pytest.mark.usefixtures("one_torch_thread", "planar_on_cpu")
@pytest.mark.parametrize("variant", ["qwen3", "qwen35_causal"])
def test_store_layout_follows_the_backend(variant, tiny_checkpoint, tmp_path):
    """fused converts the store's Q8_0 experts to Q8_0R (same bytes), offload, cpu and hybrid convert them back,
    through reconfigure_experts on one loaded engine; every backend gives the dequantize-at-load tokens."""
    path, _ = gguf_writer.write_gguf(tiny_checkpoint(variant), tmp_path / "m.gguf", Q.Q8_0)
    common = dict(device="cpu", dtype="float32", chunked_prefill_size=7, max_running_requests=4, moe_cpu_threads=1)
    g = torch.Generator().manual_seed(5)
    dense = LLM(path, moe_backend="fused", moe_expert_format="dense", **common)
    prompts = [torch.randint(0, dense.model_config.vocab_size, (n,), generator=g).tolist() for n in (4, 17, 30)]
    want = [o.token_ids for o in dense.generate(prompts, SP)]
    llm = LLM(path, moe_backend="fused", **common)
    store = llm.engine.runtime.store
    layer = store.moe_layers[0]
    bank_bytes = {n: b.numel() for n, b in store.bank(layer).items()}
    ref = [w.clone() for w in store.weights(layer)]  # (dequantized from Q8_0R: the same values as Q8_0)
    assert store.fmt.name == "gguf:Q8_0R" and store.file_fmt.name == "gguf:Q8_0" and not store.mapped_bytes
    steps = (("fused", {}, "Q8_0R"), ("hybrid", {"moe_cache_size": 3}, "Q8_0"),
             ("fused", {"moe_decode_kernel": "pairs"}, "Q8_0R"),
             ("offload", {"moe_cache_size": 3, "moe_decode_kernel": "pairs"}, "Q8_0"), ("cpu", {}, "Q8_0"),
             ("fused", {}, "Q8_0R"))
    for i, (backend, kw, name) in enumerate(steps):
        if i:  # the first is the engine as loaded
            llm.engine.reconfigure_experts(moe_backend=backend, **kw)
        store = llm.engine.runtime.store
        assert store.fmt.name == f"gguf:{name}", (backend, kw)
        assert {n: b.numel() for n, b in store.bank(layer).items()} == bank_bytes
        assert all(torch.equal(a, b) for a, b in zip(store.weights(layer), ref))
        assert [o.token_ids for o in llm.generate(prompts, SP)] == want, (backend, kw)
    llm.engine.runtime.close()


def test_only_gpu_read_stores_go_planar(monkeypatch):
    """The rule, on any machine (a CUDA device object with Triton said ready: only the rule is under test)."""
    comp, wanted = backends.Composition, backends.q8_planar_wanted
    fused, offload = comp("none", "pairs", "resident", "none"), comp("device", "pairs", "streamed", "none")
    hybrid, cpu_backend = comp("device", "bridge", "streamed", "misses"), comp("host", "bridge", "streamed", "all")
    dev, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(backends, "triton_ready", lambda device: device.type == "cuda")
    monkeypatch.delenv("MOESTREAM_Q8_PLANAR", raising=False)  # the default: fused and offload
    assert wanted(fused, dev) and wanted(offload, dev)
    assert not wanted(hybrid, dev) and not wanted(cpu_backend, dev)  # their CPU kernels read Q8_0
    assert not wanted(fused, cpu) and not wanted(offload, cpu)  # the CPU reads the store there
    assert not wanted(offload, dev, mapped_bytes=1 << 30)  # host banks still the file's pages: left as they are
    assert wanted(fused, dev, mapped_bytes=1 << 30)  # (fused's store is on the GPU)
    monkeypatch.setattr(backends, "triton_ready", lambda device: False)  # --triton off: the torch decoders
    assert not wanted(fused, dev)
    monkeypatch.setattr(backends, "triton_ready", lambda device: True)
    monkeypatch.setenv("MOESTREAM_Q8_PLANAR", "1")  # fused only
    assert wanted(fused, dev) and not wanted(offload, dev) and not wanted(hybrid, dev)
    monkeypatch.setenv("MOESTREAM_Q8_PLANAR", "0")  # the file's layout everywhere
    assert not wanted(fused, dev) and not wanted(offload, dev)
    monkeypatch.setenv("MOESTREAM_Q8_PLANAR", "all")
    assert wanted(offload, dev) and not wanted(hybrid, dev)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", ["qwen3", "qwen35_causal"])
def test_cuda_planar_q8_experts(variant, tiny_checkpoint, tmp_path, monkeypatch):
    """On a GPU, fused reads Q8_0R experts through the pair kernels (asserted), eager and graphed alike; offload, cpu
    and hybrid get the file's layout back. Against fused over the file's layout
    (MOESTREAM_Q8_PLANAR=0) the tokens agree but for near ties: the planar kernel sums a block's 32 products before
    its scale multiplies them (fp32, another order), so a greedy choice between two logits within ~1e-6 may flip and
    the sequence go its own way from there; a wrong code, scale or row makes the tokens unrelated (< 10 % agree)."""
    path, _ = gguf_writer.write_gguf(tiny_checkpoint(variant), tmp_path / "m.gguf", Q.Q8_0)
    common = dict(device="cuda", dtype="bfloat16", max_running_requests=4)
    g = torch.Generator().manual_seed(5)
    monkeypatch.setenv("MOESTREAM_Q8_PLANAR", "0")
    base = LLM(path, moe_backend="fused", **common)
    assert base.engine.runtime.store.fmt.name == "gguf:Q8_0"
    prompts = [torch.randint(0, base.model_config.vocab_size, (n,), generator=g).tolist() for n in (4, 17, 30)]
    block = [o.token_ids for o in base.generate(prompts, SP)]
    base.engine.runtime.close()
    del base
    monkeypatch.setenv("MOESTREAM_Q8_PLANAR", "1")
    outs = {}
    for graphs in (False, True):
        llm = LLM(path, moe_backend="fused", cuda_graphs=graphs, **common)
        for backend, kw, name in (("fused", {}, "Q8_0R"), ("offload", {"moe_cache_size": 5}, "Q8_0"),
                                  ("hybrid", {"moe_cache_size": 5}, "Q8_0"), ("cpu", {}, "Q8_0")):
            if backend != "fused":
                llm.engine.reconfigure_experts(moe_backend=backend, **kw)
            rt = llm.engine.runtime
            assert rt.store.fmt.name == f"gguf:{name}", backend
            assert getattr(rt, "pairs", False) or rt.bridge is not None, backend  # the pair kernels' path
            outs[graphs, backend] = [o.token_ids for o in llm.generate(prompts, SP)]
        llm.engine.runtime.close()
    planar = outs[False, "fused"]
    assert outs[True, "fused"] == planar and outs[True, "offload"] == outs[False, "offload"]
    same = sum(a == b for p, q in zip(planar, block) for a, b in zip(p, q)) / sum(len(p) for p in block)
    assert same >= 0.8, same

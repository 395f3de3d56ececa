"""Multi-token prediction (issue 22): the MTP block of Qwen3.5/3.6 checkpoints, from HF safetensors and from
GGUF files laid out as llama.cpp's converter writes them, and speculative decoding with it."""
from __future__ import annotations

import pytest
import torch

from moestream import LLM, SamplingParams
from moestream.core import ConfigError

SP = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
COMMON = dict(device="cpu", dtype="float32", chunked_prefill_size=7, max_running_requests=4, moe_cpu_threads=1)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def prompts(vocab, sizes=(4, 17, 30, 9)):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in sizes]


def tokens(llm, ps, sp=SP):
    return [o.token_ids for o in llm.generate(ps, sp)]


@pytest.fixture(scope="module")
def mtp_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen35_mtp")


@pytest.fixture(scope="module")
def mtp_gguf(tiny_checkpoint, tmp_path_factory):
    import gguf_writer
    from gguf import GGMLQuantizationType as Q

    path, _ = gguf_writer.write_gguf(tiny_checkpoint("qwen35_mtp", layout="causal"),
                                     tmp_path_factory.mktemp("mtp_gguf") / "m.gguf", Q.Q8_0)
    return path


@pytest.fixture(scope="module")
def plain_tokens(tiny_checkpoint):
    """Greedy tokens of the same model without its MTP block (the checkpoint the block was added to)."""
    llm = LLM(tiny_checkpoint("qwen35"), moe_backend="fused", **COMMON)
    ps = prompts(llm.model_config.vocab_size)
    return ps, tokens(llm, ps)


# ---- loading ---------------------------------------------------------------------------------------
def test_hf_checkpoint_with_mtp_loads_without_it_by_default(mtp_dir, plain_tokens):
    llm = LLM(mtp_dir, moe_backend="fused", **COMMON)
    assert llm.model_config.mtp_num_layers == 1
    assert llm.engine.model.mtp is None  # --speculative none: the block is not read, no memory spent
    assert not any(n.startswith("mtp.") for n, _ in llm.engine.model.named_parameters())
    assert llm.engine.runtime.store.moe_layers == [0, 1, 2, 3]
    assert llm.engine.caches.kv.k.shape[0] == 1  # one full-attention layer
    ps, want = plain_tokens
    assert tokens(llm, ps) == want


def test_hf_mtp_block_loads_with_speculative_mtp(mtp_dir):
    from safetensors import safe_open

    llm = LLM(mtp_dir, moe_backend="fused", speculative="mtp", **COMMON)
    model = llm.engine.model
    assert model.mtp is not None and len(model.mtp.layers) == 1
    assert llm.engine.runtime.store.moe_layers == [0, 1, 2, 3, 4]  # the MTP layer's experts: layer id 4
    assert llm.engine.caches.kv.k.shape[0] == 2  # its K/V after the main model's full-attention layer
    files = sorted(mtp_dir.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                if k.startswith("mtp.") and ".experts." not in k:
                    got = dict(model.named_parameters())[k]
                    assert torch.equal(got, sf.get_tensor(k).to(got.dtype)), k
    fc = dict(model.named_parameters())["mtp.fc.weight"]
    assert fc.shape == (64, 128)


def test_speculative_mtp_needs_a_block(tiny_checkpoint):
    with pytest.raises(ConfigError, match="multi-token-prediction block"):
        LLM(tiny_checkpoint("qwen35"), speculative="mtp", **COMMON)
    with pytest.raises(ConfigError, match="--speculative must be none or mtp"):
        LLM(tiny_checkpoint("qwen35"), speculative="eagle", **COMMON)
    with pytest.raises(ConfigError, match="--num-speculative-tokens"):
        LLM(tiny_checkpoint("qwen35"), speculative="mtp", num_speculative_tokens=0, **COMMON)


def test_gguf_with_nextn_block_loads(mtp_gguf, tiny_checkpoint):
    """A GGUF whose block_count counts the MTP block (blk.4.nextn.*): loads as the 4-layer model, and with
    --speculative mtp its block holds the HF block's weights (Q8_0 rounding aside)."""
    from moestream.models.gguf_loader import open_gguf

    ck = open_gguf(mtp_gguf)
    assert any(t.name == "blk.4.nextn.eh_proj.weight" for t in ck.reader.tensors)
    llm = LLM(mtp_gguf, moe_backend="fused", **COMMON)
    cfg = llm.model_config
    assert (cfg.num_layers, cfg.mtp_num_layers) == (4, 1)
    assert llm.engine.model.mtp is None
    ps = prompts(cfg.vocab_size)
    want = tokens(llm, ps)
    spec = LLM(mtp_gguf, moe_backend="fused", speculative="mtp", **COMMON)
    hf = LLM(tiny_checkpoint("qwen35_mtp", layout="causal"), moe_backend="fused", speculative="mtp", **COMMON)
    a, b = dict(spec.engine.model.named_parameters()), dict(hf.engine.model.named_parameters())
    for k in b:
        if k.startswith("mtp."):
            tol = 1e-6 if "norm" in k else 0.02  # norms are F32 (stored as 1 + w), matrices Q8_0
            assert torch.allclose(a[k], b[k], atol=tol), k
    ga, gb = spec.engine.runtime.store, hf.engine.runtime.store
    assert ga.moe_layers == gb.moe_layers == [0, 1, 2, 3, 4]
    assert tokens(spec, ps) == want

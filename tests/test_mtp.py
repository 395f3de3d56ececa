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


# ---- speculative decoding -----------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_tokens_equal_without_speculation(mtp_dir, plain_tokens, k):
    ps, want = plain_tokens
    llm = LLM(mtp_dir, moe_backend="fused", speculative="mtp", num_speculative_tokens=k, **COMMON)
    assert tokens(llm, ps) == want  # batch 4
    assert [tokens(llm, [p])[0] for p in ps[:2]] == want[:2]  # batch 1
    st = llm.stats()["speculative"]
    assert st["verify_steps"] > 0 and st["drafted"] > 0
    assert len(st["drafted_per_position"]) == k
    llm.scheduler.check_integrity()


BACKENDS = [("offload", {"moe_cache_size": 3}), ("offload", {"moe_cache_size": 3, "moe_decode_kernel": "pairs"}),
            ("cpu", {}), ("hybrid", {"moe_cache_size": 3}), ("fused", {"moe_decode_kernel": "pairs"})]


@pytest.mark.parametrize("backend,kw", BACKENDS)
def test_every_backend_gives_the_same_greedy_tokens(mtp_dir, plain_tokens, backend, kw):
    ps, want = plain_tokens
    llm = LLM(mtp_dir, moe_backend=backend, speculative="mtp", num_speculative_tokens=2, **COMMON, **kw)
    assert tokens(llm, ps) == want  # batch 4
    assert tokens(llm, [ps[1]]) == [want[1]]  # batch 1
    assert llm.stats()["speculative"]["drafted"] > 0
    llm.scheduler.check_integrity()


def script_drafter(llm, seqs, wrong_from: int | None = None):
    """Make the MTP block's drafts scripted: at position j with input token x[j+1] it proposes x[j+2] of the
    known greedy continuation (a drafter that agrees with the model); from draft step `wrong_from` on it
    proposes a different token. The block still runs (its K/V, its experts): only its logits are replaced."""
    table = {}
    for s in seqs:
        for j in range(len(s) - 2):
            assert table.setdefault((j, s[j + 1]), s[j + 2]) == s[j + 2]  # no ambiguity between prompts
    real, V = llm.engine.draft, llm.model_config.vocab_size

    def draft(batch, hidden, step=0):
        logits = real(batch, hidden, step)
        pos, ids = batch.positions.tolist(), batch.input_ids.tolist()
        out = torch.full_like(logits, -1e4)
        for i, r in enumerate(batch.logits_index.tolist()):
            nxt = table.get((pos[r], ids[r]), 0)
            out[i, (nxt + 1) % V if wrong_from is not None and step >= wrong_from else nxt] = 0.0
        return out

    llm.engine.draft = draft


def expected_counters(max_tokens: int, k: int, right: int) -> tuple[list[int], list[int], int]:
    """Per-position drafted / accepted counts and verify steps of one request whose drafter is right for
    its first `right` drafts of every step (trimmed to what max_tokens leaves)."""
    drafted, accepted, steps, emitted, out = [0] * k, [0] * k, 0, 0, 1
    while out < max_tokens:
        n = min(k, max_tokens - out - 1)
        a = min(n, right)
        if n:  # with no room for a draft the step is a plain decode step
            steps += 1
            emitted += a + 1
        for i in range(n):
            drafted[i] += 1
            accepted[i] += i < a
        out += a + 1
    return drafted, accepted, steps, emitted


@pytest.mark.parametrize("k,right", [(3, 3), (2, 1), (3, 0)])
def test_acceptance_counters_exact_with_a_scripted_drafter(mtp_dir, plain_tokens, k, right):
    ps, want = plain_tokens
    # prompts in one chunk: each request's first token comes from its prefill, every later one from decode
    # steps (a prompt cut at a page boundary would end its prefill with a one-token step that verifies a draft)
    llm = LLM(mtp_dir, moe_backend="fused", speculative="mtp", num_speculative_tokens=k,
              **{**COMMON, "chunked_prefill_size": 64})
    script_drafter(llm, [p + w for p, w in zip(ps, want)], wrong_from=right)
    assert tokens(llm, ps) == want
    st = llm.stats()["speculative"]
    d, a, steps, emitted = expected_counters(SP.max_tokens, k, right)
    assert st["drafted_per_position"] == [x * len(ps) for x in d]
    assert st["accepted_per_position"] == [x * len(ps) for x in a]
    assert st["verify_steps"] == steps * len(ps)
    assert st["acceptance_rate"] == pytest.approx(sum(a) / sum(d))
    assert st["emitted"] == emitted * len(ps)
    llm.scheduler.check_integrity()

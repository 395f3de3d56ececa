"""benchmarks/make_qwen36_q4km.py: the tiny Q4_K_M and Q8_0 files it writes are valid GGUF (the gguf package
reads them, every tensor has the type the mix asks for, the weights are sane) and moestream's real loader
runs them exactly like the same weights stored as F32 (the --dequantized twin), routed experts kept compressed."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import make_qwen36_q4km as mk  # noqa: E402


def test_q4_k_m_mix_follows_llama_cpp_rule():
    n = 40
    more = [i for i in range(n) if mk.more_bits(i, n)]
    assert len(more) == 20 and more[:6] == [0, 1, 2, 3, 4, 7] and more[-5:] == [35, 36, 37, 38, 39]
    t = lambda name, role: mk.quant_type("q4_k_m", name, role, n)  # noqa: E731
    assert t("blk.0.ffn_down_exps.weight", "exps_down") == "Q6_K"
    assert t("blk.5.ffn_down_exps.weight", "exps_down") == "Q4_K"
    assert t("blk.5.ffn_gate_exps.weight", "exps_gate_up") == "Q4_K"
    assert t("output.weight", "output") == "Q6_K" and t("token_embd.weight", "embd") == "Q4_K"
    assert t("blk.3.attn_norm.weight", "ones") == "F32"
    assert mk.quant_type("q8_0", "blk.5.attn_q.weight", "proj", n) == "Q8_0"


@pytest.mark.parametrize("quant", ["q4_k_m", "q8_0", "iq3_s"])
def test_tiny_file_reads_and_runs_like_its_dequantized_twin(quant, tmp_path, monkeypatch):
    import gguf
    from gguf.quants import dequantize

    from moestream import LLM, SamplingParams
    from test_engine_parity import full_logits

    path, twin = tmp_path / f"{quant}.gguf", tmp_path / f"{quant}-f32.gguf"
    types = mk.write(path, quant, mk.TINY, mk.synthetic_vocab(512), log=lambda *a: None)
    mk.write(twin, quant, mk.TINY, mk.synthetic_vocab(512), dequantized=True, log=lambda *a: None)

    # the gguf package's reader: every tensor present with the type the mix asked for, sane values
    r = gguf.GGUFReader(str(path))
    assert r.fields["general.architecture"].contents() == "qwen35moe"
    assert {t.name: t.tensor_type.name for t in r.tensors} == {k: v for k, v in types.items() if k != "_summary"}
    kinds = {t.tensor_type.name for t in r.tensors}
    assert kinds == {"q4_k_m": {"F32", "Q4_K", "Q6_K"}, "q8_0": {"F32", "Q8_0"},
                     "iq3_s": {"F32", "Q4_K", "Q6_K", "IQ3_S"}}[quant]
    twin_r = {t.name: t for t in gguf.GGUFReader(str(twin)).tensors}
    for t in r.tensors:
        if t.tensor_type.name != "F32":
            v = dequantize(t.data, t.tensor_type)
            assert np.isfinite(v).all() and 0.015 < v.std() < 0.025 and abs(v.mean()) < 2e-3, t.name
            assert np.array_equal(v.reshape(-1), np.asarray(twin_r[t.name].data).reshape(-1)), t.name

    # moestream's loader: compressed routed experts, the same logits and greedy tokens as the F32 twin (the
    # exact tile path: the CPU kernels round activations to int8, tests/test_cpu_kernels.py bounds that)
    monkeypatch.setenv("MOESTREAM_CPU_KERNELS", "0")
    opts = dict(device="cpu", dtype="float32", max_seq_len_override=128, num_tokens=256, max_running_requests=2)
    q, f = LLM(path, **opts), LLM(twin, **opts)
    assert getattr(q.engine.runtime.store.fmt, "quantized", False)
    assert not getattr(f.engine.runtime.store.fmt, "quantized", False)
    ids = list(range(5, 25))
    lq, lf = full_logits(q, ids), full_logits(f, ids)
    assert (lq - lf).norm() / lf.norm() < 1e-4
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert q.generate([ids], sp)[0].token_ids == f.generate([ids], sp)[0].token_ids


def test_cut_vocab_keeps_a_consistent_bpe():
    chars = mk.byte_chars()
    assert len(set(chars)) == 256
    tok = mk.synthetic_vocab(1000)
    cut = mk.cut_vocab(tok, 300)
    toks = cut["tokenizer.ggml.tokens"]
    assert len(toks) == 300 and toks[-3:] == list(mk.SPECIALS) and cut["tokenizer.ggml.eos_token_id"] == 299
    have = set(toks)
    assert all(a in have and b in have and a + b in have for a, b in (m.split(" ") for m in cut["tokenizer.ggml.merges"]))
    assert torch.tensor(cut["tokenizer.ggml.token_type"][-3:]).tolist() == [3, 3, 3]

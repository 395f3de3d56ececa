"""The built-in demo checkpoint: written without transformers, loaded by our loader and by transformers
to the same logits (so its tensor names, shapes and config are real HF Qwen3.5-MoE)."""
from __future__ import annotations

import json

import tiny_models
from test_engine_parity import full_logits
from moestream.core import SamplingParams
from moestream.demo import DEMO_VERSION, ensure_demo_checkpoint, write_demo_checkpoint
from moestream.llm import LLM


def test_demo_matches_transformers(tmp_path):
    folder = write_demo_checkpoint(tmp_path / "demo")
    names = tiny_models.tensor_names(folder)
    assert "model.language_model.layers.0.mlp.experts.15.gate_proj.weight" in names
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    llm = LLM(folder, device="cpu", dtype="float32")
    ids = llm.tokenizer.encode("Hello, world! How are you today?")
    hf = tiny_models.hf_reference(folder)
    ref = tiny_models.hf_logits(hf, ids)
    assert 1.0 < float(ref.std()) < 20.0  # spread out: greedy decoding is not decided by noise
    ours = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids
    assert ours == tiny_models.hf_greedy(hf, ids, 8)
    ours_logits = full_logits(llm, ids)
    assert ours_logits.shape == ref.shape
    assert (ours_logits - ref).norm() / ref.norm() < 1e-4


def test_ensure_is_cached_and_versioned(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = ensure_demo_checkpoint()
    assert first == tmp_path / "moestream" / "demo"
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_checkpoint() == first and (first / "model.safetensors").stat().st_mtime_ns == stamp
    (first / "moestream_demo.json").write_text(json.dumps({"version": DEMO_VERSION + "-old"}))
    ensure_demo_checkpoint()  # a stale folder is rebuilt, not half-used
    assert json.loads((first / "moestream_demo.json").read_text())["version"] == DEMO_VERSION
    assert not [p for p in tmp_path.joinpath("moestream").iterdir() if p.name.startswith(".demo-")]

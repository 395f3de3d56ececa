"""Checkpoint layouts and the errors of config parsing and loading."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moestream import LLM, SamplingParams
from moestream.config import ModelConfig
from moestream.core import CheckpointError, ConfigError

SP = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [[3, 14, 15, 92, 65, 35]]


def tokens(path, **kw):
    return LLM(path, device="cpu", dtype="float32", **kw).generate(PROMPT, SP)[0].token_ids


@pytest.mark.parametrize("variant", ["qwen3", "qwen35"])
def test_sharded_stacked_and_single_load_identically(variant, tiny_checkpoint):
    base = tokens(tiny_checkpoint(variant))
    assert tokens(tiny_checkpoint(variant, sharded=True)) == base
    assert tokens(tiny_checkpoint(variant, expert_layout="stacked")) == base
    assert tokens(tiny_checkpoint(variant, sharded=True, expert_layout="stacked")) == base
    llm = LLM(tiny_checkpoint(variant, sharded=True), device="cpu", dtype="float32")
    ref = LLM(tiny_checkpoint(variant), device="cpu", dtype="float32")
    for (n, a), (_, b) in zip(llm.engine.model.state_dict().items(), ref.engine.model.state_dict().items()):
        assert torch.equal(a, b), n


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_weights(folder, fn):
    f = folder / "model.safetensors"
    t = load_file(str(f))
    fn(t)
    save_file(t, str(f), metadata={"format": "pt"})


def test_missing_tensor_is_named(tiny_checkpoint, tmp_path):
    d = _copy(tiny_checkpoint("qwen35"), tmp_path / "m")
    key = "model.language_model.layers.0.linear_attn.in_proj_z.weight"
    _edit_weights(d, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="in_proj_z"):
        LLM(d, device="cpu")


def test_missing_expert_is_named(tiny_checkpoint, tmp_path):
    d = _copy(tiny_checkpoint("qwen3"), tmp_path / "m")
    _edit_weights(d, lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"layers\.2\.mlp\.experts\.5\.up_proj"):
        LLM(d, device="cpu")


def test_unexpected_tensor_is_named(tiny_checkpoint, tmp_path):
    d = _copy(tiny_checkpoint("qwen3"), tmp_path / "m")
    _edit_weights(d, lambda t: t.__setitem__("model.layers.0.self_attn.bogus.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match="bogus"):
        LLM(d, device="cpu")


def test_misshaped_tensor_is_named(tiny_checkpoint, tmp_path):
    d = _copy(tiny_checkpoint("qwen3"), tmp_path / "m")
    key = "model.layers.1.self_attn.o_proj.weight"
    _edit_weights(d, lambda t: t.__setitem__(key, torch.zeros(3, 3)))
    with pytest.raises(CheckpointError, match=r"o_proj.*shape"):
        LLM(d, device="cpu")


def test_corrupt_safetensors_is_a_clear_error(tiny_checkpoint, tmp_path):
    d = _copy(tiny_checkpoint("qwen3"), tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="safetensors"):
        LLM(d, device="cpu")


def test_shard_missing_from_index(tiny_checkpoint, tmp_path):
    d = _copy(tiny_checkpoint("qwen3", sharded=True), tmp_path / "m")
    shard = sorted(d.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        LLM(d, device="cpu")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"], "hidden_size": 8}))
    with pytest.raises(ConfigError, match="unsupported architecture 'MambaForCausalLM'.*Qwen3MoeForCausalLM"):
        ModelConfig.from_hf(tmp_path)


@pytest.mark.parametrize("text,match", [
    ("{not json", "cannot parse"),
    ("[1, 2]", "JSON object"),
    ('{"hidden_size": 8}', "architectures"),
])
def test_malformed_config(tmp_path, text, match):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf(tmp_path)


def test_config_missing_field_and_bad_values(tiny_checkpoint):
    raw = json.loads((tiny_checkpoint("qwen3") / "config.json").read_text())
    broken = {k: v for k, v in raw.items() if k != "hidden_size"}
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig.from_hf(broken)
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        ModelConfig.from_hf({**raw, "num_experts_per_tok": 1000})
    with pytest.raises(ConfigError, match="rope type"):
        ModelConfig.from_hf({**raw, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_both_qwen35_layouts_parse_to_same_text_config(tiny_checkpoint):
    a = ModelConfig.from_hf(tiny_checkpoint("qwen35"))
    b = ModelConfig.from_hf(tiny_checkpoint("qwen35_causal"))
    assert a.weight_prefix == "model.language_model." and b.weight_prefix == "model."
    assert a.layer_types == b.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert a.rotary_dim == 8 and a.attn_output_gate and a.norm_zero_centered
    assert tokens(tiny_checkpoint("qwen35")) == tokens(tiny_checkpoint("qwen35_causal"))


def test_hub_id_resolves_through_huggingface_hub_offline(tiny_checkpoint, tmp_path, monkeypatch):
    """`--model-path org/name` goes through huggingface_hub: lay out a hub cache and load offline."""
    cache = tmp_path / "hub"
    repo = cache / "models--tiny-org--tiny-moe"
    commit = "0" * 40
    snap = repo / "snapshots" / commit
    shutil.copytree(tiny_checkpoint("qwen3"), snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    assert tokens("tiny-org/tiny-moe") == tokens(tiny_checkpoint("qwen3"))
    with pytest.raises(ConfigError, match="cannot fetch model 'tiny-org/absent'"):
        LLM("tiny-org/absent", device="cpu")


def test_bad_model_path_and_engine_options(tmp_path):
    with pytest.raises(ConfigError, match="not a folder"):
        LLM(str(tmp_path / "nope" / "deeper" / "x"), device="cpu")
    with pytest.raises(ConfigError, match="unknown engine option"):
        LLM(str(tmp_path), device="cpu", not_a_flag=3)
    with pytest.raises(ConfigError, match="--max-running-requests"):
        LLM(str(tmp_path), device="cpu", max_running_requests=0)
    with pytest.raises(ConfigError, match="--moe-backend"):
        LLM(str(tmp_path), device="cpu", moe_backend="magic")


def test_random_weights_from_a_config_dict(tiny_checkpoint):
    """LLM(config_dict) builds the model with random weights in memory (for full-size benchmarks)."""
    raw = json.loads((tiny_checkpoint("qwen35") / "config.json").read_text())
    llm = LLM(raw, device="cpu", dtype="float32")
    assert llm.tokenizer is None
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    gate_up, _ = llm.engine.runtime.store.weights(0)
    assert gate_up.std() > 0.01  # the experts were filled, not left empty

"""The built-in demo checkpoint: a tiny Qwen3.5-MoE model with RANDOM weights.

`moestream serve` with no `--model-path` serves this, so a fresh machine can try the whole stack
(HTTP API, scheduler, expert runtime) without downloading gigabytes. It writes a real Hugging Face
folder (config.json, model.safetensors with the HF tensor names, tokenizer files), without
transformers, so the normal loader reads it and transformers can load it too (a test checks that
both give the same logits). The text it generates is gibberish: the weights are random.
"""
from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from .demo_tokenizer import EOS_TOKEN, PAD_TOKEN, build_tokenizer, special_token_ids
from .random_weights import demo_tensor

log = logging.getLogger("moestream.demo")

# Bump when the files change, so an old cache folder is rebuilt instead of half-matching.
DEMO_VERSION = "1"
DEMO_NAME = "moestream-demo-qwen3.5-moe-random"
_MARKER = "moestream_demo.json"

# Small enough to load in a second on CPU; every part of Qwen3.5-MoE is there (3 Gated DeltaNet
# layers + 1 gated full-attention layer, routed experts with top-k, a shared expert).
TEXT_CONFIG = dict(
    hidden_size=128,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=128,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    attention_bias=False,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    model_type="qwen3_5_moe_text",
)

# transformers builds a (large) default vision tower when vision_config is absent; this is the
# smallest valid one. Its weights are not written: moestream serves text only.
VISION_CONFIG = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, in_channels=3, patch_size=4,
                     spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=128, num_position_embeddings=16,
                     hidden_act="gelu_pytorch_tanh", model_type="qwen3_5_moe_vision")

PREFIX = "model.language_model."


def default_cache_dir() -> Path:
    from .env import cache_dir

    return cache_dir() / "demo"


def ensure_demo_checkpoint(folder: str | Path | None = None) -> Path:
    """The demo folder, written on first use (atomically: a crash never leaves a half folder)."""
    folder = Path(folder) if folder is not None else default_cache_dir()
    if _is_current(folder):
        return folder
    log.info("writing the built-in demo checkpoint (random weights) to %s", folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=folder.parent))
    try:
        write_demo_checkpoint(tmp)
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _is_current(folder: Path) -> bool:
    try:
        return json.loads((folder / _MARKER).read_text()).get("version") == DEMO_VERSION
    except (OSError, ValueError):
        return False


def write_demo_checkpoint(out: str | Path, seed: int = 0) -> Path:
    """Write tokenizer files, config.json, generation_config.json and model.safetensors into `out`."""
    out = Path(out)
    vocab = build_tokenizer(out)
    ids = special_token_ids(out)
    text = dict(TEXT_CONFIG, vocab_size=vocab, eos_token_id=ids[EOS_TOKEN], pad_token_id=ids[PAD_TOKEN],
                bos_token_id=None)
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
              "dtype": "float32", "tie_word_embeddings": False, "text_config": text,
              "vision_config": VISION_CONFIG}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(demo_tensors(text, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / _MARKER).write_text(json.dumps({"version": DEMO_VERSION, "name": DEMO_NAME,
                                           "note": "random weights: the output is gibberish"}) + "\n")
    return out


def demo_tensors(text: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every language-model tensor under its HF name, with per-expert expert tensors."""
    shapes = _shapes(text)
    return {name: demo_tensor(name, shape, seed) for name, shape in shapes.items()}


def _shapes(c: dict) -> dict[str, tuple[int, ...]]:
    h, v = c["hidden_size"], c["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {"lm_head.weight": (v, h), PREFIX + "embed_tokens.weight": (v, h),
                                          PREFIX + "norm.weight": (h,)}
    for i, kind in enumerate(c["layer_types"]):
        p = f"{PREFIX}layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes.update(_linear_attn_shapes(p + "linear_attn.", c) if kind == "linear_attention"
                      else _attn_shapes(p + "self_attn.", c))
        shapes.update(_moe_shapes(p + "mlp.", c))
    return shapes


def _attn_shapes(p: str, c: dict) -> dict[str, tuple[int, ...]]:
    h, hd = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    # q_proj carries the query and its output gate, hence 2 * q rows.
    return {p + "q_proj.weight": (2 * q, h), p + "k_proj.weight": (kv, h), p + "v_proj.weight": (kv, h),
            p + "o_proj.weight": (h, q), p + "q_norm.weight": (hd,), p + "k_norm.weight": (hd,)}


def _linear_attn_shapes(p: str, c: dict) -> dict[str, tuple[int, ...]]:
    h, nv = c["hidden_size"], c["linear_num_value_heads"]
    kdim = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    vdim = nv * c["linear_value_head_dim"]
    conv = 2 * kdim + vdim
    return {p + "in_proj_qkv.weight": (conv, h), p + "in_proj_z.weight": (vdim, h), p + "in_proj_b.weight": (nv, h),
            p + "in_proj_a.weight": (nv, h), p + "conv1d.weight": (conv, 1, c["linear_conv_kernel_dim"]),
            p + "dt_bias": (nv,), p + "A_log": (nv,), p + "norm.weight": (c["linear_value_head_dim"],),
            p + "out_proj.weight": (h, vdim)}


def _moe_shapes(p: str, c: dict) -> dict[str, tuple[int, ...]]:
    h, inter, shared = c["hidden_size"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
    out = {p + "gate.weight": (c["num_experts"], h), p + "shared_expert_gate.weight": (1, h),
           p + "shared_expert.gate_proj.weight": (shared, h), p + "shared_expert.up_proj.weight": (shared, h),
           p + "shared_expert.down_proj.weight": (h, shared)}
    for e in range(c["num_experts"]):
        out[f"{p}experts.{e}.gate_proj.weight"] = (inter, h)
        out[f"{p}experts.{e}.up_proj.weight"] = (inter, h)
        out[f"{p}experts.{e}.down_proj.weight"] = (h, inter)
    return out

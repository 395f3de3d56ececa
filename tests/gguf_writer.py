"""Test helper: write a tiny HF checkpoint as a GGUF file the way llama.cpp's converter lays it out,
and build the matching "dequantized" HF model (the gguf package's own quantize -> dequantize) as
the oracle. Test-only: uses transformers, gguf and the tiny_models helpers.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q, GGUFWriter
from gguf import quants

import tiny_models

ARCH = {"Qwen3MoeForCausalLM": "qwen3moe", "Qwen3_5MoeForCausalLM": "qwen35moe", "LlamaForCausalLM": "llama"}
HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight", "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight", "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight", "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
}


_IQ4_LEVELS = np.array((-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113), dtype=np.float32)


def _iq4_codes(v: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Nearest IQ4_NL level index of v / scale (per block of 32, last axis) packed ggml-style: byte i holds
    value i (low nibble) and value i + 16 (high nibble)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(scale != 0, v / scale, 0.0)
    q = np.abs(r[..., None] - _IQ4_LEVELS).argmin(-1).astype(np.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def _quantize_iq4(arr: np.ndarray, qtype: Q) -> np.ndarray:
    """A simple IQ4_NL / IQ4_XS quantizer (the gguf package has none): per 32 values the scale that maps
    the largest magnitude to the level -127; IQ4_XS stores those as 6-bit multiples of one fp16 d per 256.
    Not llama.cpp's search, only valid blocks close to the weights (the oracle dequantizes what is stored)."""
    rows = arr.reshape(-1, 32).astype(np.float32)
    idx = np.abs(rows).argmax(-1)
    s = -rows[np.arange(len(rows)), idx] / 127  # the extreme value -> level -127
    if qtype == Q.IQ4_NL:
        d = s.astype(np.float16)
        return np.concatenate([d.view(np.uint8).reshape(-1, 2), _iq4_codes(rows, d.astype(np.float32)[:, None])], 1)
    s = s.reshape(-1, 8)
    d = (np.abs(s).max(-1) / 31).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = np.clip(np.where(df != 0, np.round(s / df), 0), -32, 31).astype(np.int32) + 32
    codes = _iq4_codes(rows.reshape(-1, 8, 32), (df * (ls - 32))[..., None]).reshape(-1, 128)
    sh = sum((ls[:, j] >> 4).astype(np.uint16) << (2 * j) for j in range(8)).astype(np.uint16)
    sl = ((ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)).astype(np.uint8)
    out = [d.view(np.uint8).reshape(-1, 2), sh.view(np.uint8).reshape(-1, 2), sl, codes]
    return np.concatenate(out, 1)


def quantize(arr: np.ndarray, qtype: Q) -> np.ndarray:
    """The gguf package's quantize, or the test quantizer above for IQ4_NL / IQ4_XS; rows of bytes."""
    if qtype in (Q.IQ4_NL, Q.IQ4_XS):
        blk, size = quants.GGML_QUANT_SIZES[qtype]
        return _quantize_iq4(arr, qtype).reshape(*arr.shape[:-1], arr.shape[-1] // blk * size)
    return quants.quantize(arr, qtype)


def roundtrip(w: torch.Tensor, qtype: Q) -> torch.Tensor:
    """The gguf package's own quantize -> dequantize (the oracle's view of a quantized weight)."""
    if qtype == Q.F32:
        return w.float()
    data = quantize(w.float().numpy(), qtype)
    return torch.from_numpy(quants.dequantize(data, qtype).reshape(w.shape).astype(np.float32))


def _tile(w, dim, hk, rep):
    """HF grouped value-head order -> llama.cpp's tiled order along dim (inverse of our loader)."""
    if rep == 1:
        return w
    w = w.movedim(dim, 0)
    unit = w.shape[0] // (hk * rep)
    w = w.reshape(hk, rep, unit, *w.shape[1:]).transpose(0, 1).reshape(-1, *w.shape[1:])
    return w.movedim(0, dim)


def _permute(w, heads):
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _to_gguf_layout(arch: str, leaf: str, w: torch.Tensor, tc: dict) -> torch.Tensor:
    if arch == "llama" and leaf in ("attn_q.weight", "attn_k.weight"):
        return _permute(w, tc["num_attention_heads"] if leaf == "attn_q.weight" else tc["num_key_value_heads"])
    if arch != "qwen35moe":
        return w
    hk = tc.get("linear_num_key_heads", 1)
    rep = tc.get("linear_num_value_heads", 1) // hk
    kd = hk * tc.get("linear_key_head_dim", 0)
    if leaf in ("attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight",
                "output_norm.weight"):
        return w + 1.0
    if leaf in ("attn_gate.weight", "ssm_alpha.weight", "ssm_beta.weight", "ssm_dt.bias"):
        return _tile(w, 0, hk, rep)
    if leaf == "ssm_a":
        return -torch.exp(_tile(w, 0, hk, rep))
    if leaf == "ssm_out.weight":
        return _tile(w, 1, hk, rep)
    if leaf in ("attn_qkv.weight", "ssm_conv1d.weight"):
        w = w.squeeze(1) if leaf == "ssm_conv1d.weight" else w
        return torch.cat([w[:2 * kd], _tile(w[2 * kd:], 0, hk, rep)])
    if leaf == "ffn_gate_inp_shexp.weight":
        return w.reshape(-1)
    return w


def _qtype_for(w: torch.Tensor, leaf: str, qtype: Q) -> Q:
    block = quants.GGML_QUANT_SIZES[qtype][0] if qtype != Q.F32 else 1
    quantizable = w.dim() >= 2 and w.shape[-1] % block == 0 and "norm" not in leaf and leaf not in (
        "ssm_conv1d.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")
    return qtype if quantizable else Q.F32


def write_gguf(hf_dir: Path, out: Path, qtype: Q = Q.Q8_0, expert_qtype=None) -> tuple[Path, dict[str, torch.Tensor]]:
    """Write hf_dir as GGUF. Returns (path, HF state dict with every weight replaced by what the
    GGUF holds, dequantized by the gguf package). expert_qtype(layer, "gate_proj"|"up_proj"|"down_proj")
    may give routed experts their own type per layer and array (Q4_K_M-style mixes)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    tc = cfg.get("text_config", cfg)
    arch = ARCH[cfg["architectures"][0]]
    sd = tiny_models.read_state_dict(hf_dir)
    prefix = "model.language_model." if any(k.startswith("model.language_model.") for k in sd) else "model."
    w = GGUFWriter(str(out), arch)
    _metadata(w, arch, tc, cfg, hf_dir)
    oracle: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    L = tc["num_hidden_layers"]
    for name, t in sd.items():
        if name.startswith("model.visual."):
            continue
        local = name[len(prefix):] if name.startswith(prefix) else name
        if local.startswith("mtp."):  # llama.cpp's layout: block L + i, nextn.* for the block's own tensors
            local = _mtp_local(local, L)
            if local.startswith("nextn."):
                leaf = NEXTN[local[len("nextn."):]]
                g = t.float() + 1.0 if "norm" in leaf else t.float()  # qwen35 norms are stored as 1 + w
                _add(w, f"blk.{L}.{leaf}", g, _qtype_for(g, leaf, qtype))
                continue
        if ".mlp.experts." in local:
            layer, _, _, e, proj, _ = local.split(".")[1], *local.split(".")[2:]
            experts.setdefault((int(layer), proj), {})[int(e)] = t
            continue
        gname, leaf = _gguf_name(local, arch)
        g = _to_gguf_layout(arch, leaf, t.float(), tc)
        q = _qtype_for(g, leaf, qtype)
        _add(w, gname, g, q)
        if name.startswith("mtp."):
            continue  # not in the HF oracle (transformers ignores the block)
        back = roundtrip(g, q)
        oracle[name] = _from_gguf_layout(arch, leaf, back, tc, t.shape)
    for (layer, proj), per in sorted(experts.items()):
        stacked = torch.stack([per[e] for e in sorted(per)]).float()  # [E, out, in]
        q = _qtype_for(stacked, "exps", expert_qtype(layer, proj) if expert_qtype else qtype)
        _add(w, f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight", stacked, q)
        if layer >= L:
            continue  # an MTP layer's experts: not in the HF oracle
        back = roundtrip(stacked.reshape(-1, stacked.shape[-1]), q).reshape(stacked.shape)
        # transformers holds experts stacked in memory: gate_up_proj [E, 2I, H], down_proj [E, H, I]
        key = f"{prefix}layers.{layer}.mlp.experts."
        if proj == "down_proj":
            oracle[key + "down_proj"] = back
        else:
            oracle.setdefault(key + "_halves", {})[proj] = back
            halves = oracle[key + "_halves"]
            if len(halves) == 2:
                oracle[key + "gate_up_proj"] = torch.cat([halves["gate_proj"], halves["up_proj"]], dim=1)
                del oracle[key + "_halves"]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out, oracle


NEXTN = {"fc.weight": "nextn.eh_proj.weight", "pre_fc_norm_embedding.weight": "nextn.enorm.weight",
         "pre_fc_norm_hidden.weight": "nextn.hnorm.weight", "norm.weight": "nextn.shared_head_norm.weight"}


def _mtp_local(local: str, num_layers: int) -> str:
    """mtp.layers.i.X -> layers.{L + i}.X; the block's own tensors -> their nextn.* key in NEXTN."""
    rest = local[len("mtp."):]
    if rest.startswith("layers."):
        _, i, tail = rest.split(".", 2)
        return f"layers.{num_layers + int(i)}.{tail}"
    return "nextn." + rest


def _from_gguf_layout(arch, leaf, back, tc, shape):
    """Oracle weights in HF layout: undo the layout change exactly (it is a permutation or +-1)."""
    from moestream.config import ModelConfig
    from moestream.models import gguf_loader as gl

    if arch == "llama" and leaf in ("attn_q.weight", "attn_k.weight"):
        heads = tc["num_attention_heads"] if leaf == "attn_q.weight" else tc["num_key_value_heads"]
        return gl._unpermute(back, heads).reshape(shape)
    if arch == "qwen35moe":
        if leaf.endswith("norm.weight") and leaf != "ssm_norm.weight":
            return (back - 1.0).reshape(shape)
        hk = tc["linear_num_key_heads"]
        rep = tc["linear_num_value_heads"] // hk
        kd = hk * tc["linear_key_head_dim"]
        if leaf in ("attn_gate.weight", "ssm_alpha.weight", "ssm_beta.weight", "ssm_dt.bias"):
            return gl._untile(back, 0, hk, rep).reshape(shape)
        if leaf == "ssm_a":
            return torch.log(-gl._untile(back, 0, hk, rep)).reshape(shape)
        if leaf == "ssm_out.weight":
            return gl._untile(back, 1, hk, rep).reshape(shape)
        if leaf in ("attn_qkv.weight", "ssm_conv1d.weight"):
            return torch.cat([back[:2 * kd], gl._untile(back[2 * kd:], 0, hk, rep)]).reshape(shape)
    return back.reshape(shape)


def _gguf_name(local: str, arch: str) -> tuple[str, str]:
    top = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if local in top:
        return top[local], top[local]
    parts = local.split(".")
    rest = ".".join(parts[2:])
    if rest == "post_attention_layernorm.weight":
        leaf = "post_attention_norm.weight" if arch == "qwen35moe" else "ffn_norm.weight"
    else:
        leaf = HF_TO_GGUF[rest]
    return f"blk.{parts[1]}.{leaf}", leaf


def _add(w: GGUFWriter, name: str, t: torch.Tensor, q: Q) -> None:
    arr = t.float().numpy()
    if q == Q.F32:
        w.add_tensor(name, arr)
    else:
        w.add_tensor(name, quantize(arr, q), raw_dtype=q)


def _metadata(w: GGUFWriter, arch: str, tc: dict, cfg: dict, hf_dir: Path) -> None:
    a = arch + "."
    mtp = tc.get("mtp_num_hidden_layers", 0) if any(k.startswith("mtp.") for k in tiny_models.tensor_names(hf_dir)) \
        else 0
    w.add_uint32(a + "block_count", tc["num_hidden_layers"] + mtp)  # llama.cpp counts the MTP blocks too
    if mtp:
        w.add_uint32(a + "nextn_predict_layers", mtp)
    w.add_uint32(a + "context_length", tc.get("max_position_embeddings", 512))
    w.add_uint32(a + "embedding_length", tc["hidden_size"])
    w.add_uint32(a + "attention.head_count", tc["num_attention_heads"])
    w.add_uint32(a + "attention.head_count_kv", tc["num_key_value_heads"])
    rp = tc.get("rope_parameters") or {}
    w.add_float32(a + "rope.freq_base", float(rp.get("rope_theta", tc.get("rope_theta", 10000.0))))
    w.add_float32(a + "attention.layer_norm_rms_epsilon", float(tc.get("rms_norm_eps", 1e-6)))
    head_dim = tc.get("head_dim") or tc["hidden_size"] // tc["num_attention_heads"]
    w.add_uint32(a + "attention.key_length", head_dim)
    w.add_uint32(a + "attention.value_length", head_dim)
    w.add_uint32(a + "rope.dimension_count", int(head_dim * rp.get("partial_rotary_factor", 1.0)))
    if tc.get("intermediate_size"):
        w.add_uint32(a + "feed_forward_length", tc["intermediate_size"])
    w.add_uint32(a + "vocab_size", tc["vocab_size"])
    if arch in ("qwen3moe", "qwen35moe"):
        w.add_uint32(a + "expert_count", tc.get("num_experts") or tc.get("num_local_experts"))
        w.add_uint32(a + "expert_used_count", tc["num_experts_per_tok"])
        w.add_uint32(a + "expert_feed_forward_length", tc["moe_intermediate_size"])
    if arch == "qwen35moe":
        w.add_uint32(a + "expert_shared_feed_forward_length", tc["shared_expert_intermediate_size"])
        w.add_uint32(a + "ssm.conv_kernel", tc["linear_conv_kernel_dim"])
        w.add_uint32(a + "ssm.state_size", tc["linear_key_head_dim"])
        w.add_uint32(a + "ssm.group_count", tc["linear_num_key_heads"])
        w.add_uint32(a + "ssm.time_step_rank", tc["linear_num_value_heads"])
        w.add_uint32(a + "ssm.inner_size", tc["linear_num_value_heads"] * tc["linear_value_head_dim"])
        w.add_array(a + "attention.recurrent_layers",
                    [t == "linear_attention" for t in tc["layer_types"]] + [False] * mtp)
    _tokenizer(w, hf_dir)


def _tokenizer(w: GGUFWriter, hf_dir: Path) -> None:
    tj = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = dict(tj["model"]["vocab"])
    for at in tj.get("added_tokens", []):
        vocab[at["content"]] = at["id"]
    special = {at["content"] for at in tj.get("added_tokens", []) if at.get("special")}
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "gpt-2")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", [3 if t in special else 1 for t in tokens])
    w.add_array("tokenizer.ggml.merges", merges)
    tcfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    eos = tcfg["eos_token"]["content"] if isinstance(tcfg["eos_token"], dict) else tcfg["eos_token"]
    w.add_uint32("tokenizer.ggml.eos_token_id", vocab[eos])
    tmpl = (hf_dir / "chat_template.jinja")
    if tmpl.exists():
        w.add_string("tokenizer.chat_template", tmpl.read_text())


def make_llama(out_dir: Path, seed: int = 0, max_position_embeddings: int = 256, heads: int = 4, kv_heads: int = 2,
               hidden: int = 64) -> Path:
    """A tiny dense Llama (tied embeddings, like SmolLM2) in HF layout; head_dim = hidden / heads."""
    import transformers
    from moestream.demo_tokenizer import build_tokenizer

    out_dir = Path(out_dir)
    vocab = build_tokenizer(out_dir)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   max_position_embeddings=max_position_embeddings,
                                   tie_word_embeddings=True, rope_theta=10000.0)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(out_dir)
    return out_dir

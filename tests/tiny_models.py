"""Tiny random checkpoints in Hugging Face layout, written by transformers itself.

Test-only helper (transformers is a test dependency). Every builder:

1. trains the demo tokenizer into ``out_dir`` (``moestream.demo_tokenizer``) and
   takes the model's vocab size from it,
2. builds the model with transformers' own config/model classes,
3. re-initialises all weights deterministically (``seed``) so that the logits
   are well separated (greedy decoding is robust to ~1e-6 numerical noise),
4. writes it with ``save_pretrained`` (optionally sharded), then
5. optionally rewrites the MoE expert tensors into the requested layout.

Expert layouts (``expert_layout``):

* ``"as_saved"``   - whatever transformers' ``save_pretrained`` writes. With
  transformers 5.24 that is the *per-expert* layout for all three variants.
* ``"per_expert"`` - ``...mlp.experts.{e}.gate_proj.weight [I,H]``,
  ``...up_proj.weight [I,H]``, ``...down_proj.weight [H,I]``.
* ``"stacked"``    - ``...mlp.experts.gate_up_proj [E,2I,H]`` (gate rows first,
  then up rows) and ``...mlp.experts.down_proj [E,H,I]``.

Both layouts load back in transformers ``from_pretrained`` to identical logits.

Public API: ``make_qwen3_moe``, ``make_qwen3_5_moe``, ``hf_reference``,
``hf_greedy``, ``hf_logits`` and a few helpers (``read_state_dict``,
``tensor_names``, ``LOGIT_STD_RANGE``).
"""

from __future__ import annotations

import json
import re
import zlib
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moestream.demo_tokenizer import build_tokenizer, special_token_ids

__all__ = [
    "LOGIT_STD_RANGE",
    "make_qwen3_moe",
    "make_qwen3_5_moe",
    "hf_reference",
    "hf_greedy",
    "hf_logits",
    "read_state_dict",
    "tensor_names",
    "rewrite_expert_layout",
    "add_mtp_block",
]

# Designed range of the std of the final logits (measured over a few prompts).
LOGIT_STD_RANGE = (2.0, 8.0)

# Re-initialisation scales (chosen by measurement: logits std ~3-5 for both models).
_W_STD = 0.2  # every projection / embedding / conv weight
_ROUTER_STD = 0.5  # router (mlp.gate.weight): router logits std ~4 -> top-k not near-tied
_LM_HEAD_STD = 0.5  # lm_head: logits std ~ 0.5 * sqrt(64) ~ 4
_NORM_JITTER = 0.1  # RMSNorm weights = identity value + N(0, 0.1)

_EXPERT_RE = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_STACKED_RE = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


# --------------------------------------------------------------------------- configs


def _qwen3_moe_config(vocab_size: int, ids: dict, overrides: dict):
    from transformers import Qwen3MoeConfig

    kw = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        mlp_only_layers=[1],
        decoder_sparse_step=1,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def _qwen3_5_text_kwargs(vocab_size: int, ids: dict, overrides: dict) -> dict:
    kw = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        # Same keys as the real Qwen3.5/3.6 MoE config.json. rotary dim = 32 * 0.25 = 8,
        # i.e. 4 frequencies split T/H/W = [2, 1, 1] (real: head_dim 256 -> 64 -> [11, 11, 10]).
        # rope_theta: real checkpoints use 1e7; 1e4 makes RoPE matter at short lengths here.
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    kw.update(overrides)
    return kw


# Smallest valid vision tower (the weights are ~0.1 MB in fp32).
_TINY_VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=32,
    num_heads=2,
    in_channels=3,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=64,
    num_position_embeddings=16,
)


# --------------------------------------------------------------------------- init


@torch.no_grad()
def _reinit(model, seed: int) -> None:
    """Deterministically re-initialise every parameter of ``model``.

    Each parameter draws from its own generator, seeded by ``seed`` and its name
    with ``model.language_model.`` folded to ``model.``: the conditional and the
    causal Qwen3.5 layouts built with the same seed have identical text weights.
    """
    for name, p in model.named_parameters():
        shape = p.shape
        canon = name.replace("model.language_model.", "model.", 1)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(canon.encode()))

        def normal(std, mean=0.0):
            return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean

        if name.endswith("A_log"):
            # A in [0.1, 2]: per-step decay exp(-A * softplus(a + dt_bias)) spans ~0.1..0.97
            a = torch.rand(shape, generator=gen) * 1.9 + 0.1
            val = a.log()
        elif name.endswith("dt_bias"):
            val = torch.rand(shape, generator=gen) * 2.0 - 1.0
        elif p.dim() == 1 and "norm" in name.rsplit(".", 2)[-2]:
            # RMSNorm weights: zero-centered (1 + w) norms are constructed as zeros,
            # plain (w) norms as ones; jitter around that identity value.
            ident = 0.0 if bool((p == 0).all()) else 1.0
            val = normal(_NORM_JITTER, ident)
        elif p.dim() == 1:
            val = normal(_W_STD * 0.5)  # biases (vision tower only)
        elif name.endswith("mlp.gate.weight"):
            val = normal(_ROUTER_STD)
        elif name == "lm_head.weight":
            val = normal(_LM_HEAD_STD)
        else:
            val = normal(_W_STD)
        p.copy_(val.to(p.dtype))


# --------------------------------------------------------------------------- save


def _max_shard_bytes(model, dtype, n_shards: int = 4) -> int:
    esize = torch.empty((), dtype=dtype).element_size()
    sizes = [p.numel() * esize for _, p in model.named_parameters()]
    largest = max(sizes)
    return max(largest + 1, sum(sizes) // n_shards + 1)


def _save(model, out: Path, *, sharded: bool, dtype) -> None:
    from transformers import GenerationConfig

    # Keep the tokenizer's generation config (eos = [<|im_end|>, <|endoftext|>]).
    model.generation_config = GenerationConfig.from_pretrained(out)
    model = model.to(dtype)
    kw = {}
    if sharded:
        kw["max_shard_size"] = _max_shard_bytes(model, dtype)
    model.save_pretrained(out, **kw)
    if sharded:
        n = len(list(out.glob("model-*.safetensors")))
        assert (out / "model.safetensors.index.json").exists() and n >= 3, n


def _shard_files(out: Path) -> list[Path]:
    idx = out / "model.safetensors.index.json"
    if idx.exists():
        wm = json.loads(idx.read_text())["weight_map"]
        return [out / f for f in sorted(set(wm.values()))]
    return [out / "model.safetensors"]


def read_state_dict(path) -> "OrderedDict[str, torch.Tensor]":
    """All tensors of the checkpoint in ``path`` (any sharding), in file order."""
    sd: OrderedDict[str, torch.Tensor] = OrderedDict()
    for f in _shard_files(Path(path)):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                sd[k] = sf.get_tensor(k)
    return sd


def tensor_names(path) -> dict[str, tuple]:
    """``{name: shape}`` of every tensor in the checkpoint, sorted by name."""
    out = {}
    for f in _shard_files(Path(path)):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                out[k] = tuple(sf.get_slice(k).get_shape())
    return dict(sorted(out.items()))


def _to_stacked(tensors: "OrderedDict[str, torch.Tensor]") -> "OrderedDict[str, torch.Tensor]":
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for k, t in tensors.items():
        m = _EXPERT_RE.match(k)
        if not m:
            out[k] = t
            continue
        g = groups.setdefault(m["prefix"], {})
        if not g:
            out[m["prefix"] + ".gate_up_proj"] = None  # placeholders keep the order
            out[m["prefix"] + ".down_proj"] = None
        g.setdefault(m["proj"], {})[int(m["e"])] = t
    for prefix, g in groups.items():
        n = len(g["gate_proj"])
        assert sorted(g["gate_proj"]) == list(range(n)), prefix
        assert sorted(g["up_proj"]) == sorted(g["down_proj"]) == list(range(n)), prefix
        out[prefix + ".gate_up_proj"] = torch.stack(
            [torch.cat([g["gate_proj"][e], g["up_proj"][e]], dim=0) for e in range(n)]
        ).contiguous()
        out[prefix + ".down_proj"] = torch.stack([g["down_proj"][e] for e in range(n)]).contiguous()
    return out


def _to_per_expert(tensors: "OrderedDict[str, torch.Tensor]") -> "OrderedDict[str, torch.Tensor]":
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for k, t in tensors.items():
        m = _STACKED_RE.match(k)
        if not m:
            out[k] = t
            continue
        p = m["prefix"]
        if m["proj"] == "gate_up_proj":
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{p}.{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                out[f"{p}.{e}.up_proj.weight"] = t[e, inter:].contiguous()
        else:
            for e in range(t.shape[0]):
                out[f"{p}.{e}.down_proj.weight"] = t[e].contiguous()
    return out


def rewrite_expert_layout(path, layout: str) -> None:
    """Rewrite the checkpoint in ``path`` in place to ``layout`` ("per_expert" | "stacked").

    Every non-expert tensor stays in its shard; a stacked tensor goes to the shard
    that held its expert 0 parts, per-expert parts go to the shard of their stacked
    tensor. The index's weight_map and total_size are updated.
    """
    if layout not in ("per_expert", "stacked"):
        raise ValueError(f"unknown expert layout {layout!r}")
    _rewrite(Path(path), _to_stacked if layout == "stacked" else _to_per_expert)


def _rewrite(path: Path, convert) -> None:
    files = _shard_files(path)
    tensors: OrderedDict[str, torch.Tensor] = OrderedDict()
    home: dict[str, str] = {}
    metas: dict[str, dict] = {}
    for f in files:
        with safe_open(str(f), "pt") as sf:
            metas[f.name] = sf.metadata() or {"format": "pt"}
            for k in sf.keys():
                tensors[k] = sf.get_tensor(k)
                home[k] = f.name
    new = convert(tensors)

    def shard_of(k: str) -> str:
        if k in home:
            return home[k]
        m = _STACKED_RE.match(k)
        if m:  # stacked <- per-expert: expert 0's shard
            proj = "gate_proj" if m["proj"] == "gate_up_proj" else "down_proj"
            return home[f"{m['prefix']}.0.{proj}.weight"]
        m = _EXPERT_RE.match(k)
        stacked = "gate_up_proj" if m["proj"] in ("gate_proj", "up_proj") else "down_proj"
        return home[f"{m['prefix']}.{stacked}"]

    per_file: dict[str, OrderedDict] = {f.name: OrderedDict() for f in files}
    for k, t in new.items():
        per_file[shard_of(k)][k] = t
    weight_map, total = {}, 0
    for f in files:
        content = per_file[f.name]
        old_keys = [k for k in tensors if home[k] == f.name]
        if list(content) != old_keys:
            save_file(dict(content), str(f), metadata=metas[f.name])
        for k, t in content.items():
            weight_map[k] = f.name
            total += t.numel() * t.element_size()
    idx = path / "model.safetensors.index.json"
    if idx.exists():
        data = json.loads(idx.read_text())
        data.setdefault("metadata", {})["total_size"] = total
        data["weight_map"] = dict(sorted(weight_map.items()))
        idx.write_text(json.dumps(data, indent=2) + "\n")


# --------------------------------------------------------------------------- builders


def _prepare(out_dir) -> tuple[Path, int, dict]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out)
    return out, vocab, special_token_ids(out)


def _finish(model, out: Path, *, sharded, dtype, ids, expert_layout) -> Path:
    model.eval()
    _save(model, out, sharded=sharded, dtype=dtype)
    if expert_layout != "as_saved":
        rewrite_expert_layout(out, expert_layout)
    return out


def make_qwen3_moe(out_dir, *, sharded=False, dtype=torch.float32, seed=0, expert_layout="as_saved", **overrides):
    """Tiny ``Qwen3MoeForCausalLM`` (layer 1 is a dense MLP). Returns ``Path(out_dir)``."""
    from transformers import Qwen3MoeForCausalLM

    out, vocab, ids = _prepare(out_dir)
    cfg = _qwen3_moe_config(vocab, ids, overrides)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg)
    _reinit(model, seed)
    return _finish(model, out, sharded=sharded, dtype=dtype, ids=ids, expert_layout=expert_layout)


def make_qwen3_5_moe(
    out_dir,
    *,
    layout="conditional",
    sharded=False,
    dtype=torch.float32,
    seed=0,
    expert_layout="as_saved",
    drop_vision=False,
    **overrides,
):
    """Tiny Qwen3.5/3.6-MoE checkpoint. Returns ``Path(out_dir)``.

    ``layout="conditional"``: ``Qwen3_5MoeForConditionalGeneration`` with a text
    and a (smallest valid) vision config, weights under ``model.language_model.*``
    and ``model.visual.*`` - like the real Qwen3.6-35B-A3B. The vision tower is
    kept by default (it is tiny); ``drop_vision=True`` removes ``model.visual.*``
    from the saved files (config.json keeps ``vision_config``).
    ``layout="causal"``: text-only ``Qwen3_5MoeForCausalLM`` (``model.*``).
    ``overrides`` go to the text config.
    """
    from transformers import (
        Qwen3_5MoeConfig,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeForConditionalGeneration,
        Qwen3_5MoeTextConfig,
    )

    out, vocab, ids = _prepare(out_dir)
    text_kw = _qwen3_5_text_kwargs(vocab, ids, overrides)
    torch.manual_seed(seed)
    if layout == "conditional":
        cfg = Qwen3_5MoeConfig(
            text_config=text_kw,
            vision_config=dict(_TINY_VISION, out_hidden_size=text_kw["hidden_size"]),
            tie_word_embeddings=False,
        )
        model = Qwen3_5MoeForConditionalGeneration(cfg)
    elif layout == "causal":
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**text_kw))
    else:
        raise ValueError(f"unknown layout {layout!r}")
    _reinit(model, seed)
    _finish(model, out, sharded=sharded, dtype=dtype, ids=ids, expert_layout=expert_layout)
    if drop_vision and layout == "conditional":
        _drop_prefix(out, "model.visual.")
    return out


def add_mtp_block(path, *, seed: int = 0, layers: int = 1) -> Path:
    """Give the Qwen3.5 checkpoint in ``path`` a multi-token-prediction block as Qwen3.5/3.6 ship it:
    ``mtp.fc`` [H, 2H], ``mtp.pre_fc_norm_embedding`` / ``mtp.pre_fc_norm_hidden`` / ``mtp.norm`` and
    ``mtp.layers.{i}.*`` shaped like the checkpoint's full-attention layers (random weights, drawn as
    the builders draw theirs; per-expert experts), and ``mtp_num_hidden_layers`` in config.json.
    transformers ignores these tensors, so its reference model is unchanged. The tensors go into the
    single file, or into a shard of their own listed in the index."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    tc = cfg.get("text_config", cfg)
    sd = read_state_dict(path)
    full = tc["layer_types"].index("full_attention")
    src = next(k for k in sd if f"layers.{full}.self_attn.q_proj.weight" in k).split(f"layers.{full}.")[0]
    donor = f"{src}layers.{full}."
    H = tc["hidden_size"]
    new: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    shapes = {"mtp.fc.weight": (H, 2 * H), "mtp.pre_fc_norm_embedding.weight": (H,),
              "mtp.pre_fc_norm_hidden.weight": (H,), "mtp.norm.weight": (H,)}
    for i in range(layers):
        for k, t in sd.items():
            if k.startswith(donor):
                shapes[f"mtp.layers.{i}." + k[len(donor):]] = tuple(t.shape)
    dtype = next(iter(sd.values())).dtype
    for name, shape in shapes.items():
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        if len(shape) == 1 and "norm" in name:
            val = torch.randn(shape, generator=gen) * _NORM_JITTER  # zero-centred norms
        elif name.endswith("mlp.gate.weight"):
            val = torch.randn(shape, generator=gen) * _ROUTER_STD
        else:
            val = torch.randn(shape, generator=gen) * _W_STD
        new[name] = val.to(dtype)
    tc["mtp_num_hidden_layers"] = layers
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    idx = path / "model.safetensors.index.json"
    if idx.exists():
        save_file(dict(new), str(path / "model-mtp.safetensors"), metadata={"format": "pt"})
        data = json.loads(idx.read_text())
        data["weight_map"].update({k: "model-mtp.safetensors" for k in new})
        data["weight_map"] = dict(sorted(data["weight_map"].items()))
        idx.write_text(json.dumps(data, indent=2) + "\n")
    else:
        save_file({**sd, **new}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def make_qwen3_5_moe_mtp(out_dir, *, mtp_seed: int = 0, mtp_expert_layout: str = "per_expert", **kw) -> Path:
    """``make_qwen3_5_moe`` plus an MTP block (``add_mtp_block``); ``mtp_expert_layout="stacked"`` then
    rewrites every layer's experts, the block's included, stacked."""
    path = add_mtp_block(make_qwen3_5_moe(out_dir, **kw), seed=mtp_seed)
    if mtp_expert_layout != "per_expert":
        rewrite_expert_layout(path, mtp_expert_layout)
    return path


def _drop_prefix(path: Path, prefix: str) -> None:
    _rewrite(path, lambda sd: OrderedDict((k, t) for k, t in sd.items() if not k.startswith(prefix)))


# --------------------------------------------------------------------------- HF reference


def hf_reference(path, dtype=torch.float32):
    """Load the checkpoint with transformers (class from config.json's architectures), eval mode."""
    import transformers

    path = Path(path)
    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    cls = getattr(transformers, arch, None) or transformers.AutoModelForCausalLM
    model = cls.from_pretrained(path, dtype=dtype)
    # Own every tensor (not views into the mmapped files): the files may be rewritten
    # later, and CPU kernels pick code paths by pointer alignment, which would make
    # logits of equal weights differ by ~1e-6 between layouts.
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    model.eval()
    return model


@torch.no_grad()
def hf_greedy(model, prompt_ids, n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt_ids`` (exactly n: eos is suppressed until then)."""
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=model.device)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=n,
    )
    return out[0, ids.shape[1]:].tolist()


@torch.no_grad()
def hf_logits(model, ids) -> torch.Tensor:
    """fp32 logits ``[T, V]`` for the token ids ``ids``."""
    x = torch.tensor([list(ids)], dtype=torch.long, device=model.device)
    return model(input_ids=x, use_cache=False).logits[0].float()

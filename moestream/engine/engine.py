"""One device rank: builds the model, its caches and the expert runtime; runs forward passes.

Recipe (Engine.__init__):
    resolve device and dtype -> build the model on the meta device -> materialise on the device ->
    stream the checkpoint (dense -> model, routed experts -> expert store) -> expert runtime ->
    KV pool + linear-state pool sized for the configured requests.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import EngineConfig, ModelConfig
from ..core import ConfigError
from ..kvcache import KVPool, StatePool
from ..layers.rotary import Rotary
from ..models.loader import load_weights
from ..models.qwen_moe import QwenMoeModel
from ..moe import ExpertStore, build_runtime
from ..moe.formats import dense_format
from .batch import ForwardBatch

log = logging.getLogger("moestream.engine")

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device must be auto, cpu, cuda or cuda:N, got {name!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA GPU is visible; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be auto, cpu, cuda or cuda:N, got {name!r}")
    return dev


def resolve_dtype(name: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    dt = DTYPES.get(cfg.torch_dtype, torch.bfloat16)
    if device.type == "cpu" and dt == torch.float16:
        return torch.float32  # fp16 matmuls on CPU are slow and lossy; fp32 is the safe default there
    return dt


@dataclass
class Caches:
    kv: KVPool
    state: StatePool


class Engine:
    def __init__(self, folder: Path, cfg: ModelConfig, ecfg: EngineConfig):
        self.cfg, self.ecfg = cfg, ecfg
        self.device = resolve_device(ecfg.device)
        self.dtype = resolve_dtype(ecfg.dtype, cfg, self.device)
        self.max_seq_len = self._max_seq_len()
        self.model = self._build_model(folder)
        self.caches = self._build_caches()
        self.model.caches = self.caches
        self.model.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta, self.max_seq_len, self.device, self.dtype)
        log.info("engine ready: %s on %s (%s), max_seq_len %d, KV %d tokens, %d state slots, experts %s",
                 cfg.architecture, self.device, str(self.dtype).replace("torch.", ""), self.max_seq_len,
                 self.caches.kv.num_pages * self.caches.kv.page_size, self.caches.state.num_slots,
                 self.runtime.name)

    def _max_seq_len(self) -> int:
        limit = self.cfg.max_position_embeddings
        if self.ecfg.max_seq_len_override is not None:
            if self.ecfg.max_seq_len_override > limit:
                raise ConfigError(f"--max-seq-len-override {self.ecfg.max_seq_len_override} exceeds the model's "
                                  f"max_position_embeddings {limit}")
            return self.ecfg.max_seq_len_override
        return limit

    def _build_model(self, folder: Path) -> QwenMoeModel:
        with torch.device("meta"):
            model = QwenMoeModel(self.cfg)
        model = model.to_empty(device=self.device).to(self.dtype)
        moe_layers = [i for i, m in enumerate(self.cfg.moe_layers) if m]
        backend = "fused" if self.ecfg.moe_backend == "auto" else self.ecfg.moe_backend
        store = ExpertStore(moe_layers, self.cfg.num_experts, self.cfg.hidden_size, self.cfg.moe_intermediate_size,
                            dense_format(self.dtype), self.device)
        load_weights(model, store, self.cfg, folder)
        self.runtime = build_runtime(backend, store, self.device)
        for block in model.moe_blocks():
            block.runtime = self.runtime
        return model.eval()

    def _build_caches(self) -> Caches:
        cfg, e = self.cfg, self.ecfg
        num_tokens = e.num_tokens or min(max(self.max_seq_len, 4096) * e.max_running_requests, 1 << 17)
        num_tokens = max(num_tokens, e.page_size)
        kv = KVPool(len(cfg.full_attention_layers), -(-num_tokens // e.page_size), e.page_size, cfg.num_kv_heads,
                    cfg.head_dim, self.dtype, self.device)
        state = StatePool(len(cfg.linear_attention_layers), e.max_running_requests, cfg.linear_conv_dim,
                          max(cfg.linear_conv_kernel, 1), cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                          cfg.linear_value_head_dim, self.dtype, DTYPES[e.linear_state_dtype], self.device)
        return Caches(kv, state)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.runtime.begin_step({"num_tokens": batch.num_tokens, "decode": batch.is_decode})
        try:
            return self.model(batch)
        finally:
            self.runtime.end_step()

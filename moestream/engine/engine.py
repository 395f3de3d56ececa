"""One device rank: builds the model, its caches and the expert runtime; runs forward passes.

Recipe (Engine.__init__):
    resolve device and dtype -> build the model on the meta device -> materialise on the device ->
    stream the checkpoint (dense -> model, routed experts -> expert store) -> expert runtime ->
    KV pool + linear-state pool sized for the configured requests.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import EngineConfig, ModelConfig
from ..core import ConfigError, RequestError
from ..env import fuse_projections_enabled, prefill_rows, set_triton_mode
from ..hardware import host_memory
from ..kvcache import HostPool, KVPool, StatePool
from ..layers.rotary import Rotary
from ..models.loader import expert_format_for, load_weights
from ..models.fuse import fuse_projections
from ..models.qwen_moe import QwenMoeModel
from ..moe import ExpertStore, build_runtime
from ..moe.bench import load_profile, quick_bandwidths
from ..moe.formats import dense_format
from ..moe.planner import (PREFILL_CHUNK_FLOOR, PREFILL_CHUNK_KEEP, USEFUL_KV_TOKENS, Bandwidths, MoePlan, bank_bytes, model_sizes,
                           plan_fitting_chunk, plan_memory)
from ..kernels import cpu_quant
from ..moe.hardware import probe_hardware
from ..batch import ForwardBatch
from .graphs import DecodeGraphs, decode_extra, verify_rows

log = logging.getLogger("moestream.engine")

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32}
KV_DTYPES = {**DTYPES, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}  # --kv-cache-dtype


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


def keep_16bit_linears(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """A float32 model loaded from a 16-bit checkpoint on a CPU: each linear weight whose values are all exactly
    `dtype` values (the checkpoint's, widened at load) goes back to those rows. The compiled decode step reads them
    as they are and kernels.linear widens them for a GEMM, so every product is the float32 one (no value
    changes) and a decode step reads half the bytes. A weight shared with another module (tied embeddings) stays.
    Returns how many weights moved."""
    shared = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            shared[id(p)] = shared.get(id(p), 0) + 1
    kept = 0
    with torch.no_grad():
        for m in model.modules():
            w = getattr(m, "weight", None)
            if not isinstance(m, torch.nn.Linear) or w is None or w.dtype != torch.float32 or w.dim() != 2 \
                    or w.device.type != "cpu" or shared.get(id(w), 0) > 1:
                continue
            low = w.to(dtype)
            if not torch.equal(low.float(), w):
                continue
            m.weight = torch.nn.Parameter(low, requires_grad=False)
            kept += 1
    return kept


def resolve_dtype(name: str, cfg: ModelConfig, device: torch.device, experts_stored: bool = False) -> torch.dtype:
    """--dtype auto: on a CPU float32 (the fastest and most exact there; the compiled decode step needs it) unless
    the weights that take the dtype would fill over a quarter of host memory in float32 — experts_stored: routed
    experts keep their checkpoint's quantized format (GGUF, FP8, FP4) and do not count; on a GPU the checkpoint's
    16-bit dtype (float16 where the GPU lacks bf16 tensor cores)."""
    if name != "auto":
        return DTYPES[name]
    dt = DTYPES.get(cfg.torch_dtype, torch.bfloat16)
    if device.type == "cpu":
        ram = host_memory()[0]
        params = cfg.approx_num_params() - (cfg.approx_routed_expert_params() if experts_stored else 0)
        return torch.float32 if params * 4 < ram // 4 else torch.bfloat16
    dt = torch.bfloat16 if dt == torch.float32 else dt
    if dt == torch.bfloat16 and torch.cuda.get_device_capability(device) < (8, 0):
        # Turing/Volta have no bf16 tensor cores: fp16 keeps the GEMMs on tensor cores
        log.info("this GPU has no bf16 tensor cores (sm < 80): computing in float16")
        return torch.float16
    return dt


@dataclass
class Caches:
    kv: KVPool
    state: StatePool
    host: HostPool | None = None  # the prefix cache's host tier (--prefix-cache-host-gb)


class Engine:
    def __init__(self, folder: Path, cfg: ModelConfig, ecfg: EngineConfig, tp=None):
        """tp: this process's rank of a tensor-parallel group (moestream.parallel.TPRank), which
        shards the model and the experts and sizes the pools from its local heads; None: one rank."""
        self.cfg, self.ecfg = cfg, ecfg
        if ecfg.tp_size > 1 and (tp is None or tp.size != ecfg.tp_size):
            raise ConfigError(f"--tp-size {ecfg.tp_size} runs one process per rank: use LLM(..., tp_size=N) or "
                              "the CLI's --tp-size, not Engine directly")
        self.tp = tp
        set_triton_mode(ecfg.triton)  # the process's one Triton decision (env.triton_enabled)
        self.use_mtp = ecfg.speculative == "mtp"
        if self.use_mtp and not cfg.mtp_num_layers:
            raise ConfigError("--speculative mtp needs a checkpoint with a multi-token-prediction block (Qwen3.5/"
                              "3.6: mtp_num_hidden_layers in config.json, or a GGUF with nextn_predict_layers); "
                              "this one has none")
        self.local_cfg = tp.local_config(cfg) if tp else cfg  # this rank's heads, widths and vocab rows
        self.device = resolve_device(ecfg.device)
        # a quantized checkpoint's experts stay in their format (None: they take the model dtype)
        self.expert_fmt = expert_format_for(cfg, folder) if ecfg.moe_expert_format == "auto" else None
        if self.expert_fmt is None and ecfg.moe_expert_format == "auto":
            self.expert_fmt = self._cpu_16bit_experts(ecfg, cfg)
        self.dtype = resolve_dtype(ecfg.dtype, cfg, self.device, experts_stored=self.expert_fmt is not None)
        self.max_seq_len = self._max_seq_len()
        self.hardware = probe_hardware(self.device)  # before anything is allocated on the device
        if tp:
            self.hardware = tp.local_hardware(self.hardware)
        self.asked_snapshots = self._snapshots(ecfg)  # the plan may keep fewer on the device (_plan_fitting)
        self.model = self._build_model(folder)
        self.caches = self._build_caches()
        self.model.caches = self.caches
        self.model.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta, self.max_seq_len, self.device, self.dtype)
        if self.device.type == "cpu":
            self.model.prepare_cpu_decode()  # before the first prompt: its prefill reads the plan's weight copies too
        log.info("engine ready: %s on %s (%s), max_seq_len %d, KV %d tokens, %d state slots, experts %s",
                 cfg.architecture, self.device, str(self.dtype).replace("torch.", ""), self.max_seq_len,
                 self.caches.kv.num_pages * self.caches.kv.page_size, self.caches.state.num_slots,
                 self.runtime.name)
        self.host_memory = self._host_memory_at_load()
        if self.device.type == "cuda":
            # load-time temporaries (dequantized tensors, the unfused projections) are free but still held
            # by torch's cache: give them back so the process holds what the plan says
            torch.cuda.empty_cache()
            log.info("%s", self.memory_line())

    def _host_memory_at_load(self) -> dict:
        """Host RSS once loaded (moe/hardware.process_memory) next to the expert banks held in host memory and
        how much of them is the checkpoint file's mapped pages; logged, and served in /v1/stats."""
        from ..moe.hardware import process_memory

        store = self.runtime.store
        banks = store.total_bytes() if store.device.type == "cpu" else 0
        out = {**process_memory(), "bank_bytes": banks, "mapped_bank_bytes": store.mapped_bytes,
               "available_at_start": self.hardware.host_available_bytes}
        g = (lambda n: f"{n / 2**30:.2f} GiB")
        log.info("host memory at load: RSS %s (anonymous %s, file-backed %s, shared %s: pinned buffers and files on "
                 "tmpfs), peak %s; expert banks %s in host memory, %s of them mapped from the checkpoint file",
                 g(out.get("rss", 0)), g(out.get("rss_anon", 0)), g(out.get("rss_file", 0)),
                 g(out.get("rss_shmem", 0)), g(out.get("peak_rss", 0)), g(banks), g(store.mapped_bytes))
        return out

    def memory_report(self) -> dict:
        """GPU memory now, in bytes: the plan's budget and context, torch's allocated and reserved bytes,
        and the device's used memory (all processes) — what benchmarks compare with nvidia-smi."""
        if self.device.type != "cuda":
            return {}
        free, total = torch.cuda.mem_get_info(self.device)
        return {"budget": self.plan.bytes.budget, "context": self.hardware.context_bytes,
                "allocated": torch.cuda.memory_allocated(self.device),
                "reserved": torch.cuda.memory_reserved(self.device),
                "max_reserved": torch.cuda.max_memory_reserved(self.device), "device_used": total - free}

    def memory_line(self) -> str:
        m, g = self.memory_report(), (lambda n: f"{n / 2**30:.2f}")
        return (f"GPU memory: torch allocated {g(m['allocated'])} GiB, reserved {g(m['reserved'])} GiB, CUDA context "
                f"~{g(m['context'])} GiB (plan budget {g(m['budget'])} GiB + context); device used {g(m['device_used'])} GiB")

    @property
    def rows_per_request(self) -> int:
        """Rows a decoding request brings to a decode-like step: its newest token, plus its drafts when
        speculating (the experts' decode buffers are sized by it)."""
        return 1 + (self.ecfg.num_speculative_tokens if self.use_mtp else 0)

    @property
    def num_kv_layers(self) -> int:
        """Full-attention layers with K/V in the pool: the main model's, then the MTP block's when loaded."""
        return len(self.local_cfg.full_attention_layers) + (self.cfg.mtp_num_layers if self.use_mtp else 0)

    @property
    def num_state_checkpoints(self) -> int:
        """Linear-state slots holding each speculative verify step's state after every draft position but
        the last (--speculative mtp on models with linear layers): K per running request."""
        return self._checkpoints(self.ecfg)

    def _checkpoints(self, e: EngineConfig) -> int:
        if not self.use_mtp or not self.cfg.linear_attention_layers:
            return 0
        return e.max_running_requests * e.num_speculative_tokens

    @property
    def num_state_snapshots(self) -> int:
        """Linear-state slots kept for prefix-cache snapshots (0 without the cache or linear layers)."""
        return self._snapshots(self.ecfg)

    def _snapshots(self, e: EngineConfig) -> int:
        if not e.prefix_cache or not self.cfg.linear_attention_layers:
            return 0
        return e.prefix_cache_snapshots if e.prefix_cache_snapshots is not None else 2 * e.max_running_requests

    def _max_seq_len(self) -> int:
        limit = self.cfg.max_position_embeddings
        if self.ecfg.max_seq_len_override is not None:
            if self.ecfg.max_seq_len_override > limit:
                raise ConfigError(f"--max-seq-len-override {self.ecfg.max_seq_len_override} exceeds the model's "
                                  f"max_position_embeddings {limit}")
            return self.ecfg.max_seq_len_override
        return limit

    def _cpu_16bit_experts(self, ecfg: EngineConfig, cfg: ModelConfig):
        """On a CPU with --dtype auto and the compiled kernels: a bf16 / f16 checkpoint's routed experts stay in its
        16-bit rows (dense_format of that dtype) while the rest may compute in float32 — the kernels read 16-bit
        experts against float32 activations (moe/cpu_moe.py), half the bytes a step of float32 copies would
        read and half the host memory; None otherwise (the experts take the model's dtype)."""
        stored = DTYPES.get(cfg.torch_dtype)
        if (ecfg.dtype != "auto" or self.device.type != "cpu" or stored not in (torch.bfloat16, torch.float16)
                or not cpu_quant.available()):
            return None
        return dense_format(stored)

    def _build_model(self, folder: Path) -> QwenMoeModel:
        # planned on the meta tree (this rank's dense bytes), so a plan that device or host memory cannot hold
        # is refused before anything is allocated
        with torch.device("meta"):
            model = QwenMoeModel(self.cfg, mtp=self.use_mtp).to(self.dtype)
            local = QwenMoeModel(self.local_cfg, mtp=self.use_mtp).to(self.dtype) if self.tp else model
        moe_layers = [i for i, m in enumerate(self.cfg.moe_layers) if m]
        moe_layers += self.cfg.mtp_layer_ids if self.use_mtp else []
        fmt = self.expert_fmt or dense_format(self.dtype)
        mode = self._dense_mode()
        self.dense_bytes = None
        if mode == "gpu" and self._dense_policy() == "auto":
            # VRAM to spare (every expert resident with 16-bit dense layers): cuBLAS GEMVs on 16-bit weights
            try:
                if self._plan_memory(local, fmt, log_it=False).backend == "fused":
                    mode = None
            except ConfigError:
                pass
        self.dense_bytes = self._planned_dense_bytes(local, folder, mode)
        head = self._head_to_quantize(local, folder)
        if head is not None:  # planned at its Q8_0 bytes
            held = self.dense_bytes if self.dense_bytes is not None else dense_bytes_held(local)
            self.dense_bytes = held - head[0] + head[1]
        if head is None:  # where it applies, for a refusal's hint
            applies = self._head_q8(folder)
            self.head_q8 = applies if isinstance(applies, tuple) else None
        else:
            self.head_q8 = None
        self.dense_mode = mode
        self.host_embedding = self._embedding_on_host(local, fmt, folder)
        if self.host_embedding:  # planned without the table's device bytes (a GGUF's: its stored rows, if kept so)
            from ..models.checkpoint import open_checkpoint

            w = local.embed_tokens.weight
            table = w.numel() * w.element_size() if folder is None else \
                open_checkpoint(folder).embedding_bytes(local, self.local_cfg, mode)
            held = self.dense_bytes if self.dense_bytes is not None else dense_bytes_held(local)
            self.dense_bytes = held - table
        self.plan = self._plan_memory(local, fmt, fit_chunk=True)
        self._cap_torch()
        # the dense model is loaded (and its projections fused, and a GGUF's linears swapped for compressed
        # ones) in host memory, then moved: the GPU gets the final tensors only, without the holes that
        # replaced 16-bit weights would leave in torch's cached segments (tensor parallel: the rank keeps its
        # slices)
        model = model.to_empty(device="cpu")
        # fused keeps the master copies on the device; every other backend in host banks
        home = self.device if self.plan.backend == "fused" else torch.device("cpu")
        store = (self.tp.expert_store if self.tp else ExpertStore)(
            moe_layers, self.cfg.num_experts, self.cfg.hidden_size, self.cfg.moe_intermediate_size, fmt, home)
        load_weights(model, store, self.cfg, folder, compressed_dense=mode)
        if head is not None:
            self._quantize_head(model)
        if self.expert_fmt is not None and not self.expert_fmt.quantized and self.dtype == torch.float32 \
                and self.device.type == "cpu" and not self.tp:
            kept = keep_16bit_linears(model, self.expert_fmt.dtype)
            log.info("CPU: %d linear weights kept in the checkpoint's %s rows (float32 activations)", kept,
                     str(self.expert_fmt.dtype).replace("torch.", ""))
        if self.tp:
            model = self.tp.shard(model).to(self.device)
        else:
            if fuse_projections_enabled():
                # one GEMM per group of projections reading the same input (tensor parallel: shard.py slices
                # the unfused modules by heads, so ranks stay unfused)
                log.debug("fused projections: %s", fuse_projections(model))
            if self.host_embedding:
                self._place_embedding(model)
            if self.device.type == "cuda" and mode == "gpu":
                from ..layers.quant_linear import to_planar

                log.debug("dense layers in a planar layout: %d", to_planar(model))
            model = model.to(self.device)
            for block in model.moe_blocks():  # a fused router reads a view of shared_in's rows: view the moved one
                if block.router_rows:
                    block.gate.weight = block.shared_in.weight.detach()[:block.router_rows]
        store = self._replan_for_loaded(model, fmt, store)
        self.pinning = store.pin_host(self.plan.bytes.pin_budget) \
            if self.device.type == "cuda" and store.device.type == "cpu" else None
        self.route_tap = self._routing_recorder(folder)
        self._start_runtime(store, model)
        return model.eval()

    def _head_to_quantize(self, local, folder) -> tuple[int, int] | None:
        """--lm-head-quant q8_0: (the head's bytes as loaded, as Q8_0) where the checkpoint's head loads as a 16/32-bit
        matrix (a safetensors checkpoint's; a GGUF's head keeps the type its file stores: logged); None otherwise.
        A head tied to the embedding or split over tensor-parallel ranks is refused with the reason."""
        if self.ecfg.lm_head_quant == "none":
            return None
        head = self._head_q8(folder)
        if isinstance(head, tuple):
            return head
        if head == "gguf":
            log.info("--lm-head-quant q8_0: a GGUF's head keeps the type its file stores")
            return None
        raise ConfigError(f"--lm-head-quant q8_0: {head}")

    def _head_q8(self, folder) -> tuple[int, int] | str:
        """(the head's bytes as loaded, as Q8_0) where --lm-head-quant q8_0 applies — an untied head of a safetensors
        checkpoint (or random weights) on one rank, a hidden size that is a multiple of 32; else why not ("gguf": the
        file stores its head compressed, or F16, already)."""
        from ..models.gguf_loader import find_gguf

        n, k = self.local_cfg.vocab_size, self.local_cfg.hidden_size
        if self.cfg.tie_word_embeddings:
            return ("this model's vocabulary head is its token embedding (tie_word_embeddings); quantizing it would "
                    "keep a second copy: leave it at none")
        if self.tp:
            return "not supported with --tp-size > 1"
        if folder is not None and find_gguf(folder) is not None:
            return "gguf"
        if k % 32:
            return f"needs a hidden size that is a multiple of 32, got {k}"
        return n * k * self.dtype.itemsize, n * (k // 32) * 34

    def _quantize_head(self, model) -> None:
        """The loaded 16/32-bit head replaced by its Q8_0 blocks (a QuantLinear that multiplies float32 activations on
        a CPU, as a GGUF's Q8_0 head does)."""
        from ..kernels.linear import Linear
        from ..layers.quant_linear import QuantLinear
        from ..quant.gguf_formats import quantize_q8_0

        old = model.lm_head
        if type(old) is not Linear:
            return
        n, k = old.weight.shape
        model.lm_head = QuantLinear("Q8_0", quantize_q8_0(old.weight.detach()), n, k, float_activations=True)
        log.info("vocabulary head quantized to Q8_0 (%.2f GiB, was %.2f)", n * (k // 32) * 34 / 2**30,
                 old.weight.numel() * old.weight.element_size() / 2**30)

    def _embedding_on_host(self, local, fmt, folder) -> bool:
        """Whether the token embedding stays in pinned host memory instead of VRAM: on CUDA, one rank, the gather
        kernels available (layers/host_embedding.py for a 16-bit table; a GGUF's compressed rows,
        QuantEmbedding.to_host, decoded on the device as they are read — llama.cpp keeps its token embedding in host
        memory too), and the experts not all fitting in VRAM with the table there (its bytes then buy expert slots, or
        make a small card's plan fit). MOESTREAM_HOST_EMBEDDING: auto (default), 1 (whenever it can), 0 (never)."""
        import os

        from ..layers import host_embedding

        env = os.environ.get("MOESTREAM_HOST_EMBEDDING", "auto")
        if env == "0" or self.device.type != "cuda" or self.tp or type(local.embed_tokens) is not torch.nn.Embedding:
            return False
        if not host_embedding.available():
            return False
        if env == "1":
            return True
        try:
            return self._plan_memory(local, fmt, log_it=False).backend != "fused"
        except ConfigError:  # refused with the table on the device: try without it
            return True

    def _place_embedding(self, model) -> None:
        """Move the loaded embedding's table to pinned host memory (a HostEmbedding for a 16-bit table, a GGUF's
        compressed rows in QuantEmbedding.to_host), after a check of the gather kernel on three of its rows against
        the table's own; where the check fails the table stays (and the loaded model's bytes are planned again)."""
        from ..layers.host_embedding import HostEmbedding
        from ..layers.quant_linear import QuantEmbedding

        old = model.embed_tokens
        if isinstance(old, QuantEmbedding):
            n = old.num_embeddings
            ids = torch.tensor([0, n // 2, n - 1])
            nbytes = old.raw.numel() * old.raw.element_size()
            want = old.fmt.dequantize_rows(old.raw, (n, old.embedding_dim), ids, torch.float32).to(old.dtype)
            old.to_host(self.device)
            emb = old
        else:
            w = old.weight.detach()
            ids = torch.tensor([0, w.shape[0] // 2, w.shape[0] - 1])
            nbytes, want = w.numel() * w.element_size(), w[ids]
            emb = HostEmbedding(w, self.device)
        try:
            ok = torch.equal(emb(ids.to(self.device)).cpu(), want)
            why = "rows differ"
        except Exception as e:  # a kernel that cannot read host memory here
            ok, why = False, f"{type(e).__name__}: {e}"
        if not ok:
            log.warning("the embedding stays on the device: its host-memory gather failed a check (%s)", why)
            if emb is old:
                old.from_host()
            self.host_embedding = False
            return
        model.embed_tokens = emb
        log.info("token embedding in pinned host memory (%.2f GiB of VRAM freed)", nbytes / 2**30)

    def _replan_for_loaded(self, model, fmt, store):
        """The plan again when the loaded dense layers hold other bytes than planned: a GGUF's planned bytes assume
        every linear it can keep compressed stays so, but fusing projections of mixed types (models/fuse.py)
        dequantizes some (the Qwen3.6-shaped Q8_0 GGUF: 3.06 GiB held where 2.40 was planned, so the slot cache
        took 0.66 GiB the cap did not have). `auto` may choose another backend then: the expert store moves to
        that backend's home. Returns the store."""
        held = dense_bytes_held(model)
        if self.dense_bytes is None or held == self.dense_bytes:
            return store
        log.info("dense layers hold %.2f GiB once loaded (%.2f planned): planning again", held / 2**30,
                 self.dense_bytes / 2**30)
        self.dense_bytes = held
        self.plan = self._plan_memory(model, fmt, fit_chunk=True)
        home = self.device if self.plan.backend == "fused" else torch.device("cpu")
        return store if store.device == home else store.moved_to(home)

    def _routing_recorder(self, folder):
        """--record-routing FILE: a tap writing every step's expert ids (moe/trace.py); rank 0 only."""
        path = self.ecfg.record_routing
        if not path or (self.tp and self.tp.rank != 0):
            return None
        from ..moe.trace import RoutingRecorder

        name = Path(folder).name if folder is not None else self.cfg.architecture
        return RoutingRecorder(path, name, self.cfg.num_layers, self.cfg.top_k)

    def set_route_tap(self, tap) -> None:
        """Replace the runtime's route tap (moe/trace.py: a recorder, or a forcer that drives routing from a
        trace in benchmarks); recorded decode graphs are dropped (they hold the old tap's ops)."""
        if getattr(self, "graphs", None) is not None:
            self.graphs.reset()
        self.route_tap = tap
        self.runtime.attach_tap(tap)

    def _planned_dense_bytes(self, model, folder, mode) -> int | None:
        """Dense bytes of a GGUF whose linears stay compressed (what they will hold); None: the parameters'."""
        if not mode or folder is None:
            return None
        from ..models.checkpoint import open_checkpoint

        return open_checkpoint(folder).dense_bytes(model, self.local_cfg, mode)

    @staticmethod
    def _dense_policy() -> str:
        """MOESTREAM_DENSE_QUANT: "auto" (default: on a GPU, compressed unless every expert fits with 16-bit
        dense layers), "1" (always), "0" (never: dequantized at load), "gpu" (the GPU's choice on any device)."""
        import os

        return os.environ.get("MOESTREAM_DENSE_QUANT", "auto")

    def _dense_mode(self) -> str | None:
        """Where a GGUF's dense linears stay compressed (one rank): "cpu" on a CPU with the compiled kernels,
        "gpu" on CUDA with Triton (the decode GEMV reads the blocks; MOESTREAM_DENSE_QUANT=0 dequantizes
        them to the model dtype at load, as before)."""
        env = self._dense_policy()
        if self.tp or env == "0":
            return None
        if env == "gpu":  # the GPU's choice of what stays compressed, on any device (tests on a CPU)
            return "gpu"
        if self.device.type == "cpu":
            return "cpu" if cpu_quant.available() else None
        from ..env import triton_enabled
        from ..moe.pairs import triton

        return "gpu" if triton is not None and triton_enabled() else None

    def reconfigure_experts(self, **changes) -> MoePlan:
        """Re-plan expert placement on the loaded weights (backend, --gpu-memory-gb, cache size...):
        a new runtime over the same master copies, moved between host and device as the backend needs.
        The KV and state pools are kept as they are. Used by benchmarks to sweep without reloading."""
        store = self._release_runtime()  # first: the plan sees the device memory the old runtime held
        old_ecfg, old_plan = self.ecfg, self.plan
        try:
            self.ecfg = self.ecfg.replace(**changes)
            self.plan = self._plan_memory(self.model, store.file_fmt)
        except Exception:  # refused: the engine goes on as it was (same options, same placement)
            self.ecfg, self.plan = old_ecfg, old_plan
            self._start_runtime(store, self.model)
            raise
        self._cap_torch()
        home = self.device if self.plan.backend == "fused" else torch.device("cpu")
        if store.device != home:
            store = store.moved_to(home)
            if home.type == "cpu" and self.device.type == "cuda":
                self.pinning = store.pin_host(self.plan.bytes.pin_budget)
        self._start_runtime(store, self.model)
        return self.plan

    # ---- live cache rebuild ----------------------------------------------------------------
    def plan_caches(self, kv_tokens: int, moe_slots: int | None) -> tuple[MoePlan, EngineConfig]:
        """The plan (and options) for a KV pool of kv_tokens tokens and moe_slots expert slots (None: the
        slots that fit), on the budget and expert backend this engine started with (tensor parallel: this
        rank's). Raises ConfigError with the reason when it does not fit, RequestError for slots this backend
        or model cannot have; changes nothing."""
        old = self.plan
        if moe_slots is not None and not old.cache_slots:
            raise RequestError(f"the {old.backend} expert backend keeps no expert slot cache to resize; "
                              "leave the expert slots out or ask for auto")
        if moe_slots is not None and moe_slots > old.total_experts:
            raise RequestError(f"{moe_slots} expert slots asked for but the model has {old.total_experts} routed "
                              "experts in all")
        e = self.ecfg.replace(num_tokens=kv_tokens, moe_cache_size=moe_slots, moe_cache_rate=None,
                              moe_backend=old.backend)
        plan = self._plan_memory(self.model, self.runtime.store.file_fmt, log_it=False, e=e)
        return dataclasses.replace(plan, reason=old.reason), e

    def resize_caches(self, plan: MoePlan, ecfg: EngineConfig, keep: dict[int, int]) -> None:
        """Apply a plan of plan_caches between steps: the KV pool gets plan.kv_tokens tokens holding the pages
        of `keep` (old page id -> new, from the scheduler, which owns the pages), and the expert runtime is
        rebuilt when its options change (the slot cache starts cold; tokens do not depend on placement). The
        linear-state pool is kept. What shrinks goes first, so the old and new sizes never add up."""
        kv = self.caches.kv
        pages = -(-plan.kv_tokens // ecfg.page_size)
        if getattr(self, "graphs", None) is not None:
            self.graphs.reset()  # recorded steps point into the old pools
        kv_first = pages < kv.num_pages
        if kv_first:
            kv.resize(pages, keep)
        if plan.runtime_options() != self.plan.runtime_options():
            store = self._release_runtime()
            self.plan = plan
            self._start_runtime(store, self.model)
        if pages != kv.num_pages:
            kv.resize(pages, keep)
        self.ecfg, self.plan = ecfg, plan
        for line in plan.describe().splitlines():
            log.info("%s", line)
        if self.device.type == "cuda":
            log.info("%s", self.memory_line())

    def _release_runtime(self):
        """Close the expert runtime and drop every reference to it, so its device cache is freed before a new
        one is allocated; returns its store."""
        old = self.runtime
        store = old.store
        old.close()
        if getattr(self, "graphs", None) is not None:
            self.graphs.reset()  # recorded steps point into the old runtime's pools
        self.runtime = None
        for block in self.model.moe_blocks():
            block.runtime = None
        del old
        # runtimes hold reference cycles (routers <-> runtime, the stats book <-> its parts), and LLM froze the one
        # built at load out of the collector's reach (gc.freeze): given back to the collector first, or its slot
        # pool stayed allocated beside the new one for good (measured on the H200: 24.5 GiB in use at an 8.5 GiB
        # cap after two re-plans); frozen again once the new runtime is built (_start_runtime)
        self._refreeze = gc.get_freeze_count() > 0
        gc.unfreeze()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return store

    def _start_runtime(self, store, model) -> None:
        self.runtime = build_runtime(self.plan.backend, store, self.device, self._runtime_options())
        self.runtime.attach_routers({b.layer: b.gate for b in model.moe_blocks()},
                                    draft_layers=self.cfg.mtp_layer_ids if self.use_mtp else ())
        self.runtime.attach_tap(self.route_tap)
        for block in model.moe_blocks():
            block.runtime = self.runtime
        if getattr(model, "cpu_decode", None) is not None:
            model.cpu_decode = None  # a CPU decode plan reads the runtime's expert tables: made again
            model.prepare_cpu_decode()
        if getattr(self, "_refreeze", False):  # the old runtime was frozen (_release_runtime): so is this one
            self._refreeze = False
            gc.freeze()

    def _cap_torch(self) -> None:
        """Under --gpu-memory-gb on CUDA, torch's allocator may hold at most the cap less the CUDA context, as on a
        card of that size: past it, it frees its cached blocks and retries before an out-of-memory error, so
        cached blocks of prefill buffers that grow chunk by chunk (attention over a long prompt) cannot take the
        process past the cap while the plan's own items fit. No cap: the whole device."""
        if self.device.type != "cuda":
            return
        total = torch.cuda.get_device_properties(self.device).total_memory
        cap = self.ecfg.gpu_memory_gb
        allow = total if cap is None else int(cap * 2**30) - self.hardware.context_bytes
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        torch.cuda.set_per_process_memory_fraction(min(max(allow, 0) / total, 1.0), index)

    def _runtime_options(self):
        return dataclasses.replace(self.plan.runtime_options(), decode_kernel=self.ecfg.moe_decode_kernel,
                                   cache_policy=self.ecfg.moe_cache_policy,
                                   max_pairs=self.ecfg.max_running_requests * self.cfg.top_k * self.rows_per_request,
                                   act_dtype=self.dtype)

    def _measure_bandwidths(self, fmt):
        """No saved `bench bw` profile for this device: a function the planner calls when auto has to weigh hybrid
        against offload, measuring pinned PCIe and the CPU experts in this model's format once (under a second)."""
        if self.device.type != "cuda":
            return None

        def measure():
            if getattr(self, "_probed_bw", None) is None:
                cfg, t0 = self.local_cfg, time.perf_counter()
                try:
                    self._probed_bw = quick_bandwidths(self.device, fmt, cfg.hidden_size, cfg.moe_intermediate_size,
                                                       cfg.top_k, self.dtype,
                                                       self.ecfg.moe_cpu_threads or self.hardware.physical_cores)
                except Exception as e:  # a measurement must not stop the load: auto then plans as without it
                    log.warning("could not measure PCIe and CPU expert bandwidths (%s: %s): auto picks offload; "
                                "`moestream bench bw` saves a profile", type(e).__name__, e)
                    self._probed_bw = False
                    return None
                log.info("no bench profile for %s: measured pinned PCIe %.1f GB/s, CPU experts %.1f GB/s in %.2f s "
                         "(`moestream bench bw` saves a fuller profile)", self.hardware.name,
                         self._probed_bw.pcie_pinned_gbs, self._probed_bw.cpu_expert_gbs, time.perf_counter() - t0)
            return self._probed_bw or None
        return measure

    def _plan_memory(self, model, fmt, log_it: bool = True, e: EngineConfig | None = None,
                     fit_chunk: bool = False) -> MoePlan:
        """One budget -> dense + state + workspace + expert slots + KV (moe/planner.py); logged.
        e: the options to plan for (default: this engine's). fit_chunk (while the engine is built, before the
        scheduler takes its chunk size): where the budget cannot hold the prefill workspace of
        --chunked-prefill-size tokens, plan smaller chunks before refusing, and run with them."""
        cfg, e = self.local_cfg, e or self.ecfg
        dense = getattr(self, "dense_bytes", None)
        if dense is None or getattr(self, "model", None) is not None:  # loaded (reconfigure): what it holds
            dense = dense_bytes_held(model)
        per_expert = fmt.bytes_per_expert(cfg.hidden_size, cfg.moe_intermediate_size)
        # the MTP layers' experts are placed like any layer's
        layers = [i for i, moe in enumerate(cfg.moe_layers) if moe] + (cfg.mtp_layer_ids if self.use_mtp else [])
        banks = bank_bytes(fmt, cfg.hidden_size, cfg.moe_intermediate_size, layers, cfg.num_experts)

        def make_sizes(dense_bytes: int):
            def sizes_for(opts: EngineConfig):
                kv, state_slot = self._cache_bytes(opts)
                state = state_slot * (opts.max_running_requests + self._snapshots(opts) + self._checkpoints(opts))
                sizes = model_sizes(cfg, opts, dense_bytes, self.max_seq_len, kv, state, per_expert, banks)
                if self.use_mtp:
                    sizes = dataclasses.replace(sizes, num_moe_layers=sizes.num_moe_layers + cfg.mtp_num_layers)
                return sizes
            return sizes_for

        sizes_for = make_sizes(dense)
        bw = Bandwidths.from_profile(load_profile(self.device)) or self._measure_bandwidths(fmt)
        if fit_chunk:
            try:
                plan, used = self._plan_fitting(sizes_for, e, bw)
            except ConfigError as err:
                hint = self._fitting_hint(make_sizes, dense, e, bw)
                if hint is None:
                    raise
                raise ConfigError(f"{err}; {hint}") from None
            if used.prefix_cache_snapshots != e.prefix_cache_snapshots:
                log.warning("the budget cannot hold %d prefix-cache state snapshots: keeping %d (a prompt resumes "
                            "from the nearest one it finds)", self._snapshots(e), self._snapshots(used))
                self.ecfg = self.ecfg.replace(prefix_cache_snapshots=used.prefix_cache_snapshots)
            if used.max_running_requests != e.max_running_requests:
                log.warning("the budget holds the state and a useful context (KV) of %d running requests, not %d "
                            "(--max-running-requests): at most %d run at once, the rest wait", used.max_running_requests,
                            e.max_running_requests, used.max_running_requests)
                self.ecfg = self.ecfg.replace(max_running_requests=used.max_running_requests)
            if used.prefill_rows_cap != e.prefill_rows_cap:
                log.warning("the budget cannot hold a prefill buffer of 64 rows beside prefill chunks of %d tokens: "
                            "%d rows a half (each prefill round streams that many experts)", used.chunked_prefill_size,
                            plan.prefill_slots)
                self.ecfg = self.ecfg.replace(prefill_rows_cap=used.prefill_rows_cap)
            if used.chunked_prefill_size != e.chunked_prefill_size:
                log.warning("the budget cannot hold prefill chunks of %d tokens (--chunked-prefill-size): prompts "
                            "are computed %d tokens per step", e.chunked_prefill_size, used.chunked_prefill_size)
                self.ecfg = self.ecfg.replace(chunked_prefill_size=used.chunked_prefill_size)
        else:
            plan = plan_memory(sizes_for(e), self.hardware, e, bw)
        for line in plan.describe().splitlines() if log_it else ():
            log.info("%s", line)
        return plan

    def _plan_fitting(self, sizes_for, e: EngineConfig, bw):
        """The plan for e or, where it is refused or its KV holds less than a useful context (USEFUL_KV_TOKENS, or
        all the requests can use), for smaller options, tried in this order (_smaller_options): smaller prefill
        chunks (halved down to PREFILL_CHUNK_KEEP), then fewer prefix-cache snapshots (a default count halved down
        to none), then fewer running requests (halved down to one; one rank only, as tensor-parallel ranks must
        agree); then all of that again with chunks down to PREFILL_CHUNK_FLOOR — so a small card keeps prefill
        chunks that do not restream every expert each few hundred tokens, and as many requests as it can give a
        useful context. An explicit --max-seq-len-override makes one whole
        request of it the useful context: fewer requests run before a 32k-token server holds less than 32k tokens of
        KV, and where no option holds that much the plan is refused (a server that takes the context it was asked for
        and then turns long prompts away would be worse). Otherwise, where no option reaches a useful context, the
        fitting plan with the most KV tokens. Refused with the smallest options' reason (and what was tried) when
        nothing fits. Returns (plan, the options it was made for)."""
        best, smallest = None, e
        asked = e.max_seq_len_override
        for opts in self._smaller_options(e):
            smallest = opts
            try:
                plan = plan_memory(sizes_for(opts), self.hardware, opts, bw)
            except ConfigError:
                continue
            wanted = sizes_for(opts).wanted_kv_tokens
            if plan.kv_tokens >= min(max(USEFUL_KV_TOKENS, asked or 0), wanted):
                return plan, opts
            if best is None or plan.kv_tokens > best[0].kv_tokens:
                best = (plan, opts)
        if best is not None and asked:
            plan, opts = best
            raise ConfigError(
                f"--max-seq-len-override {asked}: the budget holds KV for at most {plan.kv_tokens} tokens beside the "
                f"dense weights ({plan.bytes.dense / 2**30:.2f} GiB), {opts.max_running_requests} running request(s)' "
                f"state and a minimal expert cache: lower --max-seq-len-override or raise --gpu-memory-gb")
        if best is not None:
            return best
        try:  # the smallest options' own reason
            plan_memory(sizes_for(smallest), self.hardware, smallest, bw)
        except ConfigError as err:
            if smallest is e:
                raise
            kv = (f"; the KV of one --max-seq-len-override {asked}-token request, "
                  f"{asked * sizes_for(smallest).kv_bytes_per_token / 2**30:.2f} GiB, is held before any expert slot"
                  if asked else "")
            raise ConfigError(f"{err} (refused down to {smallest.max_running_requests} running request(s), "
                              f"{self._snapshots(smallest)} prefix-cache snapshots and prefill chunks of "
                              f"{smallest.chunked_prefill_size} tokens{kv})") from None
        raise AssertionError("unreachable: the smallest options were refused in the loop")

    def _fitting_hint(self, make_sizes, dense: int, e: EngineConfig, bw) -> str | None:
        """Where the plan for e is refused: the options a user did not give that would make one fit, tried in this order
        — an fp8 KV cache, the vocabulary head in Q8_0 (where it applies: self.head_q8), both — as a sentence for the
        refusal's line; None where none of them does."""
        tries = []
        kv = self.num_kv_layers and not e.kv_cache_dtype.startswith("fp8")
        head = getattr(self, "head_q8", None) if e.lm_head_quant == "none" else None
        if kv:
            tries.append((("--kv-cache-dtype fp8",), e.replace(kv_cache_dtype="fp8"), dense))
        if head:
            tries.append((("--lm-head-quant q8_0",), e.replace(lm_head_quant="q8_0"), dense - head[0] + head[1]))
        if kv and head:
            tries.append((("--kv-cache-dtype fp8", "--lm-head-quant q8_0"),
                          e.replace(kv_cache_dtype="fp8", lm_head_quant="q8_0"), dense - head[0] + head[1]))
        for flags, opts, d in tries:
            try:
                self._plan_fitting(make_sizes(d), opts, bw)
            except ConfigError:
                continue
            return (f"it fits with {' '.join(flags)} (an fp8 KV cache keeps 3 mantissa bits; a Q8_0 head rounds the "
                    f"vocabulary projection's weights to 8 bits a value)")
        return None

    def _smaller_options(self, e: EngineConfig):
        """e, then smaller options in the order _plan_fitting tries them: first with prefill chunks of at least
        PREFILL_CHUNK_KEEP tokens (or e's own if smaller), then the same with the prefill buffer's rows capped at 32,
        16 and 8 a half (a prefill round streams fewer experts; the planner keeps at least top-k), then again with
        chunks down to PREFILL_CHUNK_FLOOR and the rows uncapped; each pass halves the chunk, then the default
        snapshot count, then the running requests. (Without the row caps a budget that holds 1,024-token chunks but
        not 64 rows' room went to 256-token chunks — a 32k prompt then streams every expert 128 times, not 32 —
        where a smaller buffer fits.)"""
        seen = set()
        keep = min(PREFILL_CHUNK_KEEP, e.chunked_prefill_size)
        caps = [(keep, e.prefill_rows_cap)]
        if e.prefill_rows_cap is None and not prefill_rows():  # (MOESTREAM_PREFILL_ROWS fixes the rows)
            caps += [(keep, rows) for rows in (32, 16, 8)]
        for floor, cap in caps + [(PREFILL_CHUNK_FLOOR, e.prefill_rows_cap)]:
            for opts in self._options_down_to(e if cap == e.prefill_rows_cap else e.replace(prefill_rows_cap=cap),
                                              floor):
                key = (opts.max_running_requests, opts.prefix_cache_snapshots, opts.chunked_prefill_size,
                       opts.prefill_rows_cap)
                if key not in seen:
                    seen.add(key)
                    yield opts

    def _options_down_to(self, e: EngineConfig, floor: int):
        n = e.max_running_requests
        while True:
            at_n = e if n == e.max_running_requests else e.replace(max_running_requests=n)
            snaps = self._snapshots(at_n)
            while True:
                with_snaps = at_n if snaps == self._snapshots(at_n) else at_n.replace(prefix_cache_snapshots=snaps)
                chunk = e.chunked_prefill_size
                yield with_snaps
                while chunk > floor:
                    chunk = max(floor, chunk // 2)
                    yield with_snaps.replace(chunked_prefill_size=chunk)
                if at_n.prefix_cache_snapshots is not None or not snaps:
                    break
                snaps //= 2
            if self.tp or n <= 1:
                return
            n //= 2

    def _fit_snapshots(self, sizes_for, e: EngineConfig, bw):
        """plan_fitting_chunk (smaller prefill chunks before a refusal); where even that is refused and the
        prefix cache's snapshot count is the default, fewer snapshots (halved down to none) before the first
        refusal is raised: on a small card a long prompt matters more than the snapshots' granularity."""
        try:
            return plan_fitting_chunk(sizes_for, self.hardware, e, bw)
        except ConfigError as err:
            first, n = err, self._snapshots(e)
            if e.prefix_cache_snapshots is not None or not n:
                raise
        while n:
            n //= 2
            fewer = e.replace(prefix_cache_snapshots=n)
            try:
                return plan_fitting_chunk(sizes_for, self.hardware, fewer, bw)
            except ConfigError:
                continue
        raise first

    def kv_dtype(self, e: EngineConfig | None = None) -> torch.dtype:
        """The KV cache's element type: --kv-cache-dtype, or the model's (auto)."""
        name = (e or self.ecfg).kv_cache_dtype
        return self.dtype if name == "auto" else KV_DTYPES[name]

    def _cache_bytes(self, e: EngineConfig | None = None) -> tuple[int, int]:
        """(KV bytes per token, bytes of one linear-state slot) of this rank (e: the options; default this
        engine's). The KV layers include the MTP block's when it is loaded."""
        cfg, e = self.local_cfg, e or self.ecfg
        kv = KVPool.bytes_per_token(self.num_kv_layers, cfg.num_kv_heads, cfg.head_dim, self.kv_dtype(e))
        state = StatePool.bytes_per_slot(
            len(cfg.linear_attention_layers), cfg.linear_conv_dim, max(cfg.linear_conv_kernel, 1),
            cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, self.dtype,
            DTYPES[e.linear_state_dtype]) if cfg.linear_attention_layers else 0
        return kv, state

    def _build_caches(self) -> Caches:
        cfg, e = self.local_cfg, self.ecfg
        num_tokens = max(self.plan.kv_tokens, e.page_size)
        kv = KVPool(self.num_kv_layers, -(-num_tokens // e.page_size), e.page_size, cfg.num_kv_heads,
                    cfg.head_dim, self.kv_dtype(e), self.device)
        state = StatePool(len(cfg.linear_attention_layers), e.max_running_requests, cfg.linear_conv_dim,
                          max(cfg.linear_conv_kernel, 1), cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                          cfg.linear_value_head_dim, self.dtype, DTYPES[e.linear_state_dtype], self.device,
                          num_snapshots=self.num_state_snapshots, num_checkpoints=self.num_state_checkpoints)
        return Caches(kv, state, self._build_host_tier(kv, state))

    def spilled_snapshots(self) -> int:
        """Prefix-cache snapshots the plan could not keep on the GPU (the default count, cut by _plan_fitting) that a
        host tier holds instead when --prefix-cache-host-gb is not given: the device keeps at least one slot to take
        a snapshot in before it moves out (one rank on CUDA only; 0 otherwise)."""
        kept = self.num_state_snapshots
        if self.device.type != "cuda" or self.tp or not kept or not self.ecfg.prefix_cache:
            return 0
        return max(0, getattr(self, "asked_snapshots", kept) - kept)

    def _build_host_tier(self, kv: KVPool, state: StatePool) -> HostPool | None:
        """The prefix cache's host tier: --prefix-cache-host-gb split over the ranks, half of it for state
        snapshots on Qwen3.5/3.6 (HostPool.split); without it, where the plan cut the snapshots kept on the GPU,
        a tier of just those snapshots (spilled_snapshots), so a small card still resumes prompts from them."""
        e = self.ecfg
        if not e.prefix_cache:
            return None
        if not e.prefix_cache_host_gb:
            spill = self.spilled_snapshots()
            if not spill:
                return None
            log.info("prefix cache host tier: %d state snapshots the GPU budget cannot keep (%.2f GiB pinned host "
                     "memory; %d stay on the device)", spill, spill * self._cache_bytes()[1] / 2**30,
                     self.num_state_snapshots)
            return HostPool(kv, state, 0, spill, pin=True)
        budget = int(e.prefix_cache_host_gb * 2**30) // e.tp_size
        token, snap = self._cache_bytes()
        pages, snaps = HostPool.split(budget, token * e.page_size, snap)
        log.info("prefix cache host tier: %d pages, %d snapshots (%.2f GiB%s)", pages, snaps, budget / 2**30,
                 ", pinned" if self.device.type == "cuda" else "")
        return HostPool(kv, state, pages, snaps, pin=self.device.type == "cuda")

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        # a speculative verify step of the same number of rows a request runs as a decode step of one row a
        # token (graphs.verify_rows): decode's kernels, and a CUDA graph (which keeps the drafter's hidden rows)
        if batch.extra.get("decode_like") and not batch.is_decode:
            batch = verify_rows(batch) or batch
        decode = batch.is_decode
        graphs = getattr(self, "graphs", None)
        # tensor parallel ranks run eagerly: recording NCCL all-reduces in graphs is untested here
        if graphs is None and self.device.type == "cuda" and self.ecfg.cuda_graphs and not self.tp:
            graphs = self.graphs = DecodeGraphs(self)
        use_graph = graphs is not None and decode and graphs.usable(batch)
        state = self.caches.state
        for slot in batch.state_resets:  # requests admitted this step (before the host tier may fill a slot)
            state.reset(slot)
        if batch.host_copies:  # the prefix cache's spills to and fetches from host memory, in order
            self.caches.host.run(batch.host_copies, self.caches.kv, state)
        self.caches.kv.copy_heads(batch.kv_copies)  # prefix-cache copy-on-write of partly shared pages
        state.copy(batch.state_loads)  # prefix-cache hits resume from their snapshot
        # a speculative verify step without prompt rows is a decode step for the experts (the slot cache and
        # its LRU, the pair kernels; not prefill streaming)
        decode_like = decode or bool(batch.extra.get("decode_like"))
        self.runtime.begin_step({"num_tokens": batch.num_tokens, "decode": decode_like, "graph": use_graph,
                                 "seqs": batch.seqs, "overlapped": bool(batch.extra.get("overlapped"))})
        try:
            if use_graph:
                out = graphs.run(batch)
            else:
                if decode and self.device.type == "cuda" and "decode_kv_index" not in batch.extra:
                    batch.extra.update(decode_extra(batch))  # one padded KV index per step, not per layer
                out = self.model(batch)
            state.copy(batch.state_saves)  # snapshots at page boundaries, after the step reached them
            return out
        finally:
            self.runtime.end_step()

    def draft(self, batch: ForwardBatch, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        """One pass of the MTP block (QwenMoeModel.draft), its experts through the same expert runtime: as a decode
        step's (the slot cache, the pair kernels) where the pass covers a decode or verify step's few rows a
        request (decode_like, set by the runner), not as a prompt chunk's (prefill streaming)."""
        decode = batch.is_decode or bool(batch.extra.get("decode_like"))
        if decode and self._draft_rows_attention() and "decode_kv_index" not in batch.extra:
            # every row its own decode row: the block's attention over the whole context in one split-KV call
            # (layers/attn_decode.py), not one SDPA call per request
            batch.extra.update(decode_extra(batch))
        self.runtime.begin_step({"num_tokens": batch.num_tokens, "decode": decode, "graph": False, "draft": True,
                                 "seqs": batch.seqs, "draft_layer": self.cfg.num_layers + step % self.cfg.mtp_num_layers,
                                 "draft_rows": batch.extra.get("draft_rows")})
        try:
            return self.model.draft(batch, hidden, step)
        finally:
            self.runtime.end_step()
            self.runtime.finish_step()

    def _draft_rows_attention(self) -> bool:
        """The MTP block's decode-like passes lay their rows out as decode rows (CUDA: the split-KV kernel)."""
        return self.device.type == "cuda"

    def overlap_ok(self, rows: int | None = None) -> bool:
        """Whether decode steps (of `rows` rows, where known) may overlap (LLMEngine.step launches the next before
        reading this one's tokens): --overlap-schedule on (any device) or auto on CUDA where a decode step has no host
        synchronisation (the runtime is capturable); one rank, no MTP drafter. fused and offload; on CUDA also cpu and
        hybrid with `on` (the CPU worker serves the launched step's job after the pending one's, moe/bridge.py) — not
        under `auto` until an A/B on a GPU host shows the host's work beside the worker's threads does not slow their
        layer calls more than it saves; but hybrid under `auto` while its arms hold the fetch form for that batch size
        (its steps are then offload's, with no worker job: ExpertRuntime.overlappable)."""
        mode = self.ecfg.overlap_schedule
        backends = ("fused", "offload")
        if self.device.type == "cuda" and mode == "on":
            backends += ("cpu", "hybrid")
        elif (self.device.type == "cuda" and mode == "auto" and self.plan.backend == "hybrid" and rows is not None
              and self.runtime.overlappable(rows)):
            backends += ("hybrid",)
        if mode == "off" or self.tp or self.use_mtp or self.plan.backend not in backends:
            return False
        if self.device.type == "cuda":
            return self.runtime.capturable()
        return mode == "on"

    def wait_forward(self) -> None:
        """Before the caller reads the last forward's results: where CPU threads compute experts in that step,
        sleep until the GPU is done instead of spinning a core in the read's sync (ExpertRuntime.wait_step)."""
        self.runtime.wait_step()

    def finish_step(self) -> None:
        """After the caller waited for the last forward's results: the expert runtime's CPU worker is waited for
        and raises that step's failure (forward itself does not wait, so sampling queues behind the step)."""
        self.runtime.finish_step()


def dense_bytes_held(model) -> int:
    """Bytes of a model's dense weights as held: its parameters and the compressed linears' stored bytes."""
    return (sum(p.numel() * p.element_size() for p in model.parameters())
            + sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                  if n.endswith((".raw", ".raw_scale", ".raw_scale2", ".in_perm")) or ".pl_" in n))

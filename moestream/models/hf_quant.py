"""The quantized parts of an HF checkpoint (`ModelConfig.quantization`: FP8 128x128-block or per-tensor,
ModelOpt FP8 and NVFP4, MXFP4), read through `ShardTensors`.

`QuantizedParts.expert_format` reads the stored dtype of every part of the first MoE layer's experts
from the file headers (`moe.formats.hf_expert_format`); `QuantizedParts.load` hands each projection's
parts (`weight`, `weight_scale_inv`, ...; stacked `gate_up_proj`, `gate_up_proj_scale_inv`,
`gate_up_proj_blocks`, ...) to the expert store as bytes, or dequantized with --moe-expert-format dense.
Quantized dense (non-expert) weights are dequantized at load into the model dtype, or, with
`compressed_dense="gpu"` (the engine's choice on a GPU where the experts do not all fit beside 16-bit dense
layers), kept as stored in `layers.quant_linear.HFQuantLinear` modules (FP8, NVFP4, MXFP4: the GPU decode
kernel reads their codes): a Qwen3.6-35B-A3B-shaped FP8 checkpoint's dense layers are then 1.4 GB, not 2.9 GB.
Modules the config excludes (modules_to_not_convert / exclude_modules / ignore) must be stored
unquantized. Activation and KV scales (input_scale, k_scale, v_scale) are not used: activations and the
KV cache stay in the model dtype.
"""
from __future__ import annotations

import fnmatch
import re

import torch

from ..config import ModelConfig
from ..core import CheckpointError
from ..moe.store import ExpertStore
from .safetensors_shards import ShardTensors

# any part of an expert projection, one expert's or stacked (names as the store's layer ids name them)
Q_PER_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.(\w+)$")
Q_STACKED = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj(?:_(\w+))?$")
UNUSED_SCALES = ("input_scale", "k_scale", "v_scale")


def _is_quantized(dtype: torch.dtype) -> bool:
    return dtype.itemsize == 1  # fp8 codes, packed fp4 pairs


class QuantizedParts:
    """The quantized parts of a checkpoint (cfg.quantization), read through `tensors`.

    A projection's parts are named after its module (`...q_proj.weight`, `...q_proj.weight_scale_inv`;
    per expert `...experts.N.gate_proj.weight_scale`) or, stacked, after the stacked tensor
    (`...experts.gate_up_proj`, `..._scale_inv`, `..._blocks`, `..._scales`), as transformers names them.
    """

    def __init__(self, cfg: ModelConfig, tensors: ShardTensors, model: torch.nn.Module | None = None,
                 compressed_dense: str | None = None):
        """model, compressed_dense ("gpu"): the model whose plain dense Linears of a quantized weight are swapped
        for HFQuantLinears holding the stored parts (`keeps_compressed`); None: dequantized into the parameters."""
        from ..quant import hf_quant_format

        self.cfg, self.tensors, self.exclude = cfg, tensors, cfg.quantization["exclude"]
        self.model = model if compressed_dense == "gpu" else None
        self.qfmt = hf_quant_format(cfg.quantization)
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
    def load(self, key: str, name: str, ename: str, params, store: ExpertStore, seen: set[str]) -> bool:
        """Load `key` (model name `name`; `ename`: the name by its store layer id, which differs for an MTP
        layer's experts) if it is a quantized weight (with all its parts), skip it if it is a part read
        with its weight or an unused activation/KV scale; False: a plain tensor."""
        if name.rpartition(".")[2] in UNUSED_SCALES:
            return True
        prefix = key[:len(key) - len(name)]

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

    def keeps_compressed(self, module) -> bool:
        """Whether a dense module stays compressed (HFQuantLinear) rather than dequantized: a plain Linear without
        bias, in a format the GPU decode kernel reads, when the loader was asked to keep them."""
        from ..kernels.linear import Linear
        from ..layers.quant_linear import hf_gpu_gemv

        return (self.model is not None and type(module) is Linear and module.bias is None
                and module.weight.dim() == 2 and hf_gpu_gemv(self.qfmt))

    def compressed_bytes(self, shape: tuple[int, int], keys: dict) -> int:
        """Bytes an [N, K] weight keeps as stored (its parts' numel times their stored sizes)."""
        total = 0
        for part, (pshape, _) in self.qfmt.part_specs(shape).items():
            n = 1
            for d in pshape:
                n *= d
            total += n * self.tensors.dtype(keys[part]).itemsize
        return total

    def _load_dense(self, pname: str, key: str, parts: dict, params, seen: set[str]) -> None:
        param = params.get(pname)
        if param is None:
            raise CheckpointError(f"unexpected tensor {key}: the {self.cfg.architecture} model has no parameter "
                                  f"{pname}")
        path = pname.removesuffix(".weight")
        module = self.model.get_submodule(path) if self.model is not None else None
        if module is not None and self.keeps_compressed(module):
            self._keep(path, module, parts, key)
            seen.add(pname)
            return
        with torch.no_grad():
            param.copy_(self._dequant(parts, tuple(param.shape), key))
        seen.add(pname)

    def _keep(self, path: str, module, parts: dict, key: str) -> None:
        """Swap `module` (model path `path`) for an HFQuantLinear holding copies of the weight's stored parts."""
        from ..layers.quant_linear import HFQuantLinear

        n, k = module.weight.shape
        for part, (pshape, _) in self.qfmt.part_specs((n, k)).items():
            want = 1
            for d in pshape:
                want *= d
            if parts[part].numel() != want:
                raise CheckpointError(f"tensor {key} is not a {self.qfmt.name} weight of shape {(n, k)}: its "
                                      f"{part} has {parts[part].numel()} values, expected {want}")
        kept = {part: t.contiguous().clone() for part, t in parts.items()}  # out of the file's pages
        parent, _, child = path.rpartition(".")
        setattr(self.model.get_submodule(parent) if parent else self.model, child, HFQuantLinear(self.qfmt, kept, n, k))

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

"""Expert formats: which arrays one routed expert has, their shapes, dtypes and bytes, and its SwiGLU.

A format is a row here:
- dense (`dense_format(dtype)`): gate_up [2I, H] and down [H, I] in the model dtype;
- GGUF quantized (`gguf_expert_format(types)`): gate [I, H], up [I, H] and down [H, I] (logical shapes)
  kept as their GGUF bytes, one uint8 row of `fmt.nbytes(shape)` bytes per expert and array;
- HF quantized safetensors (`hf_expert_format(qfmt, dtypes)`): per projection the checkpoint's own
  parts, e.g. `gate.weight` (fp8) and `gate.weight_scale_inv`, NVFP4 `weight`/`weight_scale`/
  `weight_scale_2`, MXFP4 `blocks`/`scales`, each one uint8 row of its stored bytes per expert.

Banks, copies and device slots move these rows as they are, so a compressed expert costs its
compressed bytes everywhere. `expert_mlp(x, rows)` is one expert's SwiGLU wherever its rows are: dense
formats run `swiglu.expert_mlp` (also `compute.expert_mlp`); quantized formats run `quant.qlinear`, which
dequantizes one row tile at a time on CPU (a whole expert is never expanded there) and whole matrices
on a GPU. Every backend calls this one method, so on one device they agree token for token. `dense()` dequantizes
a whole expert (`ExpertStore.weights`, tests).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .swiglu import expert_mlp, swiglu

PROJS = ("gate", "up", "down")


@dataclass(frozen=True)
class ExpertFormat:
    name: str
    dtype: torch.dtype  # dtype of the stored arrays (uint8 for compressed rows)

    quantized = False

    def arrays(self, hidden: int, inter: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """array name -> (shape of that array for ONE expert, stored dtype)."""
        return {name: (shape, self.dtype) for name, shape in self.shapes(hidden, inter).items()}

    def shapes(self, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
        # gate and up are stacked so one GEMM computes both: rows [0, I) gate, [I, 2I) up.
        return {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}

    def bytes_per_expert(self, hidden: int, inter: int) -> int:
        return sum(_numel(shape) * dt.itemsize for shape, dt in self.arrays(hidden, inter).values())

    def tensor_name(self, array: str) -> str:
        """Checkpoint name (after `experts.N.`) of one array, for messages about missing tensors."""
        return f"{array}_proj.weight"

    def for_layer(self, layer: int) -> "ExpertFormat":
        """The format of one layer's experts (itself, except for per-layer GGUF types)."""
        return self

    def dense(self, rows: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's stored arrays -> (gate_up [2I, H], down [H, I]); dense rows are used as they are."""
        return rows["gate_up"], rows["down"]

    def expert_mlp(self, x: torch.Tensor, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """SwiGLU of one expert on x [n, H]; rows = that expert's stored arrays."""
        return expert_mlp(x, rows["gate_up"], rows["down"])


@dataclass(frozen=True)
class QuantizedExpertFormat(ExpertFormat):
    """Compressed experts: gate [I, H], up [I, H], down [H, I], each a moestream.quant weight."""

    hidden: int = 0
    inter: int = 0

    quantized = True

    def logical(self, hidden: int, inter: int) -> dict[str, tuple[int, int]]:
        return {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}

    def weight(self, rows: dict[str, torch.Tensor], proj: str):
        """(QuantFormat, raw parts, logical shape) of one projection of one expert (subclasses)."""
        raise NotImplementedError

    def dense(self, rows: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        g, u, d = (q.dequantize(raw, shape, dtype).reshape(shape) for q, raw, shape in
                   (self.weight(rows, p) for p in PROJS))
        return torch.cat([g, u], dim=0), d

    def expert_mlp(self, x: torch.Tensor, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        g = self._linear(x, rows, "gate")
        u = self._linear(x, rows, "up")
        return self._linear(swiglu(g, u), rows, "down")

    def _linear(self, x: torch.Tensor, rows: dict[str, torch.Tensor], proj: str) -> torch.Tensor:
        from ..quant import qlinear

        q, raw, shape = self.weight(rows, proj)
        return qlinear(x, q, raw, shape)  # CPU: L2-sized row tiles; a GPU: the whole matrix in one tile


@dataclass(frozen=True)
class GGUFExpertFormat(QuantizedExpertFormat):
    """Routed experts kept as GGUF blocks; `types` is ((array, GGUF type name), ...) for gate, up, down."""

    types: tuple[tuple[str, str], ...] = ()

    def shapes(self, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
        return {name: (self.quant(name).nbytes(shape),) for name, shape in self.logical(hidden, inter).items()}

    def quant(self, name: str):
        from ..quant import gguf_format

        return gguf_format(dict(self.types)[name])

    def weight(self, rows, proj):
        shape = self.logical(self.hidden, self.inter)[proj]
        q = self.quant(proj)
        # a slot row sized for a bigger type of another layer holds this layer's bytes first
        return q, rows[proj][:q.nbytes(shape)], shape


@dataclass(frozen=True)
class LayeredGGUFFormat(ExpertFormat):
    """GGUF experts whose types differ between layers (Q4_K_M and friends: Q6_K down in some layers).
    Each layer's bank holds its own type's bytes (`for_layer`); slot and prefill rows are sized for the
    largest type of each array, and a layer's experts occupy the front of a row."""

    per_layer: tuple[tuple[int, GGUFExpertFormat], ...] = ()

    quantized = True

    def for_layer(self, layer: int) -> GGUFExpertFormat:
        return dict(self.per_layer)[layer]

    def shapes(self, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
        sizes = [f.shapes(hidden, inter) for _, f in self.per_layer]
        return {name: (max(s[name][0] for s in sizes),) for name in sizes[0]}

    def tensor_name(self, array: str) -> str:
        return self.per_layer[0][1].tensor_name(array)

    def dense(self, rows, dtype):
        raise TypeError("per-layer GGUF experts are computed through for_layer(layer)")

    expert_mlp = dense


@dataclass(frozen=True)
class HFExpertFormat(QuantizedExpertFormat):
    """Routed experts kept in an HF safetensors quantization: array `proj.part` (e.g. `gate.weight_scale_inv`)
    holds that part's stored bytes; `parts` records each array's stored dtype (scales may be fp32 or bf16)."""

    qfmt: object = None  # moestream.quant.QuantFormat
    parts: tuple[tuple[str, torch.dtype], ...] = ()

    def shapes(self, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
        dtypes = dict(self.parts)
        out = {}
        for proj, shape in self.logical(hidden, inter).items():
            for part, (pshape, _) in self.qfmt.part_specs(shape).items():
                out[f"{proj}.{part}"] = (_numel(pshape) * dtypes[f"{proj}.{part}"].itemsize,)
        return out

    def tensor_name(self, array: str) -> str:
        proj, part = array.split(".", 1)
        return f"{proj}_proj.{part}"

    def weight(self, rows, proj):
        dtypes = dict(self.parts)
        raw = {}
        for p in self.qfmt.parts:
            a, dt = rows[f"{proj}.{p.name}"], dtypes[f"{proj}.{p.name}"]
            raw[p.name] = a if dt.itemsize == 1 else a.view(dt)  # 1-byte codes are decoded from uint8
        return self.qfmt, raw, self.logical(self.hidden, self.inter)[proj]


def dense_format(dtype: torch.dtype) -> ExpertFormat:
    return ExpertFormat(name=str(dtype).replace("torch.", ""), dtype=dtype)


def layered_gguf_format(types: dict[int, dict[str, str]], hidden: int, inter: int) -> ExpertFormat:
    """types: layer -> {"gate"|"up"|"down": GGUF type}; one GGUFExpertFormat when all layers agree."""
    formats = {layer: gguf_expert_format(t, hidden, inter) for layer, t in sorted(types.items())}
    distinct = list(dict.fromkeys(formats.values()))
    if len(distinct) == 1:
        return distinct[0]
    names = "/".join(dict.fromkeys(v for f in distinct for _, v in f.types))
    return LayeredGGUFFormat(name=f"gguf:{names} per layer", dtype=torch.uint8, per_layer=tuple(formats.items()))


def gguf_expert_format(types: dict[str, str], hidden: int, inter: int) -> GGUFExpertFormat:
    """types: {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"} (each array may have its own type)."""
    t = tuple((n, types[n].upper()) for n in PROJS)
    name = "gguf:" + "/".join(dict.fromkeys(v for _, v in t))
    return GGUFExpertFormat(name=name, dtype=torch.uint8, types=t, hidden=hidden, inter=inter)


def hf_expert_format(qfmt, dtypes: dict[str, torch.dtype], hidden: int, inter: int) -> HFExpertFormat:
    """qfmt: a moestream.quant format (fp8_block, fp8_tensor, nvfp4, mxfp4, ...); dtypes: the stored
    dtype of every `proj.part` array, e.g. {"gate.weight": torch.float8_e4m3fn, "gate.weight_scale_inv":
    torch.bfloat16, ...}."""
    names = [f"{proj}.{p.name}" for proj in PROJS for p in qfmt.parts]
    missing = [n for n in names if n not in dtypes]
    if missing:
        raise ValueError(f"hf_expert_format: no dtype for {missing}")
    return HFExpertFormat(name=f"hf:{qfmt.name}", dtype=torch.uint8, hidden=hidden, inter=inter, qfmt=qfmt,
                          parts=tuple((n, dtypes[n]) for n in names))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n

"""Expert formats: which arrays one routed expert has, their shapes, dtypes and bytes.

A format is a row here:
- dense (`dense_format(dtype)`): gate_up [2I, H] and down [H, I] in the model dtype;
- GGUF quantized (`gguf_expert_format(types)`): gate [I, H], up [I, H] and down [H, I] (logical shapes)
  kept as their GGUF bytes, one uint8 row of `fmt.nbytes(shape)` bytes per expert and array. Banks,
  copies and device slots move these compressed rows; `dense()` dequantizes one expert inside the
  expert computation (moestream.quant, bit-identical to dequantizing at load).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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
        return sum(_numel(shape) * torch.empty((), dtype=dt).element_size()
                   for shape, dt in self.arrays(hidden, inter).values())

    def dense(self, rows: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's stored arrays -> (gate_up [2I, H], down [H, I]); dense rows are used as they are."""
        return rows["gate_up"], rows["down"]


@dataclass(frozen=True)
class GGUFExpertFormat(ExpertFormat):
    """Routed experts kept as GGUF blocks; `types` is ((array, GGUF type name), ...) for gate, up, down."""

    types: tuple[tuple[str, str], ...] = ()
    hidden: int = 0
    inter: int = 0

    quantized = True

    def logical(self, hidden: int, inter: int) -> dict[str, tuple[int, int]]:
        return {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}

    def shapes(self, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
        return {name: (self.quant(name).nbytes(shape),) for name, shape in self.logical(hidden, inter).items()}

    def quant(self, name: str):
        from ..quant import gguf_format

        return gguf_format(dict(self.types)[name])

    def dense(self, rows: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        shapes = self.logical(self.hidden, self.inter)
        g, u, d = (self.quant(n).dequantize(rows[n], shapes[n], dtype).reshape(shapes[n]) for n in ("gate", "up", "down"))
        return torch.cat([g, u], dim=0), d


def dense_format(dtype: torch.dtype) -> ExpertFormat:
    return ExpertFormat(name=str(dtype).replace("torch.", ""), dtype=dtype)


def gguf_expert_format(types: dict[str, str], hidden: int, inter: int) -> GGUFExpertFormat:
    """types: {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"} (each array may have its own type)."""
    t = tuple((n, types[n].upper()) for n in ("gate", "up", "down"))
    name = "gguf:" + "/".join(dict.fromkeys(v for _, v in t))
    return GGUFExpertFormat(name=name, dtype=torch.uint8, types=t, hidden=hidden, inter=inter)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n

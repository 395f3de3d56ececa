"""Expert formats: which arrays one routed expert has, their shapes and bytes.

A format is a row here; quantised formats become new rows with their own arrays and a dequantiser.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertFormat:
    name: str
    # array name -> shape of that array for ONE expert, given (hidden H, intermediate I)
    dtype: torch.dtype

    def shapes(self, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
        # gate and up are stacked so one GEMM computes both: rows [0, I) gate, [I, 2I) up.
        return {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}

    def bytes_per_expert(self, hidden: int, inter: int) -> int:
        size = torch.empty((), dtype=self.dtype).element_size()
        return sum(a * b for a, b in self.shapes(hidden, inter).values()) * size


def dense_format(dtype: torch.dtype) -> ExpertFormat:
    return ExpertFormat(name=str(dtype).replace("torch.", ""), dtype=dtype)

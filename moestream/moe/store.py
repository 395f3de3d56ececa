"""The master copy of every routed expert: one stacked tensor per (layer, array).

The loader hands expert tensors here (never to the model's state dict). Tensors may arrive one
expert at a time (`experts.N.gate_proj.weight`) or stacked (`experts.gate_up_proj`); either way the
store ends with gate_up [E, 2I, H] and down [E, H, I] per MoE layer on its home device.
"""
from __future__ import annotations

import torch

from ..core import CheckpointError
from .formats import ExpertFormat


class ExpertStore:
    def __init__(self, moe_layers: list[int], num_experts: int, hidden: int, inter: int, fmt: ExpertFormat,
                 device: torch.device | str, pin: bool = False):
        self.moe_layers = list(moe_layers)
        self.num_experts, self.hidden, self.inter, self.fmt = num_experts, hidden, inter, fmt
        self.device = torch.device(device)
        shapes = fmt.shapes(hidden, inter)
        self.banks: dict[str, dict[int, torch.Tensor]] = {}
        for name, shape in shapes.items():
            self.banks[name] = {
                layer: torch.empty((num_experts, *shape), dtype=fmt.dtype, device=self.device, pin_memory=pin)
                for layer in self.moe_layers
            }
        # filled[name][layer] is a bool per expert (and per half of gate_up) so missing tensors are found.
        self._filled = {(name, layer): torch.zeros(num_experts, 2 if name == "gate_up" else 1, dtype=torch.bool)
                        for name in shapes for layer in self.moe_layers}

    # ---- filling -------------------------------------------------------------------------
    def put_stacked(self, layer: int, name: str, tensor: torch.Tensor, tensor_name: str) -> None:
        bank = self._bank(layer, name, tensor_name)
        if tuple(tensor.shape) != tuple(bank.shape):
            raise CheckpointError(f"tensor {tensor_name} has shape {tuple(tensor.shape)}, expected {tuple(bank.shape)}")
        bank.copy_(tensor)
        self._filled[(name, layer)][:] = True

    def put_expert(self, layer: int, expert: int, proj: str, tensor: torch.Tensor, tensor_name: str) -> None:
        """proj is gate_proj, up_proj or down_proj of one expert."""
        if not 0 <= expert < self.num_experts:
            raise CheckpointError(f"tensor {tensor_name}: expert {expert} is out of range (num_experts {self.num_experts})")
        I, H = self.inter, self.hidden
        if proj == "down_proj":
            bank, part, want = self._bank(layer, "down", tensor_name), slice(None), (H, I)
            mark = 0
        elif proj in ("gate_proj", "up_proj"):
            bank = self._bank(layer, "gate_up", tensor_name)
            mark = 0 if proj == "gate_proj" else 1
            part, want = slice(mark * I, (mark + 1) * I), (I, H)
        else:
            raise CheckpointError(f"unexpected expert tensor {tensor_name}")
        if tuple(tensor.shape) != want:
            raise CheckpointError(f"tensor {tensor_name} has shape {tuple(tensor.shape)}, expected {want}")
        bank[expert, part].copy_(tensor)
        key = ("down" if proj == "down_proj" else "gate_up", layer)
        self._filled[key][expert, mark] = True

    def _bank(self, layer: int, name: str, tensor_name: str) -> torch.Tensor:
        if layer not in self.banks[name]:
            raise CheckpointError(f"unexpected tensor {tensor_name}: layer {layer} has no routed experts")
        return self.banks[name][layer]

    def missing(self, prefix_of) -> list[str]:
        """Names of expert tensors never filled; prefix_of(layer) gives the checkpoint's layer prefix."""
        out = []
        for (name, layer), f in self._filled.items():
            for e in (~f).any(-1).nonzero().flatten().tolist():
                if name == "down":
                    out.append(f"{prefix_of(layer)}mlp.experts.{e}.down_proj.weight")
                else:
                    for half, proj in enumerate(("gate_proj", "up_proj")):
                        if not f[e, half]:
                            out.append(f"{prefix_of(layer)}mlp.experts.{e}.{proj}.weight")
        return out

    # ---- reading -------------------------------------------------------------------------
    def weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.banks["gate_up"][layer], self.banks["down"][layer]

    def bytes_per_expert(self) -> int:
        return self.fmt.bytes_per_expert(self.hidden, self.inter)

    def total_bytes(self) -> int:
        return self.bytes_per_expert() * self.num_experts * len(self.moe_layers)

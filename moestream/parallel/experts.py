"""Routed experts under tensor parallelism: every rank holds every expert, sliced by intermediate dim.

Rank r of n keeps rows [r*I/n, (r+1)*I/n) of each expert's gate and up and the matching columns of
down, so mlp_e(x) = sum over ranks of down_r(silu(gate_r x) * up_r x): each rank's expert output is a
partial sum, added to the shared expert's partial and reduced in the MoE block's one all-reduce.

Why by intermediate dimension and not by expert (expert parallelism):
- balanced whatever the routing: every rank does exactly 1/n of every routed expert's FLOPs, bytes,
  PCIe copies and CPU work, so the lockstep ranks finish together; with experts split between ranks
  a decode step's top-k lands unevenly and the rank owning the hot experts is the straggler;
- the same hit rate per byte: routing is identical on every rank, so each rank's slot cache holds the
  same experts (n times as many slots for the same VRAM) and every miss moves 1/n of an expert over
  each rank's own PCIe link in parallel, instead of a whole expert over one link;
- no all-to-all: activations are already replicated after the attention all-reduce, and the partial
  sums ride the all-reduce the block needs anyway.
The cost: n times narrower expert GEMMs, and compressed experts (GGUF blocks, FP8/NVFP4/MXFP4 parts)
can only be cut between quantization blocks, so I/n must be a multiple of the block (else ConfigError).
"""
from __future__ import annotations

import dataclasses

import torch

from ..core import ConfigError
from ..moe.formats import ExpertFormat, GGUFExpertFormat, HFExpertFormat
from ..moe.store import ExpertStore


def _part(fmt: ExpertFormat, array: str):
    """(projection, PartSpec, bytes per stored element) of one array of a compressed format."""
    if isinstance(fmt, GGUFExpertFormat):
        return array, fmt.quant(array).parts[0], 1
    if isinstance(fmt, HFExpertFormat):
        proj, name = array.split(".", 1)
        spec = next(p for p in fmt.qfmt.parts if p.name == name)
        return proj, spec, dict(fmt.parts)[array].itemsize
    raise ConfigError(f"tensor parallelism cannot split experts stored as {fmt.name}; use --moe-expert-format dense")


def check_expert_split(fmt: ExpertFormat, inter: int, n: int) -> None:
    """gate/up lose whole rows and down whole columns: each must fall between stored blocks."""
    if not fmt.quantized:
        return
    local = inter // n
    for array in fmt.shapes(fmt.hidden, inter):
        proj, spec, _ = _part(fmt, array)
        if spec.row_block is None:  # one value per tensor: replicated, nothing to cut
            continue
        block = spec.col_unit if proj == "down" else spec.row_block  # (col_unit None: one value per row)
        if block and local % block:
            raise ConfigError(f"--tp-size {n} splits each expert's intermediate size {inter} into {local}, not a "
                              f"multiple of the {block}-wide blocks of the {fmt.name} {proj}_proj; use a smaller "
                              f"--tp-size or --moe-expert-format dense")


class ShardedExpertStore(ExpertStore):
    """An ExpertStore of I/n per expert that slices incoming full-size tensors to its rank's part.
    Tensors that already have the rank's shape (random weights drawn per rank) are taken as they are."""

    def __init__(self, moe_layers, num_experts, hidden, inter, fmt, device, rank: int, size: int):
        check_expert_split(fmt, inter, size)
        local = inter // size
        self.full_fmt = fmt
        if fmt.quantized:
            fmt = dataclasses.replace(fmt, inter=local)
        super().__init__(moe_layers, num_experts, hidden, local, fmt, device)
        self.full_inter, self.rank, self.size = inter, rank, size
        self._part = slice(rank * local, (rank + 1) * local)

    def put_expert(self, layer, expert, proj, tensor, tensor_name):
        full = (self.hidden, self.full_inter) if proj == "down_proj" else (self.full_inter, self.hidden)
        if tuple(tensor.shape) == full:
            tensor = tensor[:, self._part] if proj == "down_proj" else tensor[self._part]
        super().put_expert(layer, expert, proj, tensor, tensor_name)

    def put_stacked(self, layer, name, tensor, tensor_name):
        I, H, E = self.full_inter, self.hidden, self.num_experts
        if not self.fmt.quantized and name == "gate_up" and tuple(tensor.shape) == (E, 2 * I, H):
            tensor = torch.cat([tensor[:, self._part], tensor[:, I:][:, self._part]], dim=1)
        elif not self.fmt.quantized and name == "down" and tuple(tensor.shape) == (E, H, I):
            tensor = tensor[:, :, self._part]
        super().put_stacked(layer, name, tensor, tensor_name)

    def put_raw(self, layer, name, tensor, tensor_name, expert=None, mapped=False):
        """mapped is ignored: a rank keeps a copy of its slice (the file's rows are not contiguous per rank)."""
        full = self.full_fmt.shapes(self.hidden, self.full_inter).get(name)
        count = 1 if expert is not None else self.num_experts
        if full is not None and tensor.dtype == torch.uint8 and tensor.numel() == count * full[0]:
            tensor = self._slice_raw(name, tensor.reshape(count, -1))
        super().put_raw(layer, name, tensor, tensor_name, expert)

    def _slice_raw(self, array: str, raw: torch.Tensor) -> torch.Tensor:
        """[n, bytes] of full experts -> [n, bytes] of this rank's rows (gate/up) or columns (down)."""
        proj, spec, size = _part(self.fmt, array)
        if spec.row_block is None:  # one value per tensor: every rank keeps it
            return raw.reshape(-1)
        I, H = self.full_inter, self.hidden
        n_rows, k = (H, I) if proj == "down" else (I, H)
        t = raw.reshape(raw.shape[0], -(-n_rows // spec.row_block), -1)
        r, local = self.rank, self.inter
        if proj != "down":
            t = t[:, r * local // spec.row_block:(r + 1) * local // spec.row_block]
        elif spec.col_unit is not None:  # (a per-row value, col_unit None, stays whole)
            step = local // spec.col_unit * spec.col_per_unit * size
            t = t[:, :, r * step:(r + 1) * step]
        return t.reshape(-1)

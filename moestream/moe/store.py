"""The master copy of every routed expert: one stacked tensor per (layer, array).

The loader hands expert tensors here (never to the model's state dict). Tensors may arrive one
expert at a time (`experts.N.gate_proj.weight`) or stacked (`experts.gate_up_proj`); either way the
store ends with gate_up [E, 2I, H] and down [E, H, I] per MoE layer on its home device. A quantized
format (moe/formats.py) has its own arrays instead, e.g. GGUF rows gate/up/down [E, nbytes] uint8, or
HF rows `gate.weight`, `gate.weight_scale_inv`, ... [E, nbytes] uint8, filled by `put_raw` with the
checkpoint's compressed bytes (all experts of an array at once, or one expert's).
"""
from __future__ import annotations

import logging
import weakref

import torch

from ..core import CheckpointError
from .formats import ExpertFormat

log = logging.getLogger("moestream.moe")
GiB = 1 << 30


class ExpertStore:
    def __init__(self, moe_layers: list[int], num_experts: int, hidden: int, inter: int, fmt: ExpertFormat,
                 device: torch.device | str, pin: bool = False):
        self.moe_layers = list(moe_layers)
        self.num_experts, self.hidden, self.inter, self.fmt = num_experts, hidden, inter, fmt
        self.file_fmt = fmt  # the checkpoint's layout (planning, the CPU's rates): fmt may be a GPU layout of it
        self.device = torch.device(device)
        specs = fmt.arrays(hidden, inter)
        self.banks: dict[str, dict[int, torch.Tensor]] = {name: {} for name in specs}
        for layer in self.moe_layers:  # each layer's bank in that layer's own format
            for name, (shape, dtype) in fmt.for_layer(layer).arrays(hidden, inter).items():
                bank = torch.empty((num_experts, *shape), dtype=dtype, device=self.device, pin_memory=pin)
                self.banks[name][layer] = advise_huge_pages(bank)
        # filled[name][layer] is a bool per expert (and per half of gate_up) so missing tensors are found.
        self._filled = {(name, layer): torch.zeros(num_experts, 2 if name == "gate_up" else 1, dtype=torch.bool)
                        for name in specs for layer in self.moe_layers}
        # banks that are views of the checkpoint file's read-only mapping (put_raw(mapped=True)) -> bytes
        self._mapped: dict[tuple[str, int], int] = {}

    # ---- filling -------------------------------------------------------------------------
    def put_stacked(self, layer: int, name: str, tensor: torch.Tensor, tensor_name: str) -> None:
        bank = self._bank(layer, name, tensor_name)
        if tuple(tensor.shape) != tuple(bank.shape):
            raise CheckpointError(f"tensor {tensor_name} has shape {tuple(tensor.shape)}, expected {tuple(bank.shape)}")
        if bank.dtype == torch.uint8 and tensor.dtype != torch.uint8:
            raise CheckpointError(f"tensor {tensor_name} has dtype {tensor.dtype}; the {self.fmt.name} expert "
                                  f"format stores its raw bytes (uint8)")
        bank.copy_(tensor)
        self._filled[(name, layer)][:] = True

    def put_raw(self, layer: int, name: str, tensor: torch.Tensor, tensor_name: str, expert: int | None = None,
                mapped: bool = False) -> None:
        """Compressed bytes (uint8, any shape) of one array: of all experts (E * nbytes), or of `expert` (nbytes).
        mapped: `tensor` is a contiguous view of a read-only file mapping that lives as long as it does (a GGUF
        expert tensor): a host store keeps the view as the bank instead of copying the bytes."""
        bank = self._bank(layer, name, tensor_name)
        if expert is not None:
            self._check_expert(expert, tensor_name)
        want = bank[0].numel() if expert is not None else bank.numel()
        if tensor.dtype != torch.uint8 or tensor.numel() != want:
            of = f"expert {expert}" if expert is not None else f"{self.num_experts} experts x {bank.shape[1]}"
            raise CheckpointError(f"tensor {tensor_name} holds {tensor.numel()} {tensor.dtype} elements; the "
                                  f"{self.fmt.name} bank {name} expects {want} bytes ({of})")
        if expert is None and mapped and self.device.type == "cpu" and tensor.is_contiguous():
            self.banks[name][layer] = tensor.view(bank.shape)  # the empty bank was never touched: nothing resident
            self._mapped[(name, layer)] = tensor.numel()
            self._filled[(name, layer)][:] = True
            return
        if expert is None:
            self.put_stacked(layer, name, tensor.reshape(bank.shape), tensor_name)
            return
        bank[expert].copy_(tensor.reshape(-1))
        self._filled[(name, layer)][expert] = True

    def put_expert(self, layer: int, expert: int, proj: str, tensor: torch.Tensor, tensor_name: str) -> None:
        """proj is gate_proj, up_proj or down_proj of one expert."""
        self._check_expert(expert, tensor_name)
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

    def _check_expert(self, expert: int, tensor_name: str) -> None:
        if not 0 <= expert < self.num_experts:
            raise CheckpointError(f"tensor {tensor_name}: expert {expert} is out of range (num_experts {self.num_experts})")

    def _bank(self, layer: int, name: str, tensor_name: str) -> torch.Tensor:
        if name not in self.banks:
            raise CheckpointError(f"tensor {tensor_name}: the {self.fmt.name} expert format has no array {name!r} "
                                  f"(arrays: {', '.join(self.banks)})")
        if layer not in self.banks[name]:
            raise CheckpointError(f"unexpected tensor {tensor_name}: layer {layer} has no routed experts")
        if self._mapped.pop((name, layer), None) is not None:  # written to: a copy of its own, not the file's pages
            self.banks[name][layer] = self.banks[name][layer].clone()
        return self.banks[name][layer]

    def mapped_ptrs(self) -> set[int]:
        """Addresses of the banks that are views of the checkpoint file's mapping."""
        return {self.banks[name][layer].data_ptr() for name, layer in self._mapped}

    @property
    def mapped_bytes(self) -> int:
        """Bytes of the banks that are the checkpoint file's mapped pages (not copied)."""
        return sum(self._mapped.values())

    def missing(self, prefix_of) -> list[str]:
        """Names of expert tensors never filled; prefix_of(layer) gives the checkpoint's layer prefix."""
        out = []
        for (name, layer), f in self._filled.items():
            for e in (~f).any(-1).nonzero().flatten().tolist():
                if name != "gate_up":
                    out.append(f"{prefix_of(layer)}mlp.experts.{e}.{self.fmt.tensor_name(name)}")
                else:
                    for half, proj in enumerate(("gate_proj", "up_proj")):
                        if not f[e, half]:
                            out.append(f"{prefix_of(layer)}mlp.experts.{e}.{proj}.weight")
        return out

    # ---- reading -------------------------------------------------------------------------
    def weights(self, layer: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """gate_up [E, 2I, H], down [E, H, I] of one layer (quantized formats: dequantized to dtype)."""
        if not self.fmt.quantized:
            return self.banks["gate_up"][layer], self.banks["down"][layer]
        bank = self.bank(layer)
        pairs = [self.fmt.for_layer(layer).dense({n: b[e] for n, b in bank.items()}, dtype) for e in range(self.num_experts)]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    def bank(self, layer: int) -> dict[str, torch.Tensor]:
        """name -> [E, ...] tensor of one layer (a WeightRef bank)."""
        return {name: per_layer[layer] for name, per_layer in self.banks.items()}

    def layer_bytes(self, layer: int | None = None) -> int:
        """Bytes of one layer's experts (layer None: the largest layer)."""
        return self.bytes_per_expert(layer) * self.num_experts

    # ---- pinning ---------------------------------------------------------------------------
    def pin_host(self, budget_bytes: int) -> dict:
        """Page-lock host banks, whole layers in order, up to budget_bytes (after filling, so no
        zero-fill pass and no power-of-two rounding). Pinned rows copy asynchronously at full PCIe
        speed; the rest stay pageable. Returns {"pinned_bytes", "pageable_bytes", "pinned_layers"}."""
        if self.device.type != "cpu" or not torch.cuda.is_available():
            return {"pinned_bytes": 0, "pageable_bytes": self.total_bytes(), "pinned_layers": 0}
        from .hardware import release_pages  # (hardware -> planner -> runtime -> store)

        pinned, layers, ptrs = 0, 0, []
        for layer in self.moe_layers:
            if pinned + self.layer_bytes(layer) > budget_bytes:
                break
            for name, per_layer in self.banks.items():
                # a mapped bank is read-only file memory: page-locked as a copy (cudaHostRegister writes)
                in_place = self._mapped.pop((name, layer), None) is None
                src = per_layer[layer]
                per_layer[layer] = _page_lock(src, ptrs, in_place)
                if not in_place:  # the file's pages no longer count in this process's RSS
                    release_pages(src.data_ptr(), src.numel())
            pinned += self.layer_bytes(layer)
            layers += 1
        if ptrs:
            self._registered = ptrs  # unregistered when a bank leaves (moved_to) or the store dies
            weakref.finalize(self, _unregister, ptrs)
        rest = self.total_bytes() - pinned
        if rest:
            log.warning("%.2f GiB of experts (%d of %d layers) stay in pageable host memory (pin budget %.2f GiB): "
                        "misses from them copy synchronously at roughly half the pinned PCIe speed; raise "
                        "--pin-budget-gb or free host RAM to pin them", rest / GiB, len(self.moe_layers) - layers,
                        len(self.moe_layers), budget_bytes / GiB)
        return {"pinned_bytes": pinned, "pageable_bytes": rest, "pinned_layers": layers}

    def moved_to(self, device: torch.device | str) -> "ExpertStore":
        """A copy of this store on another device, bank by bank (the source banks are released as they
        are copied, so peak memory grows by one bank, not by a whole second store)."""
        out = ExpertStore.__new__(ExpertStore)
        out.__dict__.update(self.__dict__)
        out.device = torch.device(device)
        out.banks = {name: {} for name in self.banks}
        out._registered = []
        out._mapped = {}
        registered = getattr(self, "_registered", [])
        for name, layers in self.banks.items():
            for layer in list(layers):
                src = layers.pop(layer)
                if out.device.type == "cpu":  # advised before the copy writes its pages
                    dst = advise_huge_pages(torch.empty(src.shape, dtype=src.dtype))
                    out.banks[name][layer] = dst.copy_(src)
                else:
                    out.banks[name][layer] = src.to(out.device)
                if src.data_ptr() in registered:  # unlock before the memory is freed and maybe reused
                    registered.remove(src.data_ptr())
                    _unregister([src.data_ptr()])
                del src
        return out

    def set_q8_layout(self, planar: bool) -> bool:
        """Q8_0 expert arrays row-planar (Q8_0R: quant/gguf_formats.RowPlanarQ8, what the GPU pair kernels read
        fastest) or back in the file's layout (what the CPU kernels read), rewritten in place bank by bank (a bounded
        temporary; a bank mapped from the file becomes a copy of its own first); the format follows. Returns whether
        anything changed. Per-layer type mixes keep their layout."""
        from ..quant.gguf_formats import q8_0_row_planar
        from .formats import GGUFExpertFormat, gguf_expert_format

        if type(self.fmt) is not GGUFExpertFormat:
            return False
        src, dst = ("Q8_0", "Q8_0R") if planar else ("Q8_0R", "Q8_0")
        types = dict(self.fmt.types)
        names = [name for name, t in types.items() if t == src]
        if not names:
            return False
        for name in names:
            k = self.fmt.logical(self.hidden, self.inter)[name][1]
            for layer in self.moe_layers:
                bank = self._bank(layer, name, name)  # (a mapped bank: cloned)
                q8_0_row_planar(bank, k, planar)
        self.fmt = gguf_expert_format({n: dst if n in names else t for n, t in types.items()}, self.hidden,
                                      self.inter)
        log.debug("expert store: %s experts %s", "/".join(names), "row-planar (Q8_0R)" if planar else "as stored")
        return True

    def bytes_per_expert(self, layer: int | None = None) -> int:
        """Bytes of one expert of `layer`; None: of a slot row (the largest layer's, for per-layer types)."""
        fmt = self.fmt if layer is None else self.fmt.for_layer(layer)
        return fmt.bytes_per_expert(self.hidden, self.inter)

    def total_bytes(self) -> int:
        return sum(self.layer_bytes(layer) for layer in self.moe_layers)


HUGE_PAGE = 2 << 20


def advise_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """Ask Linux for transparent huge pages under a host tensor not yet written (madvise MADV_HUGEPAGE on
    its whole 2 MiB pages), so the CPU expert kernels stream through 2 MiB pages: where THP is `madvise`
    (the common default) a bank is otherwise 4 KiB pages, one TLB miss and one hardware-prefetch stop
    every 4 KiB (benchmarks/cpu_layer_diag.py measures both). A no-op on other devices, small tensors,
    other systems, or when the kernel refuses."""
    from .hardware import MADV_HUGEPAGE, madvise  # (hardware -> planner -> runtime -> store)

    if t.device.type == "cpu" and not t.is_pinned():
        madvise(t.data_ptr(), t.numel() * t.element_size(), MADV_HUGEPAGE, HUGE_PAGE)
    return t


def _page_lock(t: torch.Tensor, registered: list[int], in_place: bool = True) -> torch.Tensor:
    """cudaHostRegister the tensor's memory in place (in_place False: a read-only mapping's bytes are first copied
    into memory of exactly their size, then registered); a pinned copy where registering fails. Never
    `Tensor.pin_memory()` first: torch's pinned host allocator rounds every block up to a power of two, so each
    144-210 MiB bank of a Q4_K_M layer took 256 MiB of page-locked RAM (the Qwen3.6-shaped GGUF's 18.2 GiB of
    banks held 30 GiB: host RSS at load, H100 host, 2026-12-05)."""
    t = t.contiguous()
    if not in_place:
        t = torch.empty(t.shape, dtype=t.dtype).copy_(t)
    try:
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        if int(err) == 0:
            registered.append(t.data_ptr())
            return t
    except (AttributeError, RuntimeError):
        pass
    return t.pin_memory()


def page_locked_zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    """Zeros in page-locked host memory of exactly their size (cudaHostRegister, unregistered when the tensor is
    collected; torch's pinned allocator, whose blocks are powers of two, only where registering fails)."""
    ptrs: list[int] = []
    t = _page_lock(torch.zeros(shape, dtype=dtype), ptrs)
    if ptrs:
        weakref.finalize(t, _unregister, ptrs)
    return t


def _unregister(ptrs: list[int]) -> None:
    for p in ptrs:
        try:
            torch.cuda.cudart().cudaHostUnregister(p)
        except Exception:  # interpreter shutdown: the process is going away anyway
            pass

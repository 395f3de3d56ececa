"""An embedding table kept in page-locked host memory instead of VRAM.

A decode step reads one row of the table per token (4 KB for Qwen3.6's 2,048 bf16 values), yet a GPU-resident table
holds the whole vocabulary: 0.58 GiB of bf16 for Qwen3.6-35B-A3B's 151,936 rows — ~95 bf16 experts' worth of slots
on a capped card, and more than a 4 GB card can spare beside an FP8 checkpoint's dense layers. `HostEmbedding` keeps
the table pinned in host RAM and gathers the rows of a step's token ids with one Triton kernel that reads host memory
over PCIe (zero-copy, as the expert staging kernel reads the pinned banks): the launch has fixed pointers, so a decode
step that contains it is still recorded as a CUDA graph. On a CPU it is an index_select. The engine places the table
there (Engine._host_embedding) where the experts do not all fit in VRAM, after a self-check of the kernel against the
table's own rows; MOESTREAM_HOST_EMBEDDING=0 keeps every table on the device.
"""
from __future__ import annotations

import torch
from torch import nn

try:  # optional: absent on CPU-only installs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


class HostEmbedding(nn.Module):
    """nn.Embedding whose weight [num_embeddings, dim] lives in page-locked host memory (`host`: a plain attribute,
    neither parameter nor buffer, so `Module.to(device)` leaves it where it is and the memory plan does not count it
    as device bytes); outputs go to `device`."""

    def __init__(self, weight: torch.Tensor, device: torch.device | str):
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.device = torch.device(device)
        w = weight.detach().to("cpu").contiguous()
        self.host = w.pin_memory() if self.device.type == "cuda" else w

    @property
    def dtype(self) -> torch.dtype:
        return self.host.dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if flat.is_cuda:
            out = gather_rows(self.host, flat)
        else:
            out = self.host.index_select(0, flat.to(self.host.device)).to(self.device)
        return out.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, host memory ({self.host.dtype})"


def available() -> bool:
    """Whether the device gather kernel can run (triton imported and the Triton kernels on)."""
    from ..env import triton_enabled

    return triton is not None and triton_enabled()


def gather_rows(table: torch.Tensor, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out [n, D] (table's dtype, on ids' device) = table[ids] with table [V, D] anywhere the kernel can read it
    (pinned host memory, or the device); one launch, no host synchronisation. Under TRITON_INTERPRET=1 on CPU tensors
    in the tests."""
    n, D = ids.shape[0], table.shape[1]
    if out is None:
        out = torch.empty((n, D), dtype=table.dtype, device=ids.device)
    if n:
        block = min(1024, triton.next_power_of_2(D))
        _gather_rows_kernel[(n, triton.cdiv(D, block))](table, ids, out, D, table.stride(0), BLOCK=block)
    return out


if triton is not None:

    @triton.jit
    def _gather_rows_kernel(table, ids, out, D, stride, BLOCK: tl.constexpr):
        """Program (r, c): columns c * BLOCK.. of row ids[r] of the table into row r of out."""
        r = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < D
        i = tl.load(ids + r).to(tl.int64)
        v = tl.load(table + i * stride + cols, mask=m)
        tl.store(out + r.to(tl.int64) * D + cols, v, mask=m)

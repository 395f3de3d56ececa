"""Dense layers that keep a GGUF checkpoint's weights compressed.

``QuantLinear`` holds a weight's GGUF bytes ([out_features, row_bytes]) and computes
- on a CPU through ``quant.qlinear``: the compiled CPU kernel for a few rows (decode), row tiles + float32
  GEMM for many (prefill);
- on a GPU, up to ``GPU_GEMV_ROWS`` rows (decode), through ``moe.qpairs.quant_linear``: the Triton pair
  kernel that decodes the blocks in registers (fp32 accumulation, capturable in a CUDA graph); more rows
  (prefill) decode the whole weight once per call (Triton) and run one GEMM.
``FusedQuantLinear`` is projections of one type concatenated by rows (models/fuse.py), split by views.
``QuantEmbedding`` gathers the rows of the token ids and dequantizes only those. A decode step then reads
the weights' compressed bytes, as llama.cpp does, instead of 16/32-bit copies 2-8x larger, and a GPU holds
the compressed bytes only.
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernels import cpu_quant
from ..quant import gguf_format, qlinear
from ..quant.base import CPU_FLOAT_KERNEL_MAX_ROWS, FLOAT_KERNEL_TYPES

GPU_GEMV_ROWS = 16  # up to this many rows a GPU reads the blocks in the GEMV kernel; more: dequantize + GEMM


class QuantLinear(nn.Module):
    """y = x @ W.T with W kept as GGUF bytes of type ``type_name`` (no bias). float_activations (Q8_0 only): the
    CPU decode kernel multiplies float32 activations instead of rounding them to int8 (a vocabulary head)."""

    def __init__(self, type_name: str, raw: torch.Tensor, out_features: int, in_features: int,
                 float_activations: bool = False):
        super().__init__()
        assert not float_activations or type_name == "Q8_0", type_name
        self.float_activations = float_activations
        self.fmt = gguf_format(type_name)
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("raw", raw.reshape(out_features, -1).contiguous().view(torch.uint8), persistent=False)
        self.type_id = cpu_quant.TYPES.get(type_name)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # CPU: straight to the kernel (qlinear's dispatch costs as much as a small matmul); any row count for the
        # int8-activation kernels, a few rows for the float-activation ones (F16 / BF16 rows, the Q8_0 head)
        few = x.numel() <= CPU_FLOAT_KERNEL_MAX_ROWS * self.in_features
        if (self.type_id is not None and x.dtype == torch.float32 and x.is_contiguous() and x.device.type == "cpu"
                and (few or not (self.float_activations or self.fmt.type_name in FLOAT_KERNEL_TYPES))
                and self.raw.device.type == "cpu" and cpu_quant.available()):
            rows = cpu_quant.q8_0_float_matmul if self.float_activations else cpu_quant.rows_matmul
            y = rows(x.view(-1, self.in_features), self.raw, self.type_id)
            return y.view(*x.shape[:-1], self.out_features)
        if x.is_cuda and x.numel() <= GPU_GEMV_ROWS * self.in_features and gpu_gemv(self.fmt):
            from ..moe.qpairs import quant_linear

            return quant_linear(x, self.fmt, self.raw, self.shape)
        return qlinear(x, self.fmt, self.raw, self.shape)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a dense [out_features, in_features] tensor (models/fuse.py densifies a mixed group)."""
        return self.fmt.dequantize(self.raw, self.shape, dtype)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.fmt.name}"


class FusedQuantLinear(QuantLinear):
    """QuantLinear whose output rows are the concatenated outputs of `sizes[i]`-row projections of one GGUF
    type (their byte rows concatenated): one kernel launch for the group."""

    def __init__(self, type_name: str, raw: torch.Tensor, sizes: tuple[int, ...], in_features: int):
        super().__init__(type_name, raw, sum(sizes), in_features)  # int8 activations
        self.sizes = tuple(sizes)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(y, self.sizes, dim=-1)


def gpu_gemv(fmt) -> bool:
    """Whether the GPU decode kernel reads this GGUF type (the Triton pair kernels' types)."""
    from ..env import triton_enabled
    from ..moe.qpairs import linear_supported

    return triton_enabled() and linear_supported(fmt)


class QuantEmbedding(nn.Module):
    """Embedding rows dequantized from GGUF bytes at lookup (``dtype``: the model's)."""

    def __init__(self, type_name: str, raw: torch.Tensor, num_embeddings: int, dim: int, dtype: torch.dtype):
        super().__init__()
        self.fmt = gguf_format(type_name)
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, dim, dtype
        self.type_id = cpu_quant.TYPES.get(type_name)
        self.register_buffer("raw", raw.reshape(num_embeddings, -1), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = None
        if self.type_id is not None and self.raw.device.type == "cpu" and cpu_quant.cpu_kernels_enabled():
            rows = cpu_quant.dequant_rows(self.raw, self.type_id, ids, self.embedding_dim)  # one C call
        if rows is None:
            shape = (self.num_embeddings, self.embedding_dim)
            rows = self.fmt.dequantize_rows(self.raw, shape, ids.reshape(-1), torch.float32)
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

"""Dense layers that keep a GGUF checkpoint's weights compressed (CPU-only runs).

``QuantLinear`` holds a weight's GGUF bytes ([out_features, row_bytes]) and computes through
``quant.qlinear``: the compiled CPU kernel for a few rows (decode), row tiles + float32 GEMM for many
(prefill). ``QuantEmbedding`` gathers the rows of the token ids and dequantizes only those. A decode
step then reads the weights' compressed bytes, as llama.cpp does, instead of float32 copies 4-8x larger.
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernels import cpu_quant
from ..quant import gguf_format, qlinear
from ..quant.base import CPU_KERNEL_MAX_ROWS


class QuantLinear(nn.Module):
    """y = x @ W.T with W kept as GGUF bytes of type ``type_name`` (no bias)."""

    def __init__(self, type_name: str, raw: torch.Tensor, out_features: int, in_features: int):
        super().__init__()
        self.fmt = gguf_format(type_name)
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("raw", raw.reshape(out_features, -1).contiguous().view(torch.uint8), persistent=False)
        self.type_id = cpu_quant.TYPES.get(type_name)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # decode steps: straight to the kernel (qlinear's dispatch costs as much as a small matmul)
        if (self.type_id is not None and x.dtype == torch.float32 and x.is_contiguous() and x.device.type == "cpu"
                and x.numel() <= CPU_KERNEL_MAX_ROWS * self.in_features and self.raw.device.type == "cpu"
                and cpu_quant.available()):
            y = cpu_quant.rows_matmul(x.view(-1, self.in_features), self.raw, self.type_id)
            return y.view(*x.shape[:-1], self.out_features)
        return qlinear(x, self.fmt, self.raw, self.shape)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.fmt.name}"


class QuantEmbedding(nn.Module):
    """Embedding rows dequantized from GGUF bytes at lookup (``dtype``: the model's)."""

    def __init__(self, type_name: str, raw: torch.Tensor, num_embeddings: int, dim: int, dtype: torch.dtype):
        super().__init__()
        self.fmt = gguf_format(type_name)
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, dim, dtype
        self.register_buffer("raw", raw.reshape(num_embeddings, -1), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        shape = (self.num_embeddings, self.embedding_dim)
        rows = self.fmt.dequantize_rows(self.raw, shape, ids.reshape(-1), self.dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)

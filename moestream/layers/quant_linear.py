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
from ..quant.base import CPU_FLOAT_KERNEL_MAX_ROWS, FLOAT_KERNEL_TYPES, gpu_tile_rows

GPU_GEMV_ROWS = 16  # up to this many rows a GPU reads the blocks in the GEMV kernel; more: dequantize + GEMM


class QuantLinear(nn.Module):
    """y = x @ W.T with W kept as GGUF bytes of type ``type_name`` (no bias). float_activations (Q8_0 / Q6_K): the
    CPU decode kernel multiplies float32 activations instead of rounding them to int8 (a vocabulary head).
    in_perm [in_features] (optional): the stored columns are the model's in another order, stored column c being
    the model's column in_perm[c]; x is gathered to the stored order first (y = x[..., in_perm] @ stored.T). A
    Qwen3.6 GGUF's Gated DeltaNet out_proj: its value heads are in the file's tiled order and a head's 128
    columns are half a 256-value K-quant block, so the bytes cannot be reordered as the model's rows are."""

    # (array, address, type id, bytes per row) of an 8-row interleaved copy of raw (Q4_K / Q4_0 / Q4_1 / Q6_K) that the CPU
    # decode plan made (models/cpu_decode._weight); the CPU path reads it instead of raw, for any row count
    x8: tuple | None = None

    def __init__(self, type_name: str, raw: torch.Tensor, out_features: int, in_features: int,
                 float_activations: bool = False, in_perm: torch.Tensor | None = None):
        super().__init__()
        assert not float_activations or type_name in cpu_quant.FLOAT_ACT_TYPES, type_name
        self.float_activations = float_activations
        self.fmt = gguf_format(type_name)
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("raw", raw.reshape(out_features, -1).contiguous().view(torch.uint8), persistent=False)
        self.type_id = cpu_quant.TYPES.get(type_name)
        if in_perm is not None:
            in_perm = torch.as_tensor(in_perm, dtype=torch.long).reshape(-1)
            if in_perm.numel() != in_features or not torch.equal(torch.sort(in_perm).values,
                                                                 torch.arange(in_features)):
                raise ValueError(f"in_perm must be a permutation of {in_features} columns")
        self.register_buffer("in_perm", in_perm, persistent=False)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    # the GGUF type whose quant/planar.py layout replaced raw (to_planar), its parts the buffers "pl_<part>"
    planar: str | None = None

    def to_planar(self) -> bool:
        """The weight moved to quant/planar.py's layout for its type (before the model goes to a GPU: the GEMV then
        reads codes with 16-byte loads); raw is released. False (nothing changed) for a type without one, a matrix
        planar.wanted does not take (by default: all but the wide Q8_0 / Q6_K ones) or a layout already moved."""
        from ..quant import planar

        name = self.fmt.type_name
        if name not in planar.TYPES or not planar.wanted(name, self.out_features) or self.planar is not None \
                or self.raw.numel() == 0:
            return False
        for part, t in planar.repack(name, self.raw, self.out_features, self.in_features).items():
            self.register_buffer(f"pl_{part}", t, persistent=False)
        self.planar = name
        self.raw = torch.empty(0, dtype=torch.uint8, device=self.raw.device)
        return True

    def planar_parts(self) -> dict[str, torch.Tensor]:
        return {k[3:]: b for k, b in self._buffers.items() if k.startswith("pl_")}

    def _planar_forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..quant import planar

        N, K = self.shape
        parts = self.planar_parts()
        if x.is_cuda and x.numel() <= GPU_GEMV_ROWS * K:
            return planar.linear(self.planar, x, parts, N, K, self.in_perm)
        if self.in_perm is not None:
            x = x.index_select(-1, self.in_perm)
        if not x.is_cuda:  # (a model moved back to a CPU)
            return torch.nn.functional.linear(x, planar.dense_torch(self.planar, parts, N, K).to(x.dtype))
        # many rows: the matrix decoded a tile of rows at a time, each tile one GEMM (a vocabulary head's dense bf16
        # would be 0.6-1 GB at once: quant.base.gpu_tile_rows, as the block layout's qlinear tiles it)
        step = gpu_tile_rows(K, N, x.element_size())
        if step >= N:
            return torch.nn.functional.linear(x, planar.dense(self.planar, parts, N, K, x.dtype))
        y = torch.empty((*x.shape[:-1], N), dtype=x.dtype, device=x.device)
        for n0 in range(0, N, step):
            n1 = min(N, n0 + step)
            tile = planar.dense(self.planar, {k: v[n0:n1] for k, v in parts.items()}, n1 - n0, K, x.dtype)
            y[..., n0:n1] = torch.nn.functional.linear(x, tile)
        return y

    # MOESTREAM_QLINEAR_REPACK=1 (an experiment): a GPU's Q4_K weight in moe.qpairs.repack_q4k's layout, which then
    # replaces raw (148 bytes per 256 values instead of 144)
    packed: dict | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.planar is not None:
            return self._planar_forward(x)
        if self.packed is not None:
            return self._packed_forward(x)
        if x.is_cuda and x.numel() <= GPU_GEMV_ROWS * self.in_features and gpu_gemv(self.fmt):
            from ..moe.qpairs import quant_linear, repack_wanted

            if self.fmt.type_name == "Q4_K" and self.in_perm is None and repack_wanted() \
                    and not torch.cuda.is_current_stream_capturing():
                return self.repack()._packed_forward(x)
            # the permutation, if any, read inside the kernel (no gather launch: 30 a Qwen3.6 decode step)
            return quant_linear(x, self.fmt, self.raw, self.shape, self.in_perm)
        if self.in_perm is not None:
            x = x.index_select(-1, self.in_perm)
        # CPU: straight to the kernel (qlinear's dispatch costs as much as a small matmul); any row count for the
        # int8-activation kernels, a few rows for the float-activation ones (F16 / BF16 rows, a Q8_0 / Q6_K head)
        few = x.numel() <= CPU_FLOAT_KERNEL_MAX_ROWS * self.in_features
        if (self.type_id is not None and x.dtype == torch.float32 and x.is_contiguous() and x.device.type == "cpu"
                and (few or not (self.float_activations or self.fmt.type_name in FLOAT_KERNEL_TYPES))
                and self.raw.device.type == "cpu" and cpu_quant.available()):
            if self.x8 is not None:
                _, addr, tid, rb = self.x8
                y = cpu_quant.x8_matmul(x.view(-1, self.in_features), addr, self.out_features, rb, tid)
                return y.view(*x.shape[:-1], self.out_features)
            rows = cpu_quant.float_act_matmul if self.float_activations else cpu_quant.rows_matmul
            y = rows(x.view(-1, self.in_features), self.raw, self.type_id)
            return y.view(*x.shape[:-1], self.out_features)
        return qlinear(x, self.fmt, self.raw, self.shape)

    def repack(self) -> "QuantLinear":
        """Q4_K on a GPU: the weight moved to the repacked layout (its decode GEMV and a prefill's dense operand read
        it); raw is released. The values are the stored ones exactly."""
        from ..moe.qpairs import repack_q4k

        self.packed = repack_q4k(self.raw, self.out_features, self.in_features)
        self.raw = torch.empty(0, dtype=torch.uint8, device=self.raw.device)
        return self

    def _packed_forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..moe.qpairs import q4k_repacked_dense, q4k_repacked_linear

        N, K = self.shape
        if x.numel() <= GPU_GEMV_ROWS * K:
            return q4k_repacked_linear(x, self.packed, N, K)
        return torch.nn.functional.linear(x, q4k_repacked_dense(self.packed, N, K, x.dtype))

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a dense [out_features, in_features] tensor (models/fuse.py densifies a mixed group), in
        the model's column order."""
        if self.planar is not None:
            from ..quant import planar

            w = planar.dense_torch(self.planar, self.planar_parts(), *self.shape).to(dtype)
        else:
            w = self.fmt.dequantize(self.raw, self.shape, dtype)
        if self.in_perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.in_perm] = w
        return out

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.fmt.name}" + (
            ", input columns permuted" if self.in_perm is not None else "")


def to_planar(model: nn.Module) -> int:
    """Every QuantLinear of `model` whose type has a quant/planar.py layout (MOESTREAM_PLANAR) moved there: a model
    bound for a GPU, while it is still in host memory (the device then receives the final tensors only). Returns how
    many moved."""
    return sum(m.to_planar() for m in model.modules() if isinstance(m, QuantLinear))


class FusedQuantLinear(QuantLinear):
    """QuantLinear whose output rows are the concatenated outputs of `sizes[i]`-row projections of one GGUF
    type (their byte rows concatenated): one kernel launch for the group."""

    def __init__(self, type_name: str, raw: torch.Tensor, sizes: tuple[int, ...], in_features: int):
        super().__init__(type_name, raw, sum(sizes), in_features)  # int8 activations
        self.sizes = tuple(sizes)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(y, self.sizes, dim=-1)


class HFQuantLinear(nn.Module):
    """y = x @ W.T with W kept in an HF safetensors quantization (FP8 e4m3 with 128 x 128 block, per-row or per-tensor
    scales; NVFP4; MXFP4): `raw` holds the element codes [out_features, bytes] (uint8), `raw_scale` the scales as
    stored, `raw_scale2` NVFP4's global scale. Decode rows on a GPU go through the HF pair "down" kernel of
    moe/qpairs.py (codes decoded in registers, fp32 accumulation, capturable in a CUDA graph); other row counts and
    devices through quant.qlinear (a GPU decodes the weight once per call and runs one GEMM; a CPU its compiled FP8 /
    FP4 kernels or row tiles). The weight is held at its stored size: FP8 dense layers of a Qwen3.6-35B-A3B-shaped
    checkpoint are 1.4 GB instead of 2.9 GB of bf16."""

    def __init__(self, qfmt, parts: dict, out_features: int, in_features: int):
        super().__init__()
        self.qfmt, self.in_features, self.out_features = qfmt, in_features, out_features
        names = [p.name for p in qfmt.parts]
        self.part_names = tuple(names)
        self.dtypes = {n: parts[n].dtype for n in names}
        codes = parts[names[0]]
        codes = codes.view(torch.uint8) if codes.dtype != torch.uint8 and codes.element_size() == 1 else codes
        self.register_buffer("raw", codes.reshape(out_features, -1).contiguous(), persistent=False)
        self.register_buffer("raw_scale", parts[names[1]].contiguous(), persistent=False)
        self.register_buffer("raw_scale2", parts[names[2]].contiguous() if len(names) > 2 else None,
                             persistent=False)
        self._efmt = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def parts(self) -> dict:
        """The weight's parts by the format's names, as quant.qlinear / QuantFormat.dequantize read them."""
        out = {self.part_names[0]: self.raw, self.part_names[1]: self.raw_scale}
        if self.raw_scale2 is not None:
            out[self.part_names[2]] = self.raw_scale2
        return out

    def _pool(self) -> dict:
        """{"down.<part>": uint8 [1, bytes]}: the pair kernel's one expert row of each part."""
        return {f"down.{n}": t.reshape(1, -1).view(torch.uint8) for n, t in self.parts().items()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.numel() <= GPU_GEMV_ROWS * self.in_features and hf_gpu_gemv(self.qfmt):
            from ..moe.qpairs import hf_linear_format, hf_quant_linear

            if self._efmt is None:
                self._efmt = hf_linear_format(self.qfmt, self.dtypes, self.out_features, self.in_features)
            return hf_quant_linear(x, self._efmt, self._pool(), self.shape)
        return qlinear(x, self.qfmt, self.parts(), self.shape)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        return self.qfmt.dequantize(self.parts(), self.shape, dtype)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.qfmt.name}"


def hf_gpu_gemv(qfmt) -> bool:
    """Whether the GPU decode kernel reads this HF format (FP8, NVFP4, MXFP4: the HF pair kernels')."""
    from ..env import triton_enabled
    from ..quant.fp_formats import FP8Format, MXFP4Format, NVFP4Format

    from ..moe import qpairs

    return qpairs.triton is not None and triton_enabled() and isinstance(qfmt, (FP8Format, NVFP4Format, MXFP4Format))


def gpu_gemv(fmt) -> bool:
    """Whether the GPU decode kernel reads this GGUF type (the Triton pair kernels' types)."""
    from ..env import triton_enabled
    from ..moe.qpairs import linear_supported

    return triton_enabled() and linear_supported(fmt)


class QuantEmbedding(nn.Module):
    """Embedding rows dequantized from GGUF bytes at lookup (``dtype``: the model's): the compiled CPU kernel, or
    on a GPU the Triton decoder of quant/triton_dequant.py (the Qwen3.6 vocabulary's 151,936 rows: 0.16 GiB as
    Q4_K against 0.58 GiB of bf16)."""

    def __init__(self, type_name: str, raw: torch.Tensor, num_embeddings: int, dim: int, dtype: torch.dtype):
        super().__init__()
        self.fmt = gguf_format(type_name)
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, dim, dtype
        self.type_id = cpu_quant.TYPES.get(type_name)
        self.register_buffer("raw", raw.reshape(num_embeddings, -1), persistent=False)

    # the stored rows in page-locked host memory instead of `raw` (to_host: the engine's choice where VRAM is short);
    # a step's rows are then gathered and decoded on the device, reading the table over PCIe (zero-copy)
    host: torch.Tensor | None = None

    def to_host(self, device: torch.device | str) -> None:
        """Keep the table in (pinned, for a CUDA `device`) host memory: `raw` is released, so moving the module to a
        device moves none of it; lookups with ids on `device` decode the rows there (triton_dequant.gguf_rows_to)."""
        raw = self.raw.detach().to("cpu").contiguous()
        self.host = raw.pin_memory() if torch.device(device).type == "cuda" else raw
        self.raw = torch.empty(0, dtype=torch.uint8)

    def from_host(self) -> None:
        """Undo to_host: the table is `raw` again (moved with the module)."""
        self.raw, self.host = self.host, None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.host is not None:
            if ids.device.type != "cpu":
                from ..quant import triton_dequant

                rows = triton_dequant.gguf_rows_to(self.fmt, self.host, ids, torch.float32)
            else:
                rows = self._rows(self.host, ids)
            return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)
        return self._rows(self.raw, ids).to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def _rows(self, raw: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        rows = None
        if self.type_id is not None and raw.device.type == "cpu" and cpu_quant.cpu_kernels_enabled():
            rows = cpu_quant.dequant_rows(raw, self.type_id, ids, self.embedding_dim)  # one C call
        shape = (self.num_embeddings, self.embedding_dim)
        if rows is None and raw.is_cuda:
            from ..quant import triton_dequant

            if triton_dequant.supports(self.fmt):  # one Triton launch (capturable in a decode graph)
                rows = triton_dequant.dequantize_rows(self.fmt, raw, shape, ids.reshape(-1), torch.float32)
        if rows is None:
            rows = self.fmt.dequantize_rows(raw, shape, ids.reshape(-1), torch.float32)
        return rows

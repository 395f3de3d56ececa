"""Core of moestream.quant: the QuantFormat base class, the registry, and tile-wise helpers.

Model of a quantized weight
---------------------------
A weight has a logical shape ``(*lead, N, K)``: ``K`` is the reduction (input) dimension, ``N`` the
output rows, ``lead`` optional batch dims (e.g. experts).  It is stored as one or more *parts*:

* single-part formats (all GGUF types) take ``raw`` as one tensor holding the GGUF bytes
  (``uint8``; F32/F16/BF16 may also come in their stored dtype) of shape ``(*lead, N, row_bytes)``
  or any shape with the same number of bytes;
* multi-part formats (FP8, NVFP4, MXFP4) take ``raw`` as a mapping ``part name -> tensor`` using the
  checkpoint's own tensor names (``weight``, ``weight_scale_inv``, ``weight_scale``, ...).

Every part is described by a :class:`PartSpec` that says how its rows and columns map onto logical
rows and columns; from that, the base class implements row gathers, column windows, tiles and byte
counts once, and a format only writes ``_decode`` (vectorized torch, no per-block Python loops, so
it runs on CPU and CUDA tensors alike).

Rows are addressed in the *flattened* row space ``0 .. prod(lead)*N``: rows of expert ``e`` are
``e*N .. (e+1)*N``.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Callable, Iterator, Mapping, Union

import torch

from ..hardware import widen_gemm

Raw = Union[torch.Tensor, Mapping[str, torch.Tensor]]
Rows = Union[None, slice, range, torch.Tensor, list, tuple]

_FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu") if hasattr(torch, n))


class QuantFormatError(ValueError):
    pass


@dataclass(frozen=True)
class PartSpec:
    """How one stored array maps onto the logical ``(*lead, N, K)`` weight.

    row_block: logical rows per stored row (1 = one stored row per weight row; 128 = 128x128 block
        scales); ``None`` = a per-tensor value (numel 1) or one value per lead index (numel prod(lead)).
    col_unit / col_per_unit: every ``col_unit`` logical columns take ``col_per_unit`` stored elements
        (GGUF: block_size -> type_size bytes; NVFP4 weight: 2 -> 1 byte; 128-block scale: 128 -> 1).
        ``col_unit=None`` = one element per stored row (a per-row scale).
    dtype: the storage dtype (documentation and ``part_specs``; inputs of the same byte width are
        accepted and re-viewed).
    """

    name: str
    row_block: int | None
    col_unit: int | None
    col_per_unit: int
    dtype: torch.dtype

    def cols(self, k: int) -> int:
        if self.col_unit is None:
            return 1
        return -(-k // self.col_unit) * self.col_per_unit

    def rows(self, n: int, n_lead: int) -> int:
        if self.row_block is None:
            return n_lead
        return n_lead * -(-n // self.row_block)


def norm_shape(shape) -> tuple[int, ...]:
    shape = tuple(int(s) for s in shape)
    if len(shape) == 1:
        shape = (1, shape[0])
    if len(shape) < 2:
        raise QuantFormatError(f"a quantized weight needs a shape (..., N, K), got {shape}")
    return shape


def resolve_rows(rows: Rows, total: int, device) -> tuple[int, int, torch.Tensor | None]:
    """A row selection over ``total`` rows -> ``(start, count, None)`` for a contiguous range, else
    ``(0, count, int64 ids on device)``; ids out of range raise IndexError (not checked while a CUDA
    graph is being captured: that check would sync with the host)."""
    if rows is None:
        return 0, total, None
    if isinstance(rows, range):
        rows = slice(rows.start, rows.stop) if rows.step == 1 else torch.tensor(list(rows), dtype=torch.long)
    if isinstance(rows, slice):
        start, stop, step = rows.indices(total)
        if step == 1:
            return start, max(0, stop - start), None
        idx = torch.arange(start, stop, step, device=device)
        return 0, idx.numel(), idx
    idx = torch.as_tensor(rows, dtype=torch.long).to(device).reshape(-1)
    capturing = idx.is_cuda and torch.cuda.is_current_stream_capturing()  # no host sync inside a CUDA graph
    if idx.numel() and not capturing and (int(idx.min()) < 0 or int(idx.max()) >= total):
        raise IndexError(f"row index out of range for {total} rows")
    return 0, idx.numel(), idx


def compute_dtype(out_dtype: torch.dtype) -> torch.dtype:
    """float64 in -> decode in float64 (exact for FP8/NVFP4/MXFP4); everything else decodes in float32."""
    return torch.float64 if out_dtype == torch.float64 else torch.float32


_TABLES: dict = {}


def cached_table(key: str, build: Callable[[], torch.Tensor], device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small lookup table built once on CPU and cached per (device, dtype)."""
    dkey = (key, str(device), dtype)
    t = _TABLES.get(dkey)
    if t is None:
        base = _TABLES.get((key, "cpu", None))
        if base is None:
            base = build()
            _TABLES[(key, "cpu", None)] = base
        t = base.to(device=device, dtype=dtype if dtype is not None else base.dtype)
        _TABLES[dkey] = t
    return t


class QuantFormat:
    """A quantized weight format. Subclasses set ``name``, ``parts`` and implement ``_decode``."""

    name: str = "?"
    parts: tuple[PartSpec, ...] = ()
    #: (rows, cols) of logical elements that share one scale block (documentation / planning)
    block_shape: tuple[int, int] = (1, 1)
    #: column windows for tiles must start on a multiple of this
    col_align: int = 1
    #: the format's own native dtype is exact only in float32/float64
    description: str = ""

    # ------------------------------------------------------------------ sizes
    def part_specs(self, shape) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Canonical storage shape and dtype of each part for a logical ``shape``."""
        shape = norm_shape(shape)
        lead, n, k = shape[:-2], shape[-2], shape[-1]
        self.check_shape(shape)
        out = {}
        for p in self.parts:
            if p.row_block is None:
                pshape = tuple(lead)
            else:
                pshape = (*lead, -(-n // p.row_block), p.cols(k))
            out[p.name] = (pshape, p.dtype)
        return out

    def nbytes(self, shape) -> int:
        """Bytes the compressed weight occupies (all parts)."""
        total = 0
        for pshape, dt in self.part_specs(shape).values():
            total += prod(pshape) * torch.empty((), dtype=dt).element_size()
        return total

    def row_nbytes(self, k: int) -> float:
        """Bytes per weight row of ``k`` columns, block scales amortized (exact for row-wise formats)."""
        total = 0.0
        for p in self.parts:
            es = torch.empty((), dtype=p.dtype).element_size()
            if p.row_block is None:
                continue
            total += p.cols(k) * es / p.row_block
        return total

    def bits_per_weight(self, k: int = 4096) -> float:
        return 8.0 * self.row_nbytes(k) / k

    def check_shape(self, shape) -> None:
        shape = norm_shape(shape)
        k = shape[-1]
        for p in self.parts:
            if p.col_unit is not None and p.col_unit > 1 and p.row_block == 1 and k % p.col_unit:
                raise QuantFormatError(f"{self.name}: K={k} is not a multiple of the block size {p.col_unit}")

    # ------------------------------------------------------------------ parts
    def _part_dict(self, raw: Raw) -> dict[str, torch.Tensor]:
        if isinstance(raw, torch.Tensor):
            if len(self.parts) != 1:
                raise QuantFormatError(f"{self.name} has parts {[p.name for p in self.parts]}: pass a mapping")
            return {self.parts[0].name: raw}
        d = dict(raw)
        missing = [p.name for p in self.parts if p.name not in d]
        if missing:
            raise QuantFormatError(f"{self.name}: missing part(s) {missing}; got {sorted(d)}")
        return d

    def _canon(self, raw: Raw, shape) -> dict[str, torch.Tensor]:
        """Each part as a 2-D tensor (stored rows, stored cols); float8 parts viewed as uint8."""
        shape = norm_shape(shape)
        self.check_shape(shape)
        lead, n, k = shape[:-2], shape[-2], shape[-1]
        n_lead = prod(lead)
        parts = self._part_dict(raw)
        out = {}
        for p in self.parts:
            t = parts[p.name]
            if t.dtype in _FLOAT8:
                t = t.view(torch.uint8)
            if p.row_block is None:
                if t.numel() not in (1, n_lead):
                    raise QuantFormatError(
                        f"{self.name}: part {p.name} has {t.numel()} values; expected 1 or {n_lead} (one per {tuple(lead)})")
                out[p.name] = t.reshape(-1, 1)
                continue
            rows, cols = p.rows(n, n_lead), p.cols(k)
            if p.dtype == torch.uint8 and t.dtype != torch.uint8 and t.dtype.itemsize != 1:
                # GGUF F16/F32/BF16 tensors may come in their stored dtype: look at their bytes
                t = t.contiguous().view(torch.uint8) if t.dim() > 0 else t.reshape(1).view(torch.uint8)
            if t.numel() != rows * cols:
                raise QuantFormatError(
                    f"{self.name}: part {p.name} has {t.numel()} elements ({tuple(t.shape)}); "
                    f"shape {shape} needs {rows}x{cols}")
            out[p.name] = t.reshape(rows, cols)
        return out

    # ------------------------------------------------------------------ selection
    def _select(self, parts2d: dict[str, torch.Tensor], shape, rows: Rows, cols: slice | None):
        """Per-output-row parts: row i of every row-wise part belongs to logical row i of the selection."""
        shape = norm_shape(shape)
        lead, n, k = shape[:-2], shape[-2], shape[-1]
        total = prod(lead) * n
        any_part = next(iter(parts2d.values()))
        start, n_sel, ridx_t = resolve_rows(rows, total, any_part.device)
        ridx = slice(start, start + n_sel)
        c0, c1 = 0, k
        if cols is not None:
            c0, c1, step = cols.indices(k)
            if step != 1:
                raise QuantFormatError("column windows must be contiguous")
            if c0 % self.col_align or (c1 % self.col_align and c1 != k):
                raise QuantFormatError(f"{self.name}: column window [{c0}, {c1}) must be aligned to {self.col_align}")
        out = {}
        for p in self.parts:
            t = parts2d[p.name]
            if p.row_block is None:
                if t.shape[0] == 1:
                    out[p.name] = t  # (1, 1): broadcasts
                    continue
                if ridx_t is None:
                    sel = torch.arange(ridx.start, ridx.stop, device=t.device) // n
                else:
                    sel = ridx_t // n
                out[p.name] = t.index_select(0, sel)
                continue
            if p.row_block == 1 and ridx_t is None:
                t = t[ridx]
            else:
                r = torch.arange(ridx.start, ridx.stop, device=t.device) if ridx_t is None else ridx_t
                nb = -(-n // p.row_block)
                t = t.index_select(0, (r // n) * nb + (r % n) // p.row_block)
            if p.col_unit is not None and (c0 != 0 or c1 != k):
                s0 = (c0 // p.col_unit) * p.col_per_unit
                s1 = -(-c1 // p.col_unit) * p.col_per_unit
                t = t[:, s0:s1]
            out[p.name] = t
        return out, n_sel, c1 - c0

    # ------------------------------------------------------------------ decoding
    def _decode(self, parts: dict[str, torch.Tensor], n_rows: int, n_cols: int, out_dtype: torch.dtype) -> torch.Tensor:
        """Dequantize per-output-row parts to an (n_rows, n_cols) tensor (subclasses)."""
        raise NotImplementedError

    def _dense(self, parts: dict[str, torch.Tensor], shape, rows: Rows, cols: slice | None,
               out_dtype: torch.dtype) -> torch.Tensor:
        """Selected rows/cols of canonical parts, dense: the Triton kernel on CUDA, else ``_decode``."""
        if cols is None:
            td = _triton_path(next(iter(parts.values())))
            if td is not None:
                y = td.decode_parts(self, parts, shape, rows, out_dtype)
                if y is not None:
                    return y
        sel, nr, nc = self._select(parts, shape, rows, cols)
        return self._decode(sel, nr, nc, out_dtype)

    def dequantize(self, raw: Raw, shape, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole weight as a dense ``shape`` tensor of ``out_dtype``, on the parts' device."""
        user_shape = tuple(int(s) for s in shape)
        shape = norm_shape(shape)
        return self._dense(self._canon(raw, shape), shape, None, None, out_dtype).reshape(user_shape)

    def dequantize_rows(self, raw: Raw, shape, rows: Rows, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``rows`` (flattened row space, see module doc) as a dense ``(len(rows), K)`` tensor."""
        return self.dequantize_tile(raw, shape, rows, None, out_dtype)

    def dequantize_tile(self, raw: Raw, shape, rows: Rows = None, cols: slice | None = None,
                        out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A ``(len(rows), c1 - c0)`` tile; ``cols`` must start on ``col_align`` (and end on it or at K)."""
        shape = norm_shape(shape)
        return self._dense(self._canon(raw, shape), shape, rows, cols, out_dtype)

    def iter_row_tiles(self, raw: Raw, shape, tile_rows: int | None = None, rows: tuple[int, int] | None = None,
                       out_dtype: torch.dtype = torch.float32) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Yield ``(r0, r1, tile)`` over rows ``[rows[0], rows[1])`` (default: all), ``tile_rows`` at a time
        (default: ``default_tile_rows(K)`` on CPU, all rows in one tile on a GPU).

        Only one tile is dense at any time: this is how a CPU expert computes from compressed rows.
        """
        shape = norm_shape(shape)
        total = prod(shape[:-1])
        r_start, r_end = rows if rows is not None else (0, total)
        parts = self._canon(raw, shape)  # canonicalize once: tiles are views/gathers of these
        if tile_rows is None:
            on_cpu = next(iter(parts.values())).device.type == "cpu"
            tile_rows = default_tile_rows(shape[-1]) if on_cpu else \
                gpu_tile_rows(shape[-1], r_end - r_start, torch.empty((), dtype=out_dtype).element_size())
        for r0 in range(r_start, r_end, tile_rows):
            r1 = min(r_end, r0 + tile_rows)
            yield r0, r1, self._dense(parts, shape, slice(r0, r1), None, out_dtype)

    def __repr__(self) -> str:
        return f"<QuantFormat {self.name}>"


_TRITON: list = []  # [module or None], filled on first use


def _triton_path(t: torch.Tensor):
    """moestream.quant.triton_dequant when ``t`` is on CUDA, triton imports and MOESTREAM_TRITON != 0."""
    if t.device.type != "cuda":
        return None
    from ..env import triton_enabled

    if not triton_enabled():
        return None
    if not _TRITON:
        try:
            from . import triton_dequant
        except ImportError:  # triton is optional: torch decodes instead
            triton_dequant = None
        _TRITON.append(triton_dequant)
    return _TRITON[0]


# CPU tiles: 256 Ki values (1 MiB as float32; Qwen3.6 experts: 128 rows of K=2048, 512 rows of K=512).
# The torch decoders stream each tile through ~10 elementwise ops, so the tile should stay in the
# caches (1-2 MiB of L2 per core pair on current x86 servers), yet be large enough that the ~5 us
# per-op dispatch is small next to its work. Measured (qlinear, bs=1, one thread, 2-core EPYC with
# 512 KiB L2/core): 64 Ki-value tiles up to 2x slower per weight than 256-512 Ki, a whole 2 Mi-value
# matrix up to 4x slower (Q8_0; Q4_K and FP8 vary less).
TILE_BYTES = 1 << 20
GPU_TILE_BYTES = 64 << 20  # the largest dense tile a GPU qlinear decodes at once (gpu_tile_rows)


def gpu_tile_rows(k: int, rows: int, elem_bytes: int) -> int:
    """Rows per GPU tile: all of them (one Triton decode, one GEMM) up to GPU_TILE_BYTES of dense tile, else tiles of
    that size — a vocabulary head's prefill rows (a Q8_0 head of 248k x 2048 would be 0.95 GiB dense at once, beyond
    a small card's plan) go through 16 tiles of 64 MiB."""
    return max(1, min(rows, GPU_TILE_BYTES // max(1, k * elem_bytes)))


def default_tile_rows(k: int, elem_bytes: int = 4) -> int:
    """Rows per CPU tile so that a dense tile is about TILE_BYTES (a multiple of 16 rows when possible).

    Depends on K only (not on threads or the batch), so a weight is always cut the same way."""
    r = max(1, TILE_BYTES // max(1, k * elem_bytes))
    return r - r % 16 if r >= 32 else r


# CPU qlinear on GGUF block formats runs the compiled int8-activation kernels for every row count
# (kernels/cpu_quant.py: per-row rounding, so the result of a row does not depend on the rows beside it).
# The float-activation kernels (F16 / BF16 rows, HF FP8) compute what a float32 tile GEMM computes: up to
# this many rows they are faster; beyond, decoding a tile to float32 once and one GEMM is.
CPU_FLOAT_KERNEL_MAX_ROWS = 8
FLOAT_KERNEL_TYPES = ("F16", "BF16")


def cpu_kernel_rows_ok(fmt, rows: int) -> bool:
    """Whether `rows` rows of x take the compiled CPU kernel for a weight of format `fmt`: every row count for the
    int8-activation ones (GGUF block types, HF NVFP4 / MXFP4), a few for the float ones (F16 / BF16, HF FP8)."""
    from .fp_formats import MXFP4Format, NVFP4Format

    name = getattr(fmt, "type_name", None)
    rounded = (name is not None and name not in FLOAT_KERNEL_TYPES) or isinstance(fmt, (NVFP4Format, MXFP4Format))
    return rounded or rows <= CPU_FLOAT_KERNEL_MAX_ROWS


def _fp8_rows(fmt, raw: Mapping, shape, r0: int, r1: int):
    """(weight rows [r1-r0, K] uint8, scales, block, scale stride) of an HF FP8 weight's flattened rows r0:r1
    for kernels/cpu_quant.fp8_matmul, or None where the rows cross an expert or cut a row block of scales."""
    n, k = shape[-2], shape[-1]
    e = r0 // n
    if r1 > (e + 1) * n or r1 <= r0:
        return None
    w = raw["weight"]
    w = (w.view(torch.uint8) if w.dtype != torch.uint8 else w).reshape(-1, k)[r0:r1]
    block, stride = fmt.scale_layout(r1 - r0, k)
    if fmt.mode == "block":
        bn = block[0]
        if (r0 - e * n) % bn:
            return None
        s = raw["weight_scale_inv"]
        s = s.reshape(-1, fmt.part_specs(shape)["weight_scale_inv"][0][-1])  # parts may come flat (expert rows)
        first = e * -(-n // bn) + (r0 - e * n) // bn  # expert e's scale rows start at e * ceil(n / bn)
        return w, s[first:], block, s.shape[1]
    s = raw["weight_scale"].reshape(-1)
    if fmt.mode == "channel":
        return w, s[r0:r1], block, stride
    return w, s[e if s.numel() > 1 else 0:][:1], block, stride  # tensor: one scale (per expert)


def _cpu_fp8_linear(xs, fmt, raw: Mapping, shape, r0: int, r1: int, out):
    """_cpu_kernel_linear for HF FP8 weights (kernels/cpu_quant.fp8_matmul: float32 activations, the e4m3
    bytes read as stored, one float32 partial sum per scale block)."""
    from ..kernels.cpu_quant import available, fp8_matmul
    from .fp_formats import FP8Format

    if not isinstance(fmt, FP8Format) or xs.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    args = _fp8_rows(fmt, raw, norm_shape(shape), r0, r1) if available() else None
    if args is None or args[0].stride(-1) != 1:
        return None
    y32 = out.view(-1, r1 - r0) if out is not None and out.dtype == torch.float32 else None
    y32 = fp8_matmul(xs, *args, out=y32)
    if out is not None and out.dtype != torch.float32:
        return out.view(-1, r1 - r0).copy_(y32)
    return y32 if xs.dtype == torch.float32 else y32.to(xs.dtype)


def _fp4_rows(fmt, raw: Mapping, shape, r0: int, r1: int):
    """(codes [r1-r0, K/2] uint8, scale bytes [r1-r0, K/g], global scale or None) of an HF FP4 weight's flattened
    rows r0:r1 for kernels/cpu_quant.fp4_matmul, or None where K is not a multiple of 32 or NVFP4 rows cross an
    expert (each expert has its own global scale)."""
    from .fp_formats import NVFP4Format

    n, k = shape[-2], shape[-1]
    nv = isinstance(fmt, NVFP4Format)
    if k % 32 or r1 <= r0:
        return None
    codes, scales = (raw["weight"], raw["weight_scale"]) if nv else (raw["blocks"], raw["scales"])
    codes = (codes.view(torch.uint8) if codes.dtype != torch.uint8 else codes).reshape(-1, k // 2)[r0:r1]
    scales = (scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales).reshape(-1, k // (16 if nv else 32))
    if not nv:
        return codes, scales[r0:r1], None
    e = r0 // n
    g = raw["weight_scale_2"].reshape(-1)
    if g.numel() > 1 and r1 > (e + 1) * n:
        return None
    return codes, scales[r0:r1], g[e if g.numel() > 1 else 0]


def _cpu_fp4_linear(xs, fmt, raw: Mapping, shape, r0: int, r1: int, out):
    """_cpu_kernel_linear for HF NVFP4 / MXFP4 weights (kernels/cpu_quant.fp4_matmul: x rounded to int8 per 16,
    the e2m1 codes and scales read as stored)."""
    from ..kernels.cpu_quant import available, fp4_matmul

    if xs.dtype not in (torch.float32, torch.bfloat16, torch.float16) or not available():
        return None
    args = _fp4_rows(fmt, raw, norm_shape(shape), r0, r1)
    if args is None or args[0].stride(-1) != 1 or args[1].stride(-1) != 1:
        return None
    y32 = out.view(-1, r1 - r0) if out is not None and out.dtype == torch.float32 else None
    y32 = fp4_matmul(xs, args[0], args[1], "nvfp4" if args[2] is not None else "mxfp4", args[2], out=y32)
    if out is not None and out.dtype != torch.float32:
        return out.view(-1, r1 - r0).copy_(y32)
    return y32 if xs.dtype == torch.float32 else y32.to(xs.dtype)


def _cpu_kernel_linear(xs, fmt, raw, shape, r0: int, r1: int, out):
    """``xs @ W[r0:r1].T`` in ``xs.dtype`` through the compiled CPU kernel, or None where it does not apply
    (not CPU, a format it lacks, many rows, MOESTREAM_CPU_KERNELS=0, or the kernel could not be built)."""
    if xs.device.type != "cpu" or not cpu_kernel_rows_ok(fmt, xs.shape[0]):
        return None
    if isinstance(raw, Mapping):
        from .fp_formats import MXFP4Format, NVFP4Format

        if isinstance(fmt, (NVFP4Format, MXFP4Format)):
            return _cpu_fp4_linear(xs, fmt, raw, shape, r0, r1, out)
        return _cpu_fp8_linear(xs, fmt, raw, shape, r0, r1, out)
    if not isinstance(raw, torch.Tensor):
        return None
    from ..kernels.cpu_quant import TYPES, available, qmatmul, rows_matmul, supports

    name = getattr(fmt, "type_name", None)
    if not supports(name) or xs.dtype not in (torch.float32, torch.bfloat16, torch.float16) or not available():
        return None
    k = shape[-1]
    rb = fmt.row_bytes(k)
    w = raw if raw.dtype == torch.uint8 else raw.contiguous().view(torch.uint8)
    w = w.reshape(-1, rb)[r0:r1]
    if out is None and xs.dtype == torch.float32 and xs.is_contiguous():  # decode: skip qmatmul's conversions
        return rows_matmul(xs, w, TYPES[name])
    y32 = out.view(-1, r1 - r0) if out is not None and out.dtype == torch.float32 else None
    y32 = qmatmul(xs, w, name, out=y32)
    if out is not None and out.dtype != torch.float32:
        return out.view(-1, r1 - r0).copy_(y32)
    return y32 if xs.dtype == torch.float32 else y32.to(xs.dtype)


def qlinear(x: torch.Tensor, fmt: "QuantFormat", raw: Raw, shape, *, rows: tuple[int, int] | None = None,
            bias: torch.Tensor | None = None, tile_rows: int | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x @ W[rows].T (+ bias)`` with ``W`` dequantized one row tile at a time.

    On CPU, x with a GGUF block type the compiled kernels know, or HF NVFP4 / MXFP4, goes through
    kernels/cpu_quant.py instead, whatever its row count: integer dot products on the stored blocks with each
    row rounded to int8 per block of 32 (K-quants 256, HF FP4 16; llama.cpp's scheme; that module's docstring
    bounds the error); F16 / BF16 rows and HF FP8 up to CPU_FLOAT_KERNEL_MAX_ROWS rows (float activations).
    The rest is below.

    x: ``(..., K)``; the weight is ``shape=(*lead, N, K)``; ``rows=(r0, r1)`` picks a range of the
    flattened rows (expert ``e``: ``(e*N, (e+1)*N)``); default all rows of a 2-D weight.
    Tiles are decoded in ``x.dtype`` (float32 math inside, see compute_dtype), or in float32 for 16+
    rows of 16-bit activations on a CPU without native 16-bit GEMMs (its 16-bit GEMM is several times
    slower there; the result is still rounded to ``x.dtype``). On CPU the default
    tile is ``default_tile_rows(K)`` rows, so a big matrix is never dense at once; on a GPU it is the
    whole row range (one Triton decode, one GEMM). Each output column is one GEMM dot product over
    K, so the result depends on the tiling only through the BLAS's summation order (tests/test_quant.py).
    """
    shape = norm_shape(shape)
    k = shape[-1]
    if x.shape[-1] != k:
        raise QuantFormatError(f"x has {x.shape[-1]} features, the weight has K={k}")
    r0, r1 = rows if rows is not None else (0, prod(shape[:-1]))
    xs = x.reshape(-1, k)
    y = _cpu_kernel_linear(xs, fmt, raw, shape, r0, r1, out)
    if y is not None:
        if bias is not None:
            y += bias[r0:r1] if bias.shape[-1] != r1 - r0 else bias
        return y.reshape(*x.shape[:-1], r1 - r0)
    # CPUs without native 16-bit GEMMs: 16+ rows multiply float32 tiles (see kernels/linear.py)
    if widen_gemm(xs, x.dtype):
        xs = xs.float()
    y = out.view(-1, r1 - r0) if out is not None else None
    for a, b, tile in fmt.iter_row_tiles(raw, shape, tile_rows, (r0, r1), out_dtype=xs.dtype):
        if y is None and (a, b) == (r0, r1):  # one tile: no copy
            y = (xs @ tile.t()).to(x.dtype)
            continue
        if y is None:
            y = torch.empty((xs.shape[0], r1 - r0), dtype=x.dtype, device=x.device)
        y[:, a - r0:b - r0] = xs @ tile.t()
    if y is None:  # no rows
        y = torch.empty((xs.shape[0], 0), dtype=x.dtype, device=x.device)
    if bias is not None:
        y += bias[r0:r1] if bias.shape[-1] != r1 - r0 else bias
    return y.reshape(*x.shape[:-1], r1 - r0)


# ---------------------------------------------------------------------- registry
FORMATS: dict[str, QuantFormat] = {}


def register(fmt: QuantFormat) -> QuantFormat:
    if fmt.name in FORMATS:
        raise QuantFormatError(f"format {fmt.name} registered twice")
    FORMATS[fmt.name] = fmt
    return fmt


def get_format(name: str) -> QuantFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise QuantFormatError(f"unknown quant format {name!r}; known: {sorted(FORMATS)}") from None


@dataclass
class QuantizedTensor:
    """A compressed weight: format + logical shape + its stored parts (kept compressed)."""

    fmt: QuantFormat
    shape: tuple[int, ...]
    data: Raw

    @property
    def nbytes(self) -> int:
        return self.fmt.nbytes(self.shape)

    @property
    def device(self) -> torch.device:
        d = self.data if isinstance(self.data, torch.Tensor) else next(iter(self.data.values()))
        return d.device

    def to(self, device, non_blocking: bool = False) -> "QuantizedTensor":
        if isinstance(self.data, torch.Tensor):
            data = self.data.to(device, non_blocking=non_blocking)
        else:
            data = {k: v.to(device, non_blocking=non_blocking) for k, v in self.data.items()}
        return QuantizedTensor(self.fmt, self.shape, data)

    def dequantize(self, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.fmt.dequantize(self.data, self.shape, out_dtype)

    def dequantize_rows(self, rows: Rows, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.fmt.dequantize_rows(self.data, self.shape, rows, out_dtype)

    def linear(self, x: torch.Tensor, rows: tuple[int, int] | None = None, bias=None, tile_rows=None) -> torch.Tensor:
        return qlinear(x, self.fmt, self.data, self.shape, rows=rows, bias=bias, tile_rows=tile_rows)

"""A small, fast GGUF reader: metadata as Python values, tensors as byte views of a memory map.

The `gguf` package's reader builds numpy views for every array element of the metadata, which takes
seconds for a 150k-token vocabulary; this one decodes arrays of strings in one pass. Layout (GGUF v2/v3,
little-endian): magic, version, tensor count, kv count, kv pairs, tensor infos, padding, data.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..core import CheckpointError

# GGUF metadata value types -> struct format (None: string / array handled separately)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9


@dataclass
class TensorInfo:
    name: str
    shape: list[int]  # GGUF order: ne0 (the contiguous dimension) first
    type_id: int
    offset: int  # from the start of the data section
    data: np.ndarray | None = None  # uint8 view of this tensor's bytes


class GGUFFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.buf = np.memmap(self.path, dtype=np.uint8, mode="r")
            self._pos = 0
            self._parse()
        except CheckpointError:
            raise
        except (OSError, ValueError, struct.error, UnicodeDecodeError, IndexError) as e:
            raise CheckpointError(f"cannot read GGUF file {self.path}: {type(e).__name__}: {e}") from None

    # ---- primitive reads -------------------------------------------------------------------
    def _take(self, n: int) -> bytes:
        if self._pos + n > len(self.buf):
            raise CheckpointError(f"cannot read GGUF file {self.path}: truncated")
        b = self.buf[self._pos:self._pos + n].tobytes()
        self._pos += n
        return b

    def _scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self._take(size))[0]

    def _string(self) -> str:
        n = self._scalar("<Q")
        return self._take(n).decode("utf-8")

    def _value(self, vtype: int):
        if vtype in _SCALARS:
            return self._scalar(_SCALARS[vtype])
        if vtype == STRING:
            return self._string()
        if vtype == ARRAY:
            etype, count = self._scalar("<I"), self._scalar("<Q")
            if etype in _NUMPY:
                nbytes = count * np.dtype(_NUMPY[etype]).itemsize
                arr = np.frombuffer(self._take(nbytes), dtype=_NUMPY[etype])
                return arr.tolist()
            return [self._value(etype) for _ in range(count)]
        raise CheckpointError(f"cannot read GGUF file {self.path}: unknown metadata type {vtype}")

    # ---- layout ------------------------------------------------------------------------------
    def _parse(self) -> None:
        if self._take(4) != b"GGUF":
            raise CheckpointError(f"{self.path} is not a GGUF file (bad magic)")
        version = self._scalar("<I")
        if version not in (2, 3):
            raise CheckpointError(f"GGUF version {version} of {self.path} is not supported (2 and 3 are)")
        n_tensors, n_kv = self._scalar("<Q"), self._scalar("<Q")
        self.fields: dict = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._scalar("<I"))
        self.tensors: list[TensorInfo] = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._scalar("<Q") for _ in range(self._scalar("<I"))]
            self.tensors.append(TensorInfo(name, dims, self._scalar("<I"), self._scalar("<Q")))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self._attach_data(start)

    def _attach_data(self, start: int) -> None:
        from ..quant import GGML_TYPE_NAMES, gguf_format

        for t in self.tensors:
            name = GGML_TYPE_NAMES.get(t.type_id)
            if name is None:
                raise CheckpointError(f"tensor {t.name} has unknown GGUF type id {t.type_id}")
            nbytes = gguf_format(name).nbytes(tuple(reversed(t.shape)))
            lo = start + t.offset
            if lo + nbytes > len(self.buf):
                raise CheckpointError(f"cannot read GGUF file {self.path}: tensor {t.name} runs past the end")
            t.data = self.buf[lo:lo + nbytes]

    def type_name(self, t: TensorInfo) -> str:
        from ..quant import GGML_TYPE_NAMES

        return GGML_TYPE_NAMES[t.type_id]

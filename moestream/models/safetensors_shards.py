"""Safetensors shards: the weight files of an HF checkpoint folder and every tensor in them by name
(memory-mapped; `ShardTensors.release` drops a tensor's file pages from RSS once it is copied)."""
from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from ..core import CheckpointError

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "U8": torch.uint8, "I8": torch.int8,
              "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool}


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"cannot read {index}: {e!r}") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise CheckpointError(f"{index.name} names shard(s) that are not in {folder}: {', '.join(missing)}")
        return [folder / f for f in files]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors weights in {folder}")
    return files


class ShardTensors:
    """Every tensor of a checkpoint by name across its shards (a weight and its scales may sit in
    different shards); `files` lists (file, keys) in file order."""

    def __init__(self, files: list[Path]):
        self._stack = ExitStack()
        self.files: list[tuple[Path, list[str]]] = []
        self._where: dict = {}
        self._file_of: dict[str, Path] = {}
        self._maps: dict[Path, list[tuple[int, int]]] = {}  # each file's mapped address ranges (release)
        for f in files:
            try:
                handle = self._stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            except Exception as e:  # safetensors raises several types for an unreadable file
                self._stack.close()
                raise CheckpointError(f"cannot read safetensors file {f}: {e}") from None
            keys = list(handle.keys())
            self.files.append((f, keys))
            self._where.update(dict.fromkeys(keys, handle))
            self._file_of.update(dict.fromkeys(keys, f))

    def __enter__(self) -> "ShardTensors":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def get_tensor(self, key: str) -> torch.Tensor:
        return self._where[key].get_tensor(key)

    def release(self, key: str) -> int:
        """Drop tensor `key`'s pages from this process's RSS once it has been copied, so loading does not hold
        the file's pages beside their copies. safetensors maps each file privately (copy-on-write) and the
        loader only reads, so the pages are clean and are read from the file again if touched; only addresses
        inside the file's own mapping are released. Returns the bytes released."""
        from ..moe.hardware import release_pages

        t = self.get_tensor(key)
        lo, n = t.data_ptr(), t.numel() * t.element_size()
        f = self._file_of[key]
        if f not in self._maps:  # once per file: the mapping exists since its first get_tensor
            self._maps[f] = _mapped_ranges(f)
        return release_pages(lo, n) if any(a <= lo and lo + n <= b for a, b in self._maps[f]) else 0

    def dtype(self, key: str) -> torch.dtype:
        """The stored dtype, from the header (the tensor is not read)."""
        code = self._where[key].get_slice(key).get_dtype()
        if code not in _ST_DTYPES:
            raise CheckpointError(f"tensor {key} has dtype {code}, which moestream does not read")
        return _ST_DTYPES[code]


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """Address ranges where this process maps `path` (/proc/self/maps; [] elsewhere)."""
    target, out = str(path.resolve()), []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n") == target:
                    a, b = fields[0].split("-")
                    out.append((int(a, 16), int(b, 16)))
    except OSError:
        pass
    return out

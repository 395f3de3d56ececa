"""Memory pools owned by one device rank.

KVPool: K and V for every full-attention layer, as [layers, num_pages * page_size, kv_heads, head_dim].
A request owns a list of pages; position p of a request lives at flat index
page_table[p // page_size] * page_size + p % page_size.

StatePool: the Gated DeltaNet conv window and recurrent state of each running request, one slot each,
then `num_snapshots` more slots that the prefix cache keeps state snapshots in (kvcache/prefix.py).
"""
from __future__ import annotations

import torch

from ..core import MoestreamError


class PagePool:
    """Free-list bookkeeping of pages (or slots). Invariant: free and used partition range(n)."""

    def __init__(self, n: int):
        self.n = n
        self._free = list(range(n - 1, -1, -1))  # pop() hands out low ids first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def alloc(self, count: int) -> list[int] | None:
        if count > len(self._free):
            return None
        out = [self._free.pop() for _ in range(count)]
        self._used.update(out)
        return out

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if i not in self._used:
                raise MoestreamError(f"internal error: freeing page/slot {i} that is not in use")
            self._used.remove(i)
            self._free.append(i)

    def check_integrity(self) -> None:
        assert len(self._free) + len(self._used) == self.n
        assert not (set(self._free) & self._used)


class KVPool:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.page_size = page_size
        self.num_pages = num_pages
        shape = (num_layers, num_pages * page_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device) if num_layers else None
        self.v = torch.zeros(shape, dtype=dtype, device=device) if num_layers else None
        self.pages = PagePool(num_pages)

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def copy_heads(self, copies: list[tuple[int, int, int]]) -> None:
        """(src page, dst page, n): the K/V of the first n positions of page src, in every layer, into dst."""
        if self.k is None:
            return
        P = self.page_size
        for src, dst, n in copies:
            self.k[:, dst * P:dst * P + n].copy_(self.k[:, src * P:src * P + n])
            self.v[:, dst * P:dst * P + n].copy_(self.v[:, src * P:src * P + n])

    def flat_index(self, page_table: list[int], start: int, end: int, device) -> torch.Tensor:
        pos = torch.arange(start, end)
        pages = torch.tensor(page_table, dtype=torch.long)[pos // self.page_size]
        return (pages * self.page_size + pos % self.page_size).to(device)


class StatePool:
    def __init__(self, num_layers: int, num_slots: int, conv_dim: int, conv_kernel: int,
                 num_v_heads: int, k_head_dim: int, v_head_dim: int,
                 conv_dtype: torch.dtype, state_dtype: torch.dtype, device: torch.device, num_snapshots: int = 0):
        self.num_slots = num_slots
        self.num_snapshots = num_snapshots if num_layers else 0
        n = num_slots + self.num_snapshots
        self.conv = (torch.zeros((num_layers, n, conv_dim, conv_kernel - 1), dtype=conv_dtype, device=device)
                     if num_layers else None)
        self.rec = (torch.zeros((num_layers, n, num_v_heads, k_head_dim, v_head_dim), dtype=state_dtype,
                                device=device) if num_layers else None)
        self.slots = PagePool(num_slots)  # request slots; snapshot slots are num_slots.. (the prefix cache's)

    @property
    def snapshot_slots(self) -> list[int]:
        return list(range(self.num_slots, self.num_slots + self.num_snapshots))

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy the whole state (every layer's conv window and recurrent state) of slot src into dst."""
        if self.conv is None:
            return
        for src, dst in pairs:  # two device copies each, no host tensors
            self.conv[:, dst].copy_(self.conv[:, src])
            self.rec[:, dst].copy_(self.rec[:, src])

    def reset(self, slot: int) -> None:
        if self.conv is not None:
            self.conv[:, slot].zero_()
            self.rec[:, slot].zero_()

    @staticmethod
    def bytes_per_slot(num_layers: int, conv_dim: int, conv_kernel: int, num_v_heads: int, k_head_dim: int,
                       v_head_dim: int, conv_dtype: torch.dtype, state_dtype: torch.dtype) -> int:
        c = conv_dim * (conv_kernel - 1) * torch.empty((), dtype=conv_dtype).element_size()
        r = num_v_heads * k_head_dim * v_head_dim * torch.empty((), dtype=state_dtype).element_size()
        return num_layers * (c + r)

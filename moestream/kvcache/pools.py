"""Memory pools owned by one device rank.

KVPool: K and V for every full-attention layer, as [layers, num_pages * page_size, kv_heads, head_dim].
A request owns a list of pages; position p of a request lives at flat index
page_table[p // page_size] * page_size + p % page_size.

StatePool: the Gated DeltaNet conv window and recurrent state of each running request, one slot each,
then `num_snapshots` more slots that the prefix cache keeps state snapshots in (kvcache/prefix.py), then
`num_checkpoints` slots for speculative decoding (the state after each draft position of a verify step).

HostPool: the prefix cache's host tier: pages and snapshots moved out of the device pools (pinned host
memory when the pools are on a GPU), copied by the ops the prefix cache queues.
"""
from __future__ import annotations

import numpy as np
import torch

from ..core import MoestreamError
from ..moe.store import page_locked_zeros


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

    def used_ids(self) -> list[int]:
        return sorted(self._used)

    def renumber(self, n: int, used: list[int]) -> None:
        """Now n ids, of which exactly `used` are in use (a pool resized with its pages moved)."""
        if len(set(used)) != len(used) or any(not 0 <= i < n for i in used):
            raise MoestreamError(f"internal error: pages {used} do not fit a pool of {n}")
        self.n, self._used = n, set(used)
        self._free = [i for i in range(n - 1, -1, -1) if i not in self._used]

    def check_integrity(self) -> None:
        assert len(self._free) + len(self._used) == self.n
        assert not (set(self._free) & self._used)


def raw(t: torch.Tensor | None) -> torch.Tensor | None:
    """A cache tensor as moved by index: an fp8 (e4m3fn) cache as its uint8 view (torch lacks fp8 index kernels
    on some devices), any other as it is."""
    return t.view(torch.uint8) if t is not None and t.dtype == torch.float8_e4m3fn else t


class KVPool:
    RESIZE_CHUNK = 64  # pages copied at once when the pool is resized (a device temporary of that size)

    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.page_size = page_size
        self.num_pages = num_pages
        self._page_offsets = np.arange(page_size, dtype=np.int64)
        shape = (num_layers, num_pages * page_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device) if num_layers else None
        self.v = torch.zeros(shape, dtype=dtype, device=device) if num_layers else None
        self.pages = PagePool(num_pages)

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def resize(self, num_pages: int, keep: dict[int, int]) -> None:
        """Replace the pool by one of num_pages pages holding the pages of `keep` (old id -> new id); the
        allocator then has exactly the new ids in use. The kept pages wait in host memory (copied a few pages at
        a time) while the old tensors are freed and the new ones allocated, so on a GPU the two pools are never
        there together."""
        if self.k is not None:
            P, dev = self.page_size, self.k.device
            old = sorted(keep)
            new = [keep[p] for p in old]
            rows = lambda pages: (torch.tensor(pages)[:, None] * P + torch.arange(P)).flatten().to(dev)  # noqa: E731
            chunks = [slice(i, i + self.RESIZE_CHUNK) for i in range(0, len(old), self.RESIZE_CHUNK)]
            saved = []
            for t in (raw(self.k), raw(self.v)):
                host = torch.empty((t.shape[0], len(old) * P, *t.shape[2:]), dtype=t.dtype)
                for c in chunks:
                    host[:, c.start * P:(c.start + len(old[c])) * P] = t[:, rows(old[c])].to("cpu")
                saved.append(host)
            shape, dtype = (self.k.shape[0], num_pages * P, *self.k.shape[2:]), self.k.dtype
            self.k = self.v = None
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            self.k, self.v = (torch.zeros(shape, dtype=dtype, device=dev) for _ in range(2))
            for t, host in zip((raw(self.k), raw(self.v)), saved):
                for c in chunks:
                    t[:, rows(new[c])] = host[:, c.start * P:(c.start + len(new[c])) * P].to(dev)
        self.num_pages = num_pages
        self.pages.renumber(num_pages, list(keep.values()))

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def copy_heads(self, copies: list[tuple[int, int, int]]) -> None:
        """(src page, dst page, n): the K/V of the first n positions of page src, in every layer, into dst."""
        if self.k is None:
            return
        P = self.page_size
        for src, dst, n in copies:
            for t in (raw(self.k), raw(self.v)):
                t[:, dst * P:dst * P + n].copy_(t[:, src * P:src * P + n])

    def flat_rows(self, page_table: list[int], n: int) -> np.ndarray:
        """flat_index(page_table, 0, n) as an int64 numpy array (n > 0)."""
        ps = self.page_size
        last = (n - 1) // ps + 1
        if last > len(page_table):
            raise IndexError(f"positions [0, {n}) run past the sequence's {len(page_table)} pages")
        pages = np.asarray(page_table[:last], dtype=np.int64)
        return (pages[:, None] * ps + self._page_offsets).ravel()[:n]

    def flat_index(self, page_table: list[int], start: int, end: int, device) -> torch.Tensor:
        """Pool rows of positions [start, end) of a sequence whose pages are `page_table` (int64). Built with
        numpy: every step builds it for every running sequence, and five small torch ops cost ~0.1 ms a step
        on a CPU, a third of a small model's batch building."""
        ps = self.page_size
        first, last = start // ps, (end - 1) // ps + 1 if end > start else start // ps
        pages = np.asarray(page_table[first:last], dtype=np.int64)
        rows = (pages[:, None] * ps + np.arange(ps, dtype=np.int64)).ravel()[start - first * ps:end - first * ps]
        if len(rows) != max(end - start, 0):
            raise IndexError(f"positions [{start}, {end}) run past the sequence's {len(page_table)} pages")
        return torch.from_numpy(rows).to(device)


class StatePool:
    def __init__(self, num_layers: int, num_slots: int, conv_dim: int, conv_kernel: int,
                 num_v_heads: int, k_head_dim: int, v_head_dim: int,
                 conv_dtype: torch.dtype, state_dtype: torch.dtype, device: torch.device, num_snapshots: int = 0,
                 num_checkpoints: int = 0):
        self.num_slots = num_slots
        self.num_snapshots = num_snapshots if num_layers else 0
        self.num_checkpoints = num_checkpoints if num_layers else 0
        n = num_slots + self.num_snapshots + self.num_checkpoints
        self.conv = (torch.zeros((num_layers, n, conv_dim, conv_kernel - 1), dtype=conv_dtype, device=device)
                     if num_layers else None)
        self.rec = (torch.zeros((num_layers, n, num_v_heads, k_head_dim, v_head_dim), dtype=state_dtype,
                                device=device) if num_layers else None)
        self.slots = PagePool(num_slots)  # request slots; snapshot slots are num_slots.. (the prefix cache's)

    @property
    def snapshot_slots(self) -> list[int]:
        return list(range(self.num_slots, self.num_slots + self.num_snapshots))

    @property
    def checkpoint_slots(self) -> list[int]:
        """Slots for speculative decoding's per-draft-position states (after the snapshot slots)."""
        start = self.num_slots + self.num_snapshots
        return list(range(start, start + self.num_checkpoints))

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


class HostPool:
    def __init__(self, kv: KVPool, state: StatePool, num_pages: int, num_snaps: int, pin: bool):
        """num_pages KV pages and num_snaps state snapshots laid out like the device pools; pin: page-locked
        (the pools are on a GPU)."""
        P = kv.page_size

        def like(t, n, per):  # n slots of `per` rows of t's layout along dim 1
            if t is None or n == 0:
                return None
            shape = (t.shape[0], n * per, *t.shape[2:])
            return page_locked_zeros(shape, t.dtype) if pin else torch.zeros(shape, dtype=t.dtype)

        self.num_pages, self.num_snaps, self.page_size = num_pages, num_snaps, P
        self.k, self.v = like(kv.k, num_pages, P), like(kv.v, num_pages, P)
        self.conv, self.rec = like(state.conv, num_snaps, 1), like(state.rec, num_snaps, 1)
        size = lambda t: t[:, :1].numel() * t.element_size() if t is not None else 0  # noqa: E731 (one row)
        self.page_bytes = (size(self.k) + size(self.v)) * P  # one host page / snapshot, for the stats
        self.snap_bytes = size(self.conv) + size(self.rec)

    @staticmethod
    def split(budget: int, page_bytes: int, snap_bytes: int) -> tuple[int, int]:
        """(pages, snapshots) that `budget` bytes hold: half for snapshots when the model has linear
        layers (one snapshot is worth many pages), the rest (or all) for pages."""
        snaps = budget // 2 // snap_bytes if snap_bytes else 0
        rest = budget - snaps * snap_bytes
        return (rest // page_bytes if page_bytes else 0), snaps

    def run(self, ops: list[tuple[str, int, int]], kv: KVPool, state: StatePool) -> None:
        """The prefix cache's queued copies, in order (kvcache/prefix.py: host_ops)."""
        P = self.page_size
        for op, src, dst in ops:
            if op in ("kv_out", "kv_in") and self.k is not None:
                a, b = (kv, self) if op == "kv_out" else (self, kv)
                raw(b.k)[:, dst * P:(dst + 1) * P].copy_(raw(a.k)[:, src * P:(src + 1) * P], non_blocking=True)
                raw(b.v)[:, dst * P:(dst + 1) * P].copy_(raw(a.v)[:, src * P:(src + 1) * P], non_blocking=True)
            elif op in ("state_out", "state_in") and self.conv is not None:
                a, b = (state, self) if op == "state_out" else (self, state)
                b.conv[:, dst].copy_(a.conv[:, src], non_blocking=True)
                b.rec[:, dst].copy_(a.rec[:, src], non_blocking=True)

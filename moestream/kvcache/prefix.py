"""Prefix cache: a radix tree over full KV pages, shared by reference count, LRU-evicted.

Each node below the root is one full page of `page_size` tokens: its key is that page's token ids, its
`page` the KV-pool page holding their K/V (computed after the tokens of every ancestor). A request that
starts with the same pages reuses them and prefills only the rest. Requests insert their pages as they
become full (after the step that computed them), so concurrent requests can share a prefix too.

Ownership: a page in the tree belongs to the tree; a request holds a reference on every node of its path
(`ref`), its other pages are its own. A node with ref 0 has no running user; since requests hold whole
paths, its descendants have ref 0 too, and the tree frees such pages from the leaves up, least recently
used first, when the pool runs short. Pages in the tree are never written again: a request writes only
positions past its last full cached page.

Models with Gated DeltaNet layers cannot cut their recurrent state at an arbitrary token: a node may
carry a snapshot (a slot of the state pool holding the conv and recurrent state after the node's last
token), and for those models only nodes with a snapshot can be resumed from. Snapshots have their own
LRU over a fixed number of slots; dropping one never touches pages.

A request whose tokens leave the cached path inside a page (a branch, or the limit of all but its last
token) copies the shared head of that page into a page of its own (copy-on-write, attention-only models).

Bookkeeping only (no tensors): the scheduler copies KV heads and state between slots through the
ForwardBatch.
"""
from __future__ import annotations

import heapq
import itertools

from .pools import PagePool


class Node:
    __slots__ = ("key", "page", "parent", "children", "ref", "last", "snap", "depth")

    def __init__(self, key, page: int, parent: "Node | None"):
        self.key = key
        self.page = page
        self.parent = parent
        self.children: dict[tuple, Node] = {}
        self.ref = 0
        self.last = 0
        self.snap = -1  # state-pool slot with the linear state after this node's last token, -1: none
        self.depth = 0 if parent is None else parent.depth + 1  # pages from the root, this one included


class PrefixCache:
    def __init__(self, pages: PagePool, page_size: int, needs_snapshot: bool = False,
                 snap_slots: list[int] | None = None):
        """pages: the KV pool's page allocator (shared with the scheduler); needs_snapshot: the model has
        linear-state layers, so only nodes with a snapshot are resumable; snap_slots: state-pool slots
        reserved for snapshots."""
        self.pages = pages
        self.page_size = page_size
        self.root = Node(None, -1, None)
        self.owned: dict[int, Node] = {}  # page id -> its node
        self.num_evictable = 0  # nodes with ref 0
        self.needs_snapshot = needs_snapshot
        self.free_snaps: list[int] = list(reversed(snap_slots or []))
        self.num_snap_slots = len(snap_slots or [])
        self.snap_nodes: dict[Node, None] = {}  # nodes holding a snapshot
        self._clock = itertools.count(1)
        # counters for stats
        self.evicted_pages = 0
        self.evicted_snaps = 0

    # ---- lookup ----------------------------------------------------------------------------------
    def match(self, ids: list[int], max_tokens: int) -> list[Node]:
        """The longest cached path of full pages within ids[:max_tokens] that can be resumed from
        (for linear-state models: ending at a node with a snapshot). Does not take references."""
        P = self.page_size
        node, path = self.root, []
        for i in range(max_tokens // P):
            child = node.children.get(tuple(ids[i * P:(i + 1) * P]))
            if child is None:
                break
            path.append(child)
            node = child
        if self.needs_snapshot:
            while path and path[-1].snap < 0:
                path.pop()
        return path

    def match_partial(self, parent: Node, ids: list[int], start: int, max_tokens: int) -> tuple[Node | None, int]:
        """The child of `parent` whose page shares the longest run of ids[start:max_tokens] (a prefix that
        ends inside that page), and the run's length; (None, 0) when none shares a token. Attention KV
        only: a linear-state model cannot resume inside a page (its snapshots sit at page ends)."""
        want = ids[start:max_tokens][:self.page_size]
        best, best_k = None, 0
        for key, child in parent.children.items():
            k = 0
            while k < len(want) and key[k] == want[k]:
                k += 1
            if k > best_k:
                best, best_k = child, k
        return best, best_k

    def acquire(self, nodes: list[Node]) -> None:
        t = next(self._clock)
        for n in nodes:
            if n.ref == 0:
                self.num_evictable -= 1
            n.ref += 1
            n.last = t

    def release(self, nodes: list[Node]) -> None:
        t = next(self._clock)
        for n in nodes:
            n.ref -= 1
            assert n.ref >= 0
            if n.ref == 0:
                self.num_evictable += 1
            n.last = t

    def insert(self, parent: Node, key: tuple, page: int) -> tuple[Node, bool]:
        """The child of `parent` for this page of tokens, created with `page` if there is none.
        Returns (node, adopted): adopted means the tree now owns `page`; otherwise the existing node
        (same tokens, computed by another request) is returned and `page` stays with the caller.
        The node is returned with ref 0 counted as evictable: the caller acquires it."""
        node = parent.children.get(key)
        if node is not None:
            return node, False
        node = Node(key, page, parent)
        node.last = next(self._clock)
        parent.children[key] = node
        self.owned[page] = node
        self.num_evictable += 1
        return node, True

    # ---- eviction --------------------------------------------------------------------------------
    def evict(self, count: int) -> int:
        """Free up to `count` pages of unreferenced nodes, least recently used leaves first."""
        if count <= 0 or self.num_evictable == 0:
            return 0
        heap = [(n.last, id(n), n) for n in self.owned.values() if n.ref == 0 and not n.children]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < count:
            _, _, n = heapq.heappop(heap)
            self._remove(n)
            freed += 1
            p = n.parent
            if p is not self.root and p.ref == 0 and not p.children:
                heapq.heappush(heap, (p.last, id(p), p))
        self.evicted_pages += freed
        return freed

    def _remove(self, n: Node) -> None:
        del n.parent.children[n.key]
        del self.owned[n.page]
        self.pages.free([n.page])
        self.num_evictable -= 1
        if n.snap >= 0:
            self.drop_snapshot(n)

    def clear(self) -> None:
        """Drop every unreferenced node (and its snapshot)."""
        self.evict(len(self.owned))

    # ---- snapshots -------------------------------------------------------------------------------
    def alloc_snapshot(self) -> int:
        """A free snapshot slot, dropping the least recently used snapshot if none is free; -1 if the
        model keeps no snapshots or every slot is taken by a snapshot not yet attached (being written)."""
        if not self.free_snaps and not self.snap_nodes:
            return -1
        if not self.free_snaps:
            victim = min(self.snap_nodes, key=lambda n: n.last)
            self.drop_snapshot(victim)
            self.evicted_snaps += 1
        return self.free_snaps.pop()

    def free_snapshot(self, slot: int) -> None:
        self.free_snaps.append(slot)

    def attach_snapshot(self, node: Node, slot: int) -> bool:
        """Give `node` the snapshot in `slot`; False (slot freed) when it already has one."""
        if node.snap >= 0 or node.parent is None or node.page not in self.owned:
            self.free_snaps.append(slot)
            return False
        node.snap = slot
        self.snap_nodes[node] = None
        return True

    def drop_snapshot(self, node: Node) -> None:
        if node.snap >= 0:
            self.free_snaps.append(node.snap)
            node.snap = -1
            self.snap_nodes.pop(node, None)

    # ---- state -----------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return len(self.owned)

    def stats(self) -> dict:
        return {"pages": len(self.owned), "evictable_pages": self.num_evictable,
                "snapshots": len(self.snap_nodes), "snapshot_slots": self.num_snap_slots,
                "evicted_pages": self.evicted_pages, "evicted_snapshots": self.evicted_snaps}

    def check_integrity(self) -> None:
        seen, evictable, stack = 0, 0, list(self.root.children.values())
        while stack:
            n = stack.pop()
            seen += 1
            assert self.owned.get(n.page) is n
            assert n.parent.children[n.key] is n
            evictable += n.ref == 0
            for c in n.children.values():
                assert c.ref <= n.ref, "a child is referenced more than its parent"
                stack.append(c)
            assert (n.snap >= 0) == (n in self.snap_nodes)
        assert seen == len(self.owned)
        assert evictable == self.num_evictable, (evictable, self.num_evictable)
        assert len(self.snap_nodes) + len(self.free_snaps) == self.num_snap_slots
        assert not ({n.snap for n in self.snap_nodes} & set(self.free_snaps))

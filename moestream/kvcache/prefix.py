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

Host tier (--prefix-cache-host-gb): with host slots, an evicted page is spilled (copied to a host page,
its device page freed) instead of dropped, and an evicted snapshot likewise; the node stays in the tree
(`page` -1, `host` its host page) and a hit fetches it back into a fresh device page instead of recomputing
it. Spilled nodes are closed downward (a node is spilled only when no child is on the device), so along a
path they are a suffix. When the host slots are full, the least recently used unreferenced host leaf
(or host snapshot) is dropped. The copies are queued in `host_ops` in the order they were decided and run
in that order before the next forward pass (so a host page freed by a fetch and refilled by a spill, or a
device page freed by a spill and refilled by a fetch, is read before it is overwritten).

Models with Gated DeltaNet layers cannot cut their recurrent state at an arbitrary token: a node may
carry a snapshot (a slot of the state pool holding the conv and recurrent state after the node's last
token), and for those models only nodes with a snapshot can be resumed from. Snapshots have their own
LRU over a fixed number of slots; dropping one never touches pages.

A request whose tokens leave the cached path inside a page (a branch, or the limit of all but its last
token) copies the shared head of that page into a page of its own (copy-on-write, attention-only models).

Bookkeeping only (no tensors): the scheduler decides the KV-head and state copies (ScheduledBatch) and
the engine runs them from the ForwardBatch.
"""
from __future__ import annotations

import heapq
import itertools

from .pools import PagePool


class Node:
    __slots__ = ("key", "page", "parent", "children", "ref", "last", "snap", "depth", "host", "hsnap")

    def __init__(self, key, page: int, parent: "Node | None"):
        self.key = key
        self.page = page
        self.parent = parent
        self.children: dict[tuple, Node] = {}
        self.ref = 0
        self.last = 0
        self.snap = -1  # state-pool slot with the linear state after this node's last token, -1: none
        self.host = -1  # host page holding this node's K/V while it is spilled (page is then -1)
        self.hsnap = -1  # host snapshot slot with the same state as `snap` would hold, -1: none
        self.depth = 0 if parent is None else parent.depth + 1  # pages from the root, this one included


class PrefixCache:
    def __init__(self, pages: PagePool, page_size: int, needs_snapshot: bool = False,
                 snap_slots: list[int] | None = None, host_pages: int = 0, host_snaps: int = 0):
        """pages: the KV pool's page allocator (shared with the scheduler); needs_snapshot: the model has
        linear-state layers, so only nodes with a snapshot are resumable; snap_slots: state-pool slots
        reserved for snapshots; host_pages, host_snaps: slots of the host tier (kvcache.HostPool)."""
        self.pages = pages
        self.page_size = page_size
        self.root = Node(None, -1, None)
        self.owned: dict[int, Node] = {}  # page id -> its node
        self.num_evictable = 0  # nodes with ref 0
        self.needs_snapshot = needs_snapshot
        self.free_snaps: list[int] = list(reversed(snap_slots or []))
        self.num_snap_slots = len(snap_slots or [])
        self.snap_nodes: dict[Node, None] = {}  # nodes holding a snapshot
        self.host_free = list(range(host_pages - 1, -1, -1))
        self.num_host_pages = host_pages
        self.spilled: dict[int, Node] = {}  # host page -> its node
        self.host_snap_free = list(range(host_snaps - 1, -1, -1))
        self.num_host_snaps = host_snaps
        self.host_snap_nodes: dict[Node, None] = {}  # nodes holding a host snapshot
        # (op, src, dst) in decision order: kv_out page -> host page, kv_in host page -> page,
        # state_out state slot -> host snapshot, state_in host snapshot -> state slot
        self.host_ops: list[tuple[str, int, int]] = []
        self._host_heap: list | None = None  # during evict(): droppable host leaves (heap by last use)
        self._clock = itertools.count(1)
        # counters for stats
        self.evicted_pages = 0
        self.evicted_snaps = 0
        self.spilled_pages = self.fetched_pages = self.spilled_snaps = self.fetched_snaps = 0

    # ---- lookup ----------------------------------------------------------------------------------
    def match(self, ids: list[int], max_tokens: int) -> list[Node]:
        """The longest cached path of full pages within ids[:max_tokens] that can be resumed from
        (for linear-state models: ending at a node with a snapshot). Does not take references."""
        path = self.match_pages(ids, max_tokens)
        if self.needs_snapshot:
            while path and path[-1].snap < 0 and path[-1].hsnap < 0:
                path.pop()
        return path

    def match_pages(self, ids: list[int], max_tokens: int) -> list[Node]:
        """The longest cached path of full pages within ids[:max_tokens], snapshots or not."""
        P = self.page_size
        node, path = self.root, []
        for i in range(max_tokens // P):
            child = node.children.get(tuple(ids[i * P:(i + 1) * P]))
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def match_partial(self, parent: Node, ids: list[int], start: int, max_tokens: int) -> tuple[Node | None, int]:
        """The child of `parent` whose page shares the longest run of ids[start:max_tokens] (a prefix that
        ends inside that page), and the run's length; (None, 0) when none shares a token. Attention KV
        only: a linear-state model cannot resume inside a page (its snapshots sit at page ends)."""
        want = ids[start:max_tokens][:self.page_size]
        best, best_k = None, 0
        for key, child in parent.children.items():
            if child.page < 0:
                continue  # spilled: its K/V is in host memory
            k = 0
            while k < len(want) and key[k] == want[k]:
                k += 1
            if k > best_k:
                best, best_k = child, k
        return best, best_k

    def acquire(self, nodes: list[Node]) -> None:
        t = next(self._clock)
        for n in nodes:
            if n.ref == 0 and n.page >= 0:
                self.num_evictable -= 1
            n.ref += 1
            n.last = t

    def release(self, nodes: list[Node]) -> None:
        t = next(self._clock)
        for n in nodes:
            n.ref -= 1
            assert n.ref >= 0
            if n.ref == 0 and n.page >= 0:
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
    def evict(self, count: int, spill: bool = True) -> int:
        """Free up to `count` device pages of unreferenced nodes, least recently used leaves (of the device
        part of the tree) first: each is spilled to a host page when the host tier has room, else dropped
        with its spilled descendants."""
        if count <= 0 or self.num_evictable == 0:
            return 0
        heap = [(n.last, id(n), n) for n in self.owned.values() if n.ref == 0 and not self._on_device(n.children)]
        heapq.heapify(heap)
        self._host_heap = None  # the host tier's droppable leaves, gathered once it first runs full
        freed = 0
        while heap and freed < count:
            _, _, n = heapq.heappop(heap)
            p = n.parent
            if not (spill and self._spill(n)):
                self._remove(n)
            freed += 1
            if p is not self.root and p.ref == 0 and not self._on_device(p.children):
                heapq.heappush(heap, (p.last, id(p), p))
        self.evicted_pages += freed
        return freed

    @staticmethod
    def _on_device(children: dict) -> bool:
        return any(c.page >= 0 for c in children.values())

    def _spill(self, n: Node) -> bool:
        """Move n's page to a host page (queued copy); False when the host tier has no room."""
        h = self._host_page()
        if h < 0:
            return False
        self.host_ops.append(("kv_out", n.page, h))
        if n.snap >= 0:
            self._snapshot_out(n)
        del self.owned[n.page]
        self.pages.free([n.page])
        self.num_evictable -= 1
        n.page, n.host = -1, h
        self.spilled[h] = n
        self.spilled_pages += 1
        if not n.children:
            self._host_leaf(n)
        return True

    def _host_page(self) -> int:
        """A free host page, dropping the least recently used unreferenced spilled leaf if none is free;
        -1 if none can be dropped."""
        if not self.host_free:
            if self._host_heap is None:
                self._host_heap = [(m.last, id(m), m) for m in self.spilled.values() if m.ref == 0 and not m.children]
                heapq.heapify(self._host_heap)
            while self._host_heap:
                _, _, m = heapq.heappop(self._host_heap)
                if m.host >= 0 and m.ref == 0 and not m.children:  # still a spilled leaf
                    parent = m.parent
                    self._remove(m)
                    self._host_leaf(parent)
                    break
            else:
                return -1
        return self.host_free.pop()

    def _host_leaf(self, n: Node) -> None:
        """n may have become a droppable host leaf: a candidate of this eviction's host heap."""
        if self._host_heap is not None and n is not self.root and n.page < 0 and n.ref == 0 and not n.children:
            heapq.heappush(self._host_heap, (n.last, id(n), n))

    def fetch(self, node: Node, page: int) -> None:
        """Bring a spilled node (held by the caller) back into device page `page`, which the tree now owns;
        its ancestors must be on the device already (fetch a path from the top)."""
        assert node.page < 0 <= node.host and node.ref > 0 and (node.parent is self.root or node.parent.page >= 0)
        self.host_ops.append(("kv_in", node.host, page))
        self._onto_device(node, page)
        self.fetched_pages += 1

    def adopt(self, node: Node, page: int) -> None:
        """A spilled node's tokens were computed again into device page `page`: the node takes that page (the
        tree owns it now) and its host copy is dropped."""
        assert node.page < 0 <= node.host
        self._onto_device(node, page)
        if node.ref == 0:
            self.num_evictable += 1

    def _onto_device(self, node: Node, page: int) -> None:
        """A spilled node now lives in device page `page`, which the tree owns; its host page is free."""
        del self.spilled[node.host]
        self.host_free.append(node.host)
        node.host, node.page = -1, page
        self.owned[page] = node

    def _remove(self, n: Node) -> None:
        """Drop n and its subtree (unreferenced; below a device leaf only spilled nodes)."""
        for c in list(n.children.values()):
            self._remove(c)
        del n.parent.children[n.key]
        if n.page >= 0:
            del self.owned[n.page]
            self.pages.free([n.page])
            self.num_evictable -= 1
        else:
            del self.spilled[n.host]
            self.host_free.append(n.host)
            n.host = -1
        self.drop_snapshot(n)
        self._drop_host_snapshot(n)

    def renumber(self, page_map: dict[int, int]) -> None:
        """The KV pool was resized: every page this tree owns now has the id page_map gives it."""
        self.owned = {page_map[p]: n for p, n in self.owned.items()}
        for p, n in self.owned.items():
            n.page = p

    def clear(self) -> None:
        """Drop every unreferenced node (and its snapshots), the host tier's too."""
        self.evict(len(self.owned), spill=False)
        for n in [n for n in self.spilled.values() if n.ref == 0 and (n.parent is self.root or n.parent.page >= 0)]:
            self._remove(n)  # the top of a spilled subtree, and with it the subtree

    # ---- snapshots -------------------------------------------------------------------------------
    def alloc_snapshot(self) -> int:
        """A free snapshot slot, moving the least recently used snapshot out if none is free (to the host
        tier when it has room); -1 if the model keeps no snapshots or every slot is taken by a snapshot not
        yet attached (being written)."""
        if not self.free_snaps and not self.snap_nodes:
            return -1
        if not self.free_snaps:
            self._snapshot_out(min(self.snap_nodes, key=lambda n: n.last))
            self.evicted_snaps += 1
        return self.free_snaps.pop()

    def _snapshot_out(self, n: Node) -> None:
        """Free n's device snapshot slot, keeping its state in the host tier if it has room."""
        if n.hsnap < 0:
            if not self.host_snap_free and self.host_snap_nodes:  # full: drop the least recently used
                self._drop_host_snapshot(min(self.host_snap_nodes, key=lambda m: m.last))
            h = self.host_snap_free.pop() if self.host_snap_free else -1
            if h >= 0:
                self.host_ops.append(("state_out", n.snap, h))
                n.hsnap = h
                self.host_snap_nodes[n] = None
                self.spilled_snaps += 1
        self.drop_snapshot(n)

    def load_host_snapshot(self, node: Node, slot: int) -> None:
        """Queue the copy of node's host snapshot into state slot `slot` (a request resuming there)."""
        self.host_ops.append(("state_in", node.hsnap, slot))
        self.fetched_snaps += 1

    def _drop_host_snapshot(self, node: Node) -> None:
        if node.hsnap >= 0:
            self.host_snap_free.append(node.hsnap)
            node.hsnap = -1
            self.host_snap_nodes.pop(node, None)

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
                "evicted_pages": self.evicted_pages, "evicted_snapshots": self.evicted_snaps,
                "host_pages": len(self.spilled), "host_page_slots": self.num_host_pages,
                "host_snapshots": len(self.host_snap_nodes), "host_snapshot_slots": self.num_host_snaps,
                "spilled_pages": self.spilled_pages, "fetched_pages": self.fetched_pages,
                "spilled_snapshots": self.spilled_snaps, "fetched_snapshots": self.fetched_snaps}

    def check_integrity(self) -> None:
        seen, evictable, stack = 0, 0, list(self.root.children.values())
        while stack:
            n = stack.pop()
            seen += 1
            if n.page >= 0:
                assert self.owned.get(n.page) is n and n.host < 0
            else:
                assert self.spilled.get(n.host) is n and n.snap < 0
                assert n.parent is self.root or n.parent.page >= 0 or n.parent.host >= 0
                assert all(c.page < 0 for c in n.children.values()), "spilled nodes are closed downward"
            assert n.parent.children[n.key] is n
            evictable += n.ref == 0 and n.page >= 0
            for c in n.children.values():
                assert c.ref <= n.ref, "a child is referenced more than its parent"
                stack.append(c)
            assert (n.snap >= 0) == (n in self.snap_nodes)
            assert (n.hsnap >= 0) == (n in self.host_snap_nodes)
        assert seen == len(self.owned) + len(self.spilled)
        assert evictable == self.num_evictable, (evictable, self.num_evictable)
        assert len(self.snap_nodes) + len(self.free_snaps) == self.num_snap_slots
        assert not ({n.snap for n in self.snap_nodes} & set(self.free_snaps))
        assert len(self.spilled) + len(self.host_free) == self.num_host_pages
        assert len(self.host_snap_nodes) + len(self.host_snap_free) == self.num_host_snaps

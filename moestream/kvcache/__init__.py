"""Paged KV pool for full-attention layers and the per-request state pool for linear-attention layers."""
from .pools import HostPool, KVPool, StatePool, PagePool, raw
from .prefix import PrefixCache

__all__ = ["HostPool", "KVPool", "StatePool", "PagePool", "PrefixCache", "raw"]

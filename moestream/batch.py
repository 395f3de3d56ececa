"""What one forward pass computes: a flat run of new tokens from several requests.

Tokens of all sequences are concatenated ([T] ids, [T] positions). Each sequence says where its new
tokens sit in that run, how many of its tokens are already in the caches, its linear-attention state
slot and the flat KV-pool index of every one of its positions.

Plain data, the vocabulary shared by layers/, models/ and engine/ (so it ranks below all of them); the
engine's model runner (engine/runner.py) builds it from what the scheduler decided.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class SeqMeta:
    start: int  # offset of this sequence's new tokens in the flat batch
    length: int  # number of new tokens this step (1 for decode)
    cached: int  # tokens of this sequence already in KV / linear state before this step
    state_slot: int  # linear-attention state slot (-1 for models without linear attention)
    kv_index: torch.Tensor  # [cached + length] flat KV-pool index of each position (long, on device)
    # speculative verify: linear-state slots that receive the state after each of the first tokens
    # (checkpoints[i]: after token i), so a rejected draft rolls back by one slot copy
    checkpoints: list[int] | None = None
    # prefix-cache snapshots inside a prefill chunk: (e, slot) = the linear state after the first e
    # (< length) new tokens is written to state slot `slot` during the pass (one at the chunk's end is a
    # ForwardBatch.state_saves copy)
    snapshots: tuple = ()

    @property
    def total(self) -> int:
        return self.cached + self.length


@dataclass
class DecodeArrays:
    """A CPU decode step's indices as one int64 host buffer (engine/runner.py's decode fast path; the compiled
    decode step reads them by address, models/cpu_decode.py), laid out as B token ids, B positions, B KV write
    slots, B linear-state slots, the B logits rows (0..B-1: every row samples), B + 1 offsets of each
    sequence's KV rows, then those rows. The batch's tensors are views of the same memory."""

    buf: np.ndarray
    B: int
    addr: int  # buf's address

    def at(self, field: int) -> int:
        """Address of a field: 0 ids, 1 positions, 2 write slots, 3 state slots, 4 logits rows, 5 offsets, 6 KV rows
        (the last two start after 5 B and 6 B + 1 values)."""
        return self.addr + 8 * (field * self.B + (1 if field == 6 else 0))


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    seqs: list[SeqMeta]
    kv_write_index: torch.Tensor  # [T] flat KV-pool index where each new token's K/V goes
    logits_index: torch.Tensor  # [B'] rows of the flat batch whose logits are needed
    state_slots: torch.Tensor | None = None  # [B] long, the seqs' state slots (decode fast path)
    # linear-state slots zeroed first (requests admitted this step start from an empty state)
    state_resets: list = field(default_factory=list)
    # linear-state slot copies (src, dst) done before / after the forward pass: a prefix-cache hit
    # resumes from a snapshot; a snapshot is saved after the step that reached its page boundary
    state_loads: list = field(default_factory=list)
    state_saves: list = field(default_factory=list)
    # prefix-cache copy-on-write, done before the pass: (src page, dst page, n) copies the K/V of a cached
    # page's first n positions into the request's own page
    kv_copies: list = field(default_factory=list)
    # prefix-cache host tier, done first and in order: (op, src, dst), see kvcache/prefix.py host_ops
    host_copies: list = field(default_factory=list)
    # some sequence computes prompt tokens (a 1-token prompt tail after a cache hit looks like a decode
    # step): CPU steps then take the per-op path, as the prompt's other rows did (not the compiled decode layer)
    prompt: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode(self) -> bool:
        return all(s.length == 1 for s in self.seqs)

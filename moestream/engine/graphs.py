"""Decode steps replayed as CUDA graphs.

A decode step of a 40-layer MoE is ~2,000 small kernels; launched one by one from Python the GPU waits
on the host. When the expert runtime says a step has no host synchronisation (`capturable()`: the pair
kernels and the device-side slot cache), the step is recorded once per (batch size, KV-length bucket)
and replayed: the step's inputs are copied into static buffers, the graph runs, logits come back in a
static buffer that the sampler reads before the next step.

Attention reads its KV positions from a padded index [B, S_bucket] and the lengths (the split-KV kernel of
layers/attn_decode.py; the torch path a validity mask built inside the graph from them), so one graph serves
every length up to its bucket (buckets grow by x1.5
or x1.33: 256, 384, 512, 768, 1024, ...; at most `max_graphs` are kept, least recently used dropped).

Speculative verify steps (--speculative mtp) are decode steps too: `verify_rows` lays a step whose every
request checks its newest token and the same number of drafts out as one decode row per token (row j of a
request attends to its KV up to its own position; the Gated DeltaNet layers take the rows position by
position and write the rollback checkpoints), and the graph of (rows, rows per request, KV bucket) also
keeps the final hidden states the MTP drafter reads (`keep_hidden`).

The first step of a new bucket runs eagerly on the static buffers (its result is used; it also runs
Triton's autotuning and lazy initialisation outside the capture), then the same step is recorded.
If recording fails, graphs are turned off for the engine with a warning and decode stays eager.
"""
from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict

import torch

from ..batch import ForwardBatch, SeqMeta

log = logging.getLogger("moestream.engine")


def kv_bucket(n: int) -> int:
    b = 256
    while b < n:
        b = b * 3 // 2 if b & (b - 1) == 0 else b * 4 // 3
    return b


def decode_extra(batch: ForwardBatch, width: int | None = None) -> dict:
    """Padded KV index [rows, width], validity mask and lengths of a batch laid out as one-token decode rows (on
    the batch's device): row j of a sequence (flat row start + j) attends to its KV up to its own position, cached
    + j + 1 entries. A decode step has one row a sequence; the MTP block's passes over a verify step's few rows a
    request use the same layout (attention only: Engine.draft)."""
    dev = batch.input_ids.device
    rows = [(s.start + j, s.kv_index[:s.cached + j + 1]) for s in batch.seqs for j in range(s.length)]
    lengths = [0] * len(rows)
    for r, kv in rows:
        lengths[r] = kv.shape[0]
    width = width or max(lengths)
    idx = torch.zeros((len(rows), width), dtype=torch.long, device=dev)
    for r, kv in rows:
        idx[r, :kv.shape[0]] = kv
    n = torch.tensor(lengths, device=dev)
    valid = torch.arange(width, device=dev)[None, :] < n[:, None]
    return {"decode_kv_index": idx, "decode_kv_valid": valid, "decode_kv_len": n}


def verify_rows(batch: ForwardBatch) -> ForwardBatch | None:
    """A speculative verify step as a decode step: where every sequence computes the same n > 1 rows (its newest
    token and n - 1 drafts, SeqMeta.checkpoints of n - 1 slots where the model has linear layers) and nothing
    else, the same flat rows as B * n one-token sequences (row j of a request: cached + j tokens before it, its
    KV index up to its own position), with extra `verify_n` = n and `verify_ckpt` [B, n - 1] (the checkpoint
    slots) for the Gated DeltaNet layers, which run the rows position by position. Ids, positions, KV writes,
    logits rows and the state copies are the batch's own. None for any other step."""
    seqs = batch.seqs
    n = seqs[0].length if seqs else 0
    if batch.prompt or n < 2 or any(s.length != n or s.snapshots for s in seqs):
        return None
    ckpt = [s.checkpoints or [] for s in seqs]
    if any(len(c) != len(ckpt[0]) for c in ckpt) or len(ckpt[0]) not in (0, n - 1):
        return None
    dev = batch.input_ids.device
    rows = [SeqMeta(start=s.start + j, length=1, cached=s.cached + j, state_slot=s.state_slot,
                    kv_index=s.kv_index[:s.cached + j + 1]) for s in seqs for j in range(n)]
    extra = {**batch.extra, "verify_n": n}
    if ckpt[0]:
        extra["verify_ckpt"] = torch.tensor(ckpt, dtype=torch.long, device=dev)
    return dataclasses.replace(batch, seqs=rows, extra=extra,
                               state_slots=torch.tensor([r.state_slot for r in rows], dtype=torch.long, device=dev))


class _Entry:
    """Static inputs and the recorded graph of one (rows, rows per request n, KV bucket, hidden kept): n > 1 is a
    verify step's layout (verify_rows), whose checkpoint slots are an input too; `hidden` (keep_hidden) keeps
    every row's final hidden state (the model's `hidden` after a replay)."""

    def __init__(self, B: int, width: int, device: torch.device, n: int = 1, hidden: bool = False):
        z = lambda *shape: torch.zeros(shape, dtype=torch.long, device=device)  # noqa: E731
        self.input_ids, self.positions, self.write, self.slots, self.lengths = z(B), z(B), z(B), z(B), z(B)
        self.kv_index = z(B, width)
        self.arange = torch.arange(width, device=device)
        self.logits_index = torch.arange(B, device=device)
        self.seqs = [SeqMeta(start=i, length=1, cached=0, state_slot=-1, kv_index=None) for i in range(B)]
        self.n, self.keep_hidden = n, hidden
        self.ckpt = z(B // n, n - 1) if n > 1 else None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None  # keep_hidden: the model's `hidden` of the recorded step

    def fill(self, batch: ForwardBatch) -> None:
        self.input_ids.copy_(batch.input_ids, non_blocking=True)
        self.positions.copy_(batch.positions, non_blocking=True)
        self.write.copy_(batch.kv_write_index, non_blocking=True)
        if batch.state_slots is not None:
            self.slots.copy_(batch.state_slots, non_blocking=True)
        lengths = batch.extra.get("decode_lengths")  # on the device already (runner._build_decode_cuda): no copy
        if lengths is None:  # from pageable memory: waits for the stream's queued work first
            lengths = torch.tensor([s.total for s in batch.seqs])
        self.lengths.copy_(lengths, non_blocking=True)
        for i, s in enumerate(batch.seqs):
            self.kv_index[i, :s.total].copy_(s.kv_index, non_blocking=True)
        if self.ckpt is not None and "verify_ckpt" in batch.extra:
            self.ckpt.copy_(batch.extra["verify_ckpt"], non_blocking=True)

    def batch(self) -> ForwardBatch:
        valid = self.arange[None, :] < self.lengths[:, None]  # recorded: computed on every replay
        extra = {"decode_kv_index": self.kv_index, "decode_kv_valid": valid, "decode_kv_len": self.lengths}
        if self.n > 1:
            extra.update(verify_n=self.n, verify_ckpt=self.ckpt)
        if self.keep_hidden:
            extra["keep_hidden"] = True
        return ForwardBatch(input_ids=self.input_ids, positions=self.positions, seqs=self.seqs,
                            kv_write_index=self.write, logits_index=self.logits_index, state_slots=self.slots,
                            extra=extra)


class DecodeGraphs:
    def __init__(self, engine, max_graphs: int = 24):
        self.engine = engine
        self.max_graphs = max_graphs
        self.entries: OrderedDict[tuple[int, int], _Entry] = OrderedDict()
        self.pool = None
        self.enabled = True
        self.owner = None  # (runtime id, runtime epoch) the recorded graphs belong to
        self.replays = 0
        self.recorded = 0
        self.capture_error = None  # why decode runs eagerly, after a capture failed

    def as_dict(self) -> dict:
        """/v1/stats' `cuda_graphs`: whether decode steps are recorded and replayed, and if not, why (a failed
        capture leaves every later step eager: several times slower, with one warning in the log)."""
        return {"enabled": self.enabled, "recorded": self.recorded, "replays": self.replays,
                "graphs": len(self.entries), "capture_error": self.capture_error}

    def reset(self) -> None:
        """Drop every recorded graph and their memory pool."""
        if self.entries:
            torch.cuda.synchronize(self.engine.device)
        self.entries.clear()
        self.pool = None
        torch.cuda.empty_cache()

    def usable(self, batch: ForwardBatch) -> bool:
        rt = self.engine.runtime
        tap = rt.tap  # a routing recorder reads every layer call's ids on the host: no graphs
        return self.enabled and batch.is_decode and rt.capturable() and (tap is None or tap.capturable)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        rt = self.engine.runtime
        owner = (id(rt), getattr(rt, "epoch", 0))
        if owner != self.owner:  # a new runtime or a resized cache: recorded pointers are stale
            self.reset()
            self.owner = owner
        B = len(batch.seqs)
        n, hidden = batch.extra.get("verify_n", 1), bool(batch.extra.get("keep_hidden"))
        key = (B, kv_bucket(max(s.total for s in batch.seqs)), n, hidden, rt.graph_variant())
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = _Entry(B, key[1], self.engine.device, n, hidden)
            while len(self.entries) > self.max_graphs:
                self.entries.popitem(last=False)
        self.entries.move_to_end(key)
        entry.fill(batch)
        if entry.graph is not None:
            entry.graph.replay()
            self.replays += 1
            rt.count_replay(B, self.engine.cfg.top_k)
            if entry.keep_hidden:
                self.engine.model.hidden = entry.hidden
            return entry.out
        out = self._step(entry)  # this step's real result, computed eagerly
        hidden = self.engine.model.hidden
        self._record(entry, key)
        self.engine.model.hidden = hidden  # the eager step's (recording overwrote the model's)
        return out

    def _step(self, entry: _Entry) -> torch.Tensor:
        rt = self.engine.runtime
        rt.begin_graph_step()
        out = self.engine.model(entry.batch())
        rt.end_graph_step()
        return out

    def _record(self, entry: _Entry, key) -> None:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            torch.cuda.synchronize(self.engine.device)
            with torch.cuda.graph(graph, pool=self.pool):
                entry.out = self._step(entry)
                entry.hidden = self.engine.model.hidden if entry.keep_hidden else None
        except Exception as exc:  # an op that needs the host: decode stays eager from now on
            self.enabled = False
            self.capture_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
            self.reset()
            log.warning("CUDA graph capture failed (%s: %s); decode runs eagerly", type(exc).__name__, exc)
            return
        entry.graph = graph
        self.recorded += 1
        log.debug("recorded a decode graph for %d rows, KV bucket %d, %d rows a request, hidden kept %s, variant %d",
                  *key)

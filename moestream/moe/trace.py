"""Routing traces: the expert ids of every (token, MoE layer) of a run, written as the engine runs.

File format (little-endian, docs/routing-traces.md):

    b"MSROUTE1"                     8 bytes, magic + format version 1
    header_len  uint32              then header_len bytes of UTF-8 JSON (TraceHeader)
    records, one per forward step, appended as the steps finish:
        flags   uint8               bit 0: a decode step (every row decodes one token);
                                    bit 1: predictions follow the ids
        rows    uint32              T, the tokens of the step
        ids     uint16[L][T][k]     L = len(moe_layers), layer-major, each row's top-k in router order
        pred    uint16[L][T][k]     (bit 1) at layer i, the top-k of MoE layer i+1's router applied to layer
                                    i's input: what the decode prefetcher predicts (last layer: zeros)

A file cut short (the process was killed while writing) reads up to its last whole record.

`RoutingRecorder` is an `ExpertRuntime.tap` that writes the file (with predictions); `RouteForcer` is a tap that replaces
the router's top-k with a trace's ids, step by step (benchmarks under locality); both see every layer
call through `ExpertRuntime.routed`.
"""
from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..core import ConfigError

MAGIC = b"MSROUTE1"
_REC = struct.Struct("<BI")


@dataclass(frozen=True)
class TraceHeader:
    model: str
    num_layers: int  # all decoder layers of the model
    moe_layers: list[int]  # the layers whose ids are recorded, in file order
    num_experts: int
    top_k: int
    bytes_per_expert: int = 0  # one expert's weights as stored (what a miss moves over PCIe); 0: unknown
    source: str = "engine"  # engine | synthetic
    params: dict = field(default_factory=dict)  # the synthetic generator's parameters

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()


@dataclass
class Trace:
    """A whole trace in memory: ids [N, L, k] uint16 of all rows of all steps, the rows and the decode
    flag of each step."""

    header: TraceHeader
    ids: np.ndarray
    step_rows: np.ndarray  # int64 [steps]
    step_decode: np.ndarray  # bool [steps]
    pred: np.ndarray | None = None  # [N, L, k] the prefetcher's predictions (recorded traces), or None

    @property
    def starts(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.step_rows)])

    def steps(self, decode_only: bool = False, with_pred: bool = False):
        """(decode, ids [T, L, k]) per step, in order; with_pred: (decode, ids, pred [T, L, k] or None)."""
        s = self.starts
        for i, dec in enumerate(self.step_decode):
            if dec or not decode_only:
                ids = self.ids[s[i]:s[i + 1]]
                if with_pred:
                    yield bool(dec), ids, None if self.pred is None else self.pred[s[i]:s[i + 1]]
                else:
                    yield bool(dec), ids

    @property
    def decode_tokens(self) -> int:
        return int(self.step_rows[self.step_decode].sum())


class TraceWriter:
    def __init__(self, path: str | Path, header: TraceHeader):
        self.header = header
        self.f = open(path, "wb")
        blob = header.to_json()
        self.f.write(MAGIC + struct.pack("<I", len(blob)) + blob)
        self.f.flush()

    def write_step(self, decode: bool, ids: np.ndarray, pred: np.ndarray | None = None) -> None:
        """ids [L, T, k] of one step (and the predictions, the same shape)."""
        L, T, k = ids.shape
        if L != len(self.header.moe_layers) or k != self.header.top_k or (pred is not None and pred.shape != ids.shape):
            raise ValueError(f"step ids of shape {ids.shape} do not match the header ({len(self.header.moe_layers)} "
                             f"layers, top-{self.header.top_k})")
        blob = np.ascontiguousarray(ids, dtype="<u2").tobytes()
        if pred is not None:
            blob += np.ascontiguousarray(pred, dtype="<u2").tobytes()
        self.f.write(_REC.pack((1 if decode else 0) | (2 if pred is not None else 0), T) + blob)
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def write_trace(path: str | Path, trace: Trace) -> None:
    w = TraceWriter(path, trace.header)
    for decode, ids, pred in trace.steps(with_pred=True):
        w.write_step(decode, ids.transpose(1, 0, 2), None if pred is None else pred.transpose(1, 0, 2))
    w.close()


def read_trace(path: str | Path) -> Trace:
    """The trace at path; ConfigError (one line) for a file that is not one."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read routing trace {path}: {e.strerror}") from None
    if data[:8] != MAGIC or len(data) < 12:
        raise ConfigError(f"{path} is not a moestream routing trace (no {MAGIC.decode()} header)")
    (n,) = struct.unpack_from("<I", data, 8)
    try:
        header = TraceHeader(**json.loads(data[12:12 + n]))
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{path}: unreadable trace header: {e}") from None
    L, k, pos = len(header.moe_layers), header.top_k, 12 + n
    chunks, preds, rows, decode = [], [], [], []
    block = lambda at, T: np.frombuffer(data, dtype="<u2", count=L * T * k, offset=at).reshape(L, T, k).transpose(1, 0, 2)  # noqa: E731
    while pos + _REC.size <= len(data):
        flags, T = _REC.unpack_from(data, pos)
        size = 2 * L * T * k
        end = pos + _REC.size + size * (2 if flags & 2 else 1)
        if end > len(data):
            break  # a record cut short by a killed writer
        chunks.append(block(pos + _REC.size, T))
        preds.append(block(pos + _REC.size + size, T) if flags & 2 else None)
        rows.append(T)
        decode.append(bool(flags & 1))
        pos = end
    ids = np.concatenate(chunks) if chunks else np.zeros((0, L, k), dtype=np.uint16)
    if ids.size and int(ids.max()) >= header.num_experts:
        raise ConfigError(f"{path}: expert id {int(ids.max())} >= num_experts {header.num_experts}")
    pred = np.concatenate(preds).astype(np.uint16) if preds and all(p is not None for p in preds) else None
    return Trace(header, ids.astype(np.uint16), np.array(rows, dtype=np.int64), np.array(decode, dtype=bool), pred)


class RoutingRecorder:
    """ExpertRuntime tap: keeps each layer call's ids, and the next MoE layer's router top-k on this layer's
    input (the decode prefetcher's prediction), on their device during a step, and writes the step at its
    end (one device read per step). Recording turns CUDA graphs off (`capturable`), so every layer call
    passes through `routed`."""

    capturable = False

    def __init__(self, path: str | Path, model: str, num_layers: int, top_k: int):
        self.path, self.model, self.num_layers, self.top_k = Path(path), model, num_layers, top_k
        self.writer: TraceWriter | None = None
        self.step: list[torch.Tensor] = []
        self.pred: list[torch.Tensor] = []
        self.decode = False
        self.runtime = None

    def bind(self, runtime) -> None:
        """Called for each runtime the engine builds: the header is written for the first one."""
        self.runtime = runtime
        if self.writer is not None:
            return
        store = runtime.store
        layers = list(store.moe_layers)
        self.header = TraceHeader(model=self.model, num_layers=self.num_layers, moe_layers=layers,
                                  num_experts=store.num_experts, top_k=self.top_k,
                                  bytes_per_expert=store.bytes_per_expert(layers[0]) if layers else 0)
        try:
            self.writer = TraceWriter(self.path, self.header)
        except OSError as e:
            raise ConfigError(f"cannot write --record-routing {self.path}: {e.strerror}") from None

    def begin_step(self, info: dict) -> None:
        self.step, self.pred = [], []
        self.decode = bool(info.get("decode", True))

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        self.step.append(ids.detach().to(torch.int32).clone())
        rt = self.runtime
        nxt = rt.next_layer.get(layer)
        router = rt.routers.get(nxt) if nxt is not None else None
        self.pred.append(router(x)[0].detach().to(torch.int32) if router is not None else torch.zeros_like(self.step[-1]))
        return ids

    def end_step(self) -> None:
        if not self.step:
            return
        ids = torch.stack(self.step).cpu().numpy()  # [L, T, k]
        pred = torch.stack(self.pred).cpu().numpy()
        self.step, self.pred = [], []
        self.writer.write_step(self.decode, ids, pred)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class RouteForcer:
    """ExpertRuntime tap that replaces each decode layer call's top-k ids with trace rows (prefill keeps the
    router's). The trace's decode steps are R streams when they all have R rows (a synthetic trace of
    --batch R), else one stream of all rows. Engine decode step i with T rows gives row j the trace's
    stream j % R at trace step i + (j // R) * stride (stride = steps / ceil(T / R): rows beyond R read far
    apart, as independent requests would), wrapping at the end. The ids live in one device buffer filled
    before each step, so recorded CUDA graphs read the new rows.

    by_position: a row's ids follow its token instead of the step count: the row of request s at position p reads
    stream s % R at trace step p + (s // R) * stride (stride = steps / ceil(streams / R)), s being the request's
    stream number: the lowest number no other running request holds, given at the first decode step that shows
    the request (its linear-state slot identifies it; else its place in the batch), released once a decode step
    goes without it or a prompt step shows its slot computing a prompt (more than one row, or from position 0: a
    new request in that slot). The slot itself is no identity: which free slot a request gets depends on the
    order earlier requests finished in (a speculative run after a plain one got its two requests' slots swapped).
    So a step of several rows of one request (a speculative verify step: the newest token and its drafts) reads
    consecutive trace steps, and a token is routed alike whichever step
    computes it: with and without speculation the same tokens route to the same experts. MTP drafter passes keep
    the router's choice, unless the trace has their layer (a synthetic trace made for the main and the MTP layers):
    then by_position routes a pass's rows from it too, by the positions the pass computes."""

    capturable = True

    def __init__(self, trace: Trace, device: torch.device, max_rows: int, by_position: bool = False,
                 streams: int | None = None):
        if not trace.decode_tokens:
            raise ConfigError("the routing trace has no decode steps to force")
        self.trace = trace
        steps = [ids for _, ids in trace.steps(decode_only=True)]
        if len({len(x) for x in steps}) == 1:
            self.grid = np.stack(steps)  # [steps, R, L, k]
        else:
            self.grid = np.concatenate(steps)[:, None]  # one stream
        self.layer_index = {layer: i for i, layer in enumerate(trace.header.moe_layers)}
        L, k = len(self.layer_index), trace.header.top_k
        self.buf = torch.zeros(L, max_rows, k, dtype=torch.long, device=device)
        # staged in pinned memory on CUDA, copied without a host wait: the next step writes it only after
        # sampling waited for this step's GPU work, which the copy precedes
        self.host = torch.zeros(L, max_rows, k, dtype=torch.long, pin_memory=device.type == "cuda")
        self.pos = 0
        self.T = 0
        self.by_position = by_position
        self.streams = max(int(streams or max_rows), 1)  # requests spread over the trace (by_position)
        self._stream_of: dict[int, int] = {}  # running request (its state slot) -> stream number (by_position)

    def bind(self, runtime) -> None:
        store = runtime.store
        h = self.trace.header
        draft = getattr(runtime.ctx.lookahead, "draft_layers", frozenset())  # MTP layers: not in a trace of the model
        main = [layer for layer in store.moe_layers if layer not in draft or layer in self.layer_index]
        if main != list(h.moe_layers) or store.num_experts != h.num_experts:
            raise ConfigError(f"the routing trace is for {len(h.moe_layers)} MoE layers x {h.num_experts} experts, the "
                              f"model has {len(store.moe_layers)} x {store.num_experts}")

    def rows_for(self, T: int) -> np.ndarray:
        """The [T, L, k] ids of the next step of T rows (advances the trace by one step)."""
        steps, R = self.grid.shape[:2]
        stride = max(steps // -(-T // R), 1)
        j = np.arange(T)
        out = self.grid[(self.pos + (j // R) * stride) % steps, j % R]
        self.pos = (self.pos + 1) % steps
        return out

    def rows_at(self, streams: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The [T, L, k] ids of rows that are token positions[i] of request streams[i] (by_position)."""
        steps, R = self.grid.shape[:2]
        stride = max(steps // -(-self.streams // R), 1)
        return self.grid[(positions + (streams // R) * stride) % steps, streams % R]

    @staticmethod
    def _key(i: int, q) -> int:
        """What identifies the request of batch row i while it runs: its linear-state slot, else its place."""
        return q.state_slot if q.state_slot is not None and q.state_slot >= 0 else i

    def _positions(self, seqs, main: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """(stream, position) of each row; main: a main decode step, which gives and releases stream numbers (an
        MTP drafter pass only reads them)."""
        keys = [self._key(i, q) for i, q in enumerate(seqs)]
        if main:
            live = set(keys)
            self._stream_of = {k: v for k, v in self._stream_of.items() if k in live}
            for k in keys:
                if k not in self._stream_of:
                    held = set(self._stream_of.values())
                    self._stream_of[k] = next(n for n in range(len(held) + 1) if n not in held)
        streams, pos = [], []
        for i, (k, q) in enumerate(zip(keys, seqs)):
            streams += [self._stream_of.get(k, i)] * q.length
            pos += range(q.cached, q.cached + q.length)
        return np.asarray(streams, dtype=np.int64), np.asarray(pos, dtype=np.int64)

    def begin_step(self, info: dict) -> None:
        self.T = int(info.get("num_tokens", 0))
        if self.by_position and not info.get("decode", True) and info.get("seqs") and not info.get("draft"):
            for i, q in enumerate(info["seqs"]):  # a prompt computed: that slot's next decode is a new request's
                if q.length > 1 or q.cached == 0:
                    self._stream_of.pop(self._key(i, q), None)
        traced_draft = self.by_position and info.get("draft_layer") in self.layer_index
        if not info.get("decode", True) or (info.get("draft") and not traced_draft) or self.T > self.buf.shape[1] \
                or (self.by_position and info.get("seqs") is None):
            self.T = 0  # prefill (and MTP drafter passes): the router's own choice
            return
        rows = self.rows_at(*self._positions(info["seqs"], main=not info.get("draft"))) if self.by_position \
            else self.rows_for(self.T)
        if info.get("draft_rows") is not None:  # the MTP block's experts run for its drafting rows only
            rows = rows[np.asarray(info["draft_rows"], dtype=np.int64)]
            self.T = rows.shape[0]
        self.host[:, :self.T].copy_(torch.from_numpy(rows.transpose(1, 0, 2).astype(np.int64)))
        self.buf[:, :self.T].copy_(self.host[:, :self.T], non_blocking=True)

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        i = self.layer_index.get(layer)
        if not self.T or i is None or ids.shape[0] != self.T or ids.shape[1] != self.buf.shape[2]:
            return ids
        return self.buf[i, :self.T].to(ids.dtype)

    def end_step(self) -> None:
        pass

    def close(self) -> None:
        pass

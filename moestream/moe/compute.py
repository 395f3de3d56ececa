"""Routed-expert computation: `(x, route, weights) -> y`, on the compute device and on CPU threads.

Shapes: x [T, H]; topk_ids, topk_w [T, k]; one expert's arrays gate_up [2I, H], down [H, I] (a
quantized format computes from its compressed rows through `ExpertFormat.expert_mlp`, dequantizing
tile by tile where the rows are). Decode on CUDA uses moe/pairs.py instead (no host sync).

Every placement computes per-expert partial outputs `{expert: [n_e, H]}` wherever the expert's weights
are (slot pool, prefill buffer, device bank or host bank) and `accumulate` sums them into y on the
compute device (CUDA: each token's pairs in k order; CPU: in ascending expert order). On CUDA the experts
of one bank in a supported format are computed by moe/grouped.py's grouped GEMM straight into the layer
call's `groups.pair_out` (their partial is the marker IN_PAIR_OUT); a pair's value does not depend on
which other experts share the call. Same ops on bit-identical weights in the same
order is why every backend gives exactly fused's tokens on one device.

"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..hardware import physical_cores
from .formats import ExpertFormat
from .swiglu import expert_mlp


@dataclass(frozen=True)
class WeightRef:
    """Expert weights at row `index` of every array in `bank` (name -> [N, ...] tensor), stored in
    `fmt` (None: dense gate_up/down); `partial_outputs` computes through `fmt.expert_mlp`."""

    bank: dict
    index: int
    fmt: ExpertFormat | None = None

    def arrays(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense gate_up, down of the expert."""
        return self.bank["gate_up"][self.index], self.bank["down"][self.index]


def host_to_device(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A small host list as a tensor on `device` without waiting for the GPU: `torch.tensor(values, device=cuda)`
    copies synchronously, which waits for every kernel queued on the stream first, so a prefill layer call's
    rounds would each drain the GPU before the next is launched. Staged in pinned memory (torch's caching host
    allocator keeps the block until the copy has run) and copied without blocking."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t if device.type == "cpu" else t.to(device)


@dataclass
class RouteGroups:
    """The (token, k) pairs of one layer call sorted by expert. experts/counts are host lists."""

    experts: list[int]
    counts: list[int]
    rows: torch.Tensor  # [T*k] token row of each pair, grouped by expert
    pos: torch.Tensor  # [T*k] k position of each pair
    starts: list[int]
    # [T*k, H] pair outputs by pair id (t*k + j) written by grouped kernels (compute device, CUDA)
    pair_out: torch.Tensor | None = None
    counts_t: torch.Tensor | None = None  # counts as the device computed them (where the route was)
    pairs_t: torch.Tensor | None = None  # [T*k] pair id of each grouped pair, made by the first grouped call

    @classmethod
    def of(cls, topk_ids: torch.Tensor) -> "RouteGroups":
        flat = topk_ids.flatten()
        order = torch.argsort(flat, stable=True)
        experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
        k = topk_ids.shape[1]
        counts_l = counts.tolist()  # the one host sync of a layer call
        starts = [0]
        for c in counts_l[:-1]:
            starts.append(starts[-1] + c)
        return cls(experts.tolist(), counts_l, order // k, order % k, starts, counts_t=counts)

    def members(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.starts[i]
        return self.rows[s:s + self.counts[i]], self.pos[s:s + self.counts[i]]

    def index(self) -> dict[int, int]:
        return {e: i for i, e in enumerate(self.experts)}

    def to(self, device: torch.device) -> "RouteGroups":
        counts_t = self.counts_t.to(device) if self.counts_t is not None else None
        return RouteGroups(self.experts, self.counts, self.rows.to(device), self.pos.to(device), self.starts,
                           counts_t=counts_t)


def partial_outputs(x: torch.Tensor, topk_w: torch.Tensor, groups: RouteGroups,
                    refs: dict[int, WeightRef]) -> dict[int, torch.Tensor]:
    """w * mlp_e(x rows routed to e) for each expert in refs: on CPU, the GGUF experts (any row count: a
    prefill chunk's as a decode step's) in one compiled call for the layer (moe/cpu_moe.py), the rest by the
    torch grouped loop."""
    where = groups.index()
    out = {}
    if refs and x.device.type == "cpu":
        from .cpu_moe import layer_partials

        out = layer_partials(x, topk_w, groups, refs)
    for e, ref in refs.items():
        if e in out:
            continue
        rows, pos = groups.members(where[e])
        if ref.fmt is not None:  # the format's own SwiGLU: quantized rows are decoded tile by tile
            y = ref.fmt.expert_mlp(x[rows], {name: a[ref.index] for name, a in ref.bank.items()})
        else:
            y = expert_mlp(x[rows], *ref.arrays())
        out[e] = y * topk_w[rows, pos, None]
    return out


class _InPairOut:
    """Partial of an expert computed by grouped_partials: its rows are in `groups.pair_out`."""

    def __repr__(self) -> str:
        return "IN_PAIR_OUT"


IN_PAIR_OUT = _InPairOut()


def accumulate(x: torch.Tensor, groups: RouteGroups, partials: dict[int, torch.Tensor]) -> torch.Tensor:
    """y [T, H]: on CUDA each token's k pair outputs summed in k order in float32 (3 launches, not one
    index_add_ per expert); on CPU partials summed in ascending expert order. Invariant: each routed
    expert exactly once. Deterministic either way: each sum has a fixed order."""
    if sorted(partials) != groups.experts:
        raise RuntimeError(f"expert runtime bug: computed experts {sorted(partials)} != routed {groups.experts}")
    if x.is_cuda or groups.pair_out is not None:
        return _sum_in_k_order(x, groups, partials)
    out = torch.zeros_like(x)
    for i, e in enumerate(groups.experts):
        out.index_add_(0, groups.members(i)[0], partials[e].to(device=out.device, dtype=out.dtype))
    return out


def _sum_in_k_order(x: torch.Tensor, groups: RouteGroups, partials: dict) -> torch.Tensor:
    """Partials not already in groups.pair_out (the loop's, CPU threads') are copied there by pair id."""
    T, H = x.shape
    k = groups.rows.numel() // max(T, 1)
    out = groups.pair_out
    if out is None:
        out = torch.empty((T * k, H), dtype=torch.float32, device=x.device)
    for i, e in enumerate(groups.experts):
        if partials[e] is not IN_PAIR_OUT:
            rows, pos = groups.members(i)
            out.index_copy_(0, (rows * k + pos).to(x.device), partials[e].to(device=x.device, dtype=out.dtype))
    return out.view(T, k, H).sum(1, dtype=torch.float32).to(x.dtype)


def moe_reference(x, topk_ids, topk_w, gate_up, down) -> torch.Tensor:
    """The oracle: all experts from one stacked bank."""
    groups = RouteGroups.of(topk_ids)
    bank = {"gate_up": gate_up, "down": down}
    refs = {e: WeightRef(bank, e) for e in groups.experts}
    return accumulate(x, groups, partial_outputs(x, topk_w, groups, refs))


class DeviceExperts:
    """Grouped computation on the compute device over the slots (or bank rows) a step uses: on CUDA,
    experts of one bank in a supported format go through moe/grouped.py's Triton kernels (two launches
    for all of them), the rest through `partial_outputs`."""

    def compute(self, x, topk_w, groups: RouteGroups, refs: dict[int, WeightRef]) -> dict:
        """{expert: partial [n_e, H] or IN_PAIR_OUT}, for `accumulate`."""
        if refs and grouped_ready(x, refs):
            return grouped_partials(x, topk_w, groups, refs)
        return partial_outputs(x, topk_w, groups, refs)


def grouped_ready(x: torch.Tensor, refs: dict[int, WeightRef]) -> bool:
    """Whether `grouped_partials` computes these refs: CUDA, Triton enabled, one bank and one format."""
    first = next(iter(refs.values()))
    if any(r.bank is not first.bank or r.fmt != first.fmt for r in refs.values()):
        return False
    return grouped_bank_ready(x, first.bank, first.fmt)


def grouped_bank_ready(x: torch.Tensor, bank: dict, fmt) -> bool:
    """Whether moe/grouped.py's kernels compute experts of `bank` (stored in `fmt`) for x: CUDA, Triton enabled."""
    if x.device.type != "cuda":
        return False
    from ..env import triton_enabled

    if not triton_enabled():
        return False
    try:
        from . import grouped
    except ImportError:  # triton is optional
        return False
    return grouped.bank_supported(bank, fmt, x)


def grouped_partials(x, topk_w, groups: RouteGroups, refs: dict[int, WeightRef]) -> dict:
    """`partial_outputs` by moe/grouped.py: the pairs of refs' experts in one grouped GEMM, written by
    pair id into groups.pair_out (made by the first call of a layer call, shared by the next ones); each
    expert's partial is the marker IN_PAIR_OUT (no per-expert tensor: 256 slices cost ~1 ms of host time)."""
    from .grouped import grouped_pairs

    ref = next(iter(refs.values()))
    dev = x.device
    k = topk_w.shape[1]
    if groups.pair_out is None:  # the dtype of the loop's partials (y * topk_w)
        dtype = torch.promote_types(x.dtype, topk_w.dtype)
        groups.pair_out = torch.empty((x.shape[0] * k, x.shape[1]), dtype=dtype, device=dev)
    # no host -> device copy that waits for the GPU: the counts are the route's own device tensor, the pair ids
    # are made once a layer call, only the rows of this call's experts cross (a prefill half's round each)
    counts = groups.counts_t if groups.counts_t is not None and groups.counts_t.device == dev else \
        host_to_device(groups.counts, dev)
    if groups.pairs_t is None or groups.pairs_t.device != dev:
        groups.pairs_t = (groups.rows * k + groups.pos).to(dev)
    rows = host_to_device([refs[e].index if e in refs else -1 for e in groups.experts], dev)
    pairs = groups.pairs_t
    grouped_pairs(x, topk_w, pairs, counts, rows, ref.bank, ref.fmt, scatter=True, out=groups.pair_out,
                  max_count=max(groups.counts))
    return dict.fromkeys(refs, IN_PAIR_OUT)


class CpuExperts:
    """Experts computed by CPU threads straight from the host banks (no copies of the weights).

    One worker thread runs the torch ops (which release the GIL), so the caller keeps issuing
    device work while the CPU computes; torch's intra-op pool gives the `threads` cores. A C++/ISA
    kernel can replace `_run` without changing callers.
    """

    def __init__(self, threads: int):
        self.threads = threads or physical_cores()
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)  # process-wide: torch has one intra-op pool
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moestream-cpu-experts")

    def submit(self, x: torch.Tensor, topk_w: torch.Tensor, groups: RouteGroups,
               refs: dict[int, WeightRef], inline: bool = False) -> Future:
        """x/topk_w on any device; returns a future of {expert: partial on CPU}. inline: computed on the
        calling thread (a caller that would wait at once: no hand-off to the worker thread)."""
        if not refs or inline:
            done: Future = Future()
            done.set_result(self._run(x.to("cpu"), topk_w.to("cpu"), groups.to(torch.device("cpu")), refs)
                            if refs else {})
            return done
        x_h, w_h, g_h = x.to("cpu"), topk_w.to("cpu"), groups.to(torch.device("cpu"))
        return self._pool.submit(self._run, x_h, w_h, g_h, refs)

    @staticmethod
    def _run(x, topk_w, groups, refs):
        with torch.inference_mode():
            return partial_outputs(x, topk_w, groups, refs)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

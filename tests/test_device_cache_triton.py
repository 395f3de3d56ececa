"""moestream.moe.device_cache.route_triton: the single-kernel `route` equals the torch reference
(`DeviceSlotCache._route_torch`) bit for bit, in every output and every state tensor, call after call.

* Interpreter: all cases run once, in a subprocess with TRITON_INTERPRET=1 (set before triton is
  imported), on CPU tensors; each case is then reported as its own test. Needs only `triton`.
* CUDA: the same cases through the real wiring (`route` on CUDA tensors takes the kernel), a realistic
  E=256 case, and `route` recorded in a CUDA graph and replayed; skipped without a GPU.

Run as a script (`python tests/test_device_cache_triton.py --worker OUT.json`) it is the interpreter worker.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the worker runs as a script: find moestream
sys.path.insert(0, str(Path(__file__).resolve().parent))
from moestream.moe.device_cache import DeviceSlotCache, live_share  # noqa: E402
from triton_harness import (HAS_TRITON, assert_case, compile_sm90, frame_bytes, interpreted_results,  # noqa: E402
                            write_case_results)
from moestream.layers import triton_ops  # noqa: E402

# name -> (slots, E, T, k, layers, max_pairs, steps[, fetch fraction (hybrid: the other misses are the CPU's)])
CASES = {
    "spill": (3, 16, 2, 4, [0, 2, 5], 8, 20),  # fewer victims than distinct misses: scratch rows
    "no-victims": (0, 16, 2, 3, [0, 1], 6, 8),  # num_slots = 0: nothing is admitted
    "no-scratch": (0, 8, 1, 2, [3], 0, 4),  # max_pairs = 0: no victims and M = 0
    "large": (200, 32, 3, 4, [0, 1, 2], 12, 20),  # every key fits: no evictions
    "evict": (20, 64, 4, 8, [0, 1, 2, 3], 32, 20),
    "hot": (6, 24, 6, 4, [1, 4], 24, 25),  # a few hot experts in most tokens
    "repeats": (5, 12, 3, 4, [0, 1], 12, 20),  # ids drawn with replacement: repeats within a token too
    "hybrid": (10, 32, 3, 4, [0, 1, 2], 12, 20, 0.6),
    "hybrid-spill": (2, 16, 2, 4, [0, 2], 8, 20, 0.35),
    "hybrid-no-victims": (0, 16, 2, 3, [0, 1], 6, 8, 0.5),
    # hybrid's live share (moe/share.py): the route under test reads [fraction, fixed cost] from a float32
    # device tensor; with no fixed cost the reference gets the fraction as a float (the two forms agree)
    "hybrid-live": (10, 32, 3, 4, [0, 1, 2], 12, 20, 0.6, "live"),
    "hybrid-live-third": (4, 16, 2, 4, [0, 2], 8, 20, 1 / 3, "live"),
    # a CPU call's fixed cost: few misses all fetched, more split later than the bandwidths alone would
    "hybrid-live-fixed": (10, 32, 3, 4, [0, 1, 2], 12, 20, 0.6, "live", 1.3),
    # lookahead prefetch (--moe-prefetch on): after each call but a step's last, the next layer's predicted experts
    # (half of them its coming route's, so prefetches hit) are admitted; victims read in the step are passed over
    "prefetch": (12, 32, 2, 4, [0, 1, 2], 8, 20, 1.0, "prefetch"),
    "prefetch-tight": (3, 16, 2, 4, [0, 2, 5], 8, 20, 1.0, "prefetch"),  # victims run out: predictions dropped
    "prefetch-hybrid": (10, 32, 3, 4, [0, 1, 2], 12, 20, 0.6, "prefetch"),
    "prefetch-no-victims": (0, 16, 2, 3, [0, 1], 6, 8, 1.0, "prefetch"),
}
STATE = ("table", "slot_key", "last_use", "victims", "vptr", "stamp", "counters", "expert_hits", "last_cpu",
         "pf_stamp")


def make_ids(case: str, E: int, T: int, k: int, g: torch.Generator) -> torch.Tensor:
    if case == "repeats":
        return torch.randint(0, E, (T, k), generator=g)
    if case == "hot":
        hot = torch.randperm(E, generator=g)[:k + 2]
        return torch.stack([hot[torch.randperm(k + 2, generator=g)[:k]] if bool(torch.rand(1, generator=g) < 0.7)
                            else torch.randperm(E, generator=g)[:k] for _ in range(T)])
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])


def compare(ref: DeviceSlotCache, got: DeviceSlotCache, out_ref, out_got) -> list[str]:
    errs = []
    for name, a, b in zip(("src", "order", "rows", "count"), out_ref, out_got):
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
            errs.append(f"{name}: {b.tolist()} != {a.tolist()}")
    for name in STATE:
        a, b = getattr(ref, name), getattr(got, name)
        if name in ("table", "slot_key", "last_use"):  # the trailing element is a dummy scatter target
            a, b = a[:-1], b[:-1]
        if not torch.equal(a, b):
            errs.append(f"{name}: {b.tolist()} != {a.tolist()}")
    return errs


def compare_prefetch(ref: DeviceSlotCache, got: DeviceSlotCache, out_ref, out_got) -> list[str]:
    """The admitted (expert, row) list in order (entries past count are unspecified) and every state tensor."""
    n = int(out_ref[2])
    errs = [] if int(out_got[2]) == n else [f"count: {int(out_got[2])} != {n}"]
    for name, a, b in zip(("experts", "rows"), out_ref[:2], out_got[:2]):
        if not errs and not torch.equal(a[:n], b[:n]):
            errs.append(f"{name}: {b[:n].tolist()} != {a[:n].tolist()}")
    return errs + compare(ref, got, (), ())


def run_case(case: str, route, device: str = "cpu", spec=None, prefetch=None) -> list[str]:
    """Drive two caches with the same ids: one by the torch reference, one by `route(cache, layer, ids)` (and
    `prefetch(cache, layer, ids)` in the prefetch cases)."""
    slots, E, T, k, layers, max_pairs, steps, *rest = spec or CASES[case]
    frac = rest[0] if rest else 1.0
    fixed = rest[2] if len(rest) > 2 else 0.0
    dev = torch.device(device)
    live = live_share(frac, fixed, dev) if "live" in rest else None
    pf = "prefetch" in rest
    if pf and prefetch is None:
        prefetch = lambda cache, layer, ids: cache.prefetch(layer, ids)  # noqa: E731
    ref, got = (DeviceSlotCache(slots, layers, E, max_pairs, dev, prefetch=pf) for _ in range(2))
    g = torch.Generator().manual_seed(len(case) * 1000 + slots)
    coming = None  # the prefetch cases draw each call's ids one call ahead
    for step in range(steps):
        ref.begin_step()
        got.begin_step()
        calls = list(layers) + ([layers[0]] if step % 7 == 3 else [])  # a layer called twice in a step
        for j, layer in enumerate(calls):
            ids = coming if coming is not None else make_ids(case, E, max(1, T - step % 2), k, g).to(dev)
            coming = None
            if pf and j + 1 < len(calls) and calls[j + 1] != layer:
                coming = make_ids(case, E, max(1, T - step % 2), k, g).to(dev)
                # half a prediction right (the coming route's first experts), half not
                guess = torch.cat([coming.reshape(-1)[:coming.numel() // 2],
                                   make_ids(case, E, 1, coming.numel() - coming.numel() // 2, g).to(dev).reshape(-1)])
            want = ref._route_torch(layer, ids, frac if not fixed else live)
            errs = compare(ref, got, want, route(got, layer, ids, frac if live is None else live))
            if frac < 1 and not errs:  # the CPU's misses: no row, after the fetched ones, not admitted
                cpu = want[0] < 0
                resident = set(ref.resident_rows(layer))
                assert not (set(ids.reshape(-1)[cpu].tolist()) & resident)
            if errs:
                return [f"step {step} layer {layer}: " + "; ".join(errs)]
            if coming is not None:
                errs = compare_prefetch(ref, got, ref._prefetch_torch(calls[j + 1], guess),
                                        prefetch(got, calls[j + 1], guess))
                if errs:
                    return [f"step {step} prefetch for layer {calls[j + 1]}: " + "; ".join(errs)]
        got.check_integrity()
    if slots and slots < len(layers) * E and int(ref.counters[3].sum()) == 0:
        return ["the case never evicted"]
    if frac < 1 and int((ref.counters[1] - ref.counters[4]).sum()) == 0:
        return ["the case never left a miss to the CPU"]
    if pf and slots >= 8 and not (int(ref.counters[5].sum()) and int(ref.counters[6].sum())):
        return ["the case never prefetched, or no prefetch was ever hit"]
    return []


def _triton_route(cache, layer, ids, frac=1.0):
    from moestream.moe.device_cache import route_triton

    return route_triton(cache, layer, ids, frac)


def _triton_prefetch(cache, layer, ids):
    from moestream.moe.device_cache import prefetch_triton

    return prefetch_triton(cache, layer, ids)


# --------------------------------------------------------------------------- interpreter
def _worker(out_path: str) -> None:
    write_case_results(CASES, lambda case: run_case(case, _triton_route, prefetch=_triton_prefetch), out_path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return interpreted_results(__file__, tmp_path_factory)


@pytest.mark.parametrize("case", list(CASES))
def test_interpreted_route_bit_exact(interpreted, case):
    assert_case(interpreted, case)


def test_cpu_tensors_stay_on_torch(monkeypatch):
    from moestream.moe import device_cache

    monkeypatch.setattr(device_cache, "route_triton", lambda *a: pytest.fail("CPU route used Triton"))
    c = DeviceSlotCache(4, [0], 8, 4, torch.device("cpu"))
    c.begin_step()
    c.route(0, torch.tensor([[1, 2]]))


@pytest.mark.parametrize("case", [c for c, spec in CASES.items() if "live" in spec])
def test_torch_route_reads_a_live_fraction(case):
    """The torch route (CPU decode path) with the share as a float32 tensor equals the float share."""
    assert not run_case(case, lambda cache, layer, ids, frac: cache._route_torch(layer, ids, frac))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("has_v,block_e,block_p", [(True, 256, 64), (False, 16, 16), (True, 512, 512)])
def test_kernel_compiles_for_sm90(has_v, block_e, block_p):
    """The real compiler (Triton -> PTX -> ptxas, for an H100/H200) accepts the kernel; no GPU needed."""
    from moestream.moe import device_cache as dc

    ptrs = ("ids table slot_key last_use victims vptr stamp counters expert_hits last_cpu pf_stamp routed_buf rows_buf "
            "src_out order_out rows_out count_out").split()
    consts = {"HAS_V": has_v, "PARTIAL": not has_v, "FRAC_PTR": not has_v, "BLOCK_P": block_p, "BLOCK_E": block_e}
    sig = {**{n: "*i64" for n in ptrs}, **{n: "i32" for n in ("P", "E", "S", "V", "L", "M", "li")}, "frac": "fp32",
           "frac_ptr": "*fp32", **{n: "constexpr" for n in consts}}
    k = compile_sm90(dc._route_kernel, sig, consts, {"num_warps": 8 if block_e > 256 else 4})
    assert "bar.sync" in k.asm["ptx"] or "barrier.sync" in k.asm["ptx"]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("block_e,block_q", [(256, 16), (16, 16), (512, 64)])
def test_prefetch_kernel_compiles_for_sm90(block_e, block_q):
    from moestream.moe import device_cache as dc

    ptrs = ("ids table slot_key last_use victims vptr stamp counters pf_stamp routed_buf experts_out rows_out "
            "count_out").split()
    consts = {"BLOCK_Q": block_q, "BLOCK_E": block_e}
    sig = {**{n: "*i64" for n in ptrs}, **{n: "i32" for n in ("Q", "E", "S", "V", "L", "li")},
           **{n: "constexpr" for n in consts}}
    k = compile_sm90(dc._prefetch_kernel, sig, consts, {"num_warps": 8 if block_e > 256 else 4})
    assert "bar.sync" in k.asm["ptx"] or "barrier.sync" in k.asm["ptx"]
    assert frame_bytes(k) <= triton_ops.DRIVER_STACK_LIMIT  # no spill past the driver's default stack frame


def test_prefetch_passes_over_victims_read_in_the_step():
    """A prediction never takes a slot this step has read (the layer in flight may be reading it), is not fetched
    when resident, and the route it was made for counts it as a prefetch hit."""
    c = DeviceSlotCache(2, [0, 1], 8, 2, torch.device("cpu"), prefetch=True)
    c.begin_step()
    c.route(0, torch.tensor([[1, 2]]))  # both slots now hold layer 0's experts, read in this step
    experts, rows, count = c.prefetch(1, torch.tensor([[5, 6]]))
    assert int(count) == 0 and set(c.resident_rows(0)) == {1, 2}
    c.begin_step()  # a new step: those slots are victims now
    experts, rows, count = c.prefetch(1, torch.tensor([[5, 6]]))
    assert int(count) == 2 and sorted(experts[:2].tolist()) == [5, 6] and set(c.resident_rows(1)) == {5, 6}
    again = c.prefetch(1, torch.tensor([[5, 6]]))
    assert int(again[2]) == 0  # resident: nothing to copy
    c.route(1, torch.tensor([[6, 7]]))
    counts = c.counts()[1]
    assert counts[5] == 2 and counts[6] == 1  # PREFETCHED, PREFETCH_HITS
    c.check_integrity()


# --------------------------------------------------------------------------- CUDA
cuda = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs an NVIDIA GPU and triton")


def _wired(monkeypatch):
    """`cache.route` on CUDA tensors, asserting that it takes the kernel."""
    from moestream.moe import device_cache

    monkeypatch.delenv("MOESTREAM_TRITON", raising=False)
    calls = []
    real = device_cache.route_triton
    monkeypatch.setattr(device_cache, "route_triton", lambda *a: calls.append(1) or real(*a))
    return calls, lambda cache, layer, ids, frac=1.0: cache.route(layer, ids, frac)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("case", list(CASES) + ["qwen-256"])
def test_cuda_route_bit_exact(case, monkeypatch):
    calls, route = _wired(monkeypatch)
    spec = (120, 256, 8, 8, list(range(6)), 64, 30) if case == "qwen-256" else None
    errs = run_case(case, route, "cuda", spec,
                    prefetch=lambda cache, layer, ids: calls.append(1) or cache.prefetch(layer, ids))
    assert calls, "the CUDA path did not use the Triton kernel"
    assert not errs, f"{case}: " + "; ".join(errs)


@pytest.mark.cuda
@cuda
def test_cuda_graph_replay(monkeypatch):
    """begin_step + every layer's route recorded once in a CUDA graph, replayed with new ids each step,
    equal to the reference driven eagerly."""
    calls, _ = _wired(monkeypatch)
    slots, E, T, k, layers = 40, 256, 4, 8, [0, 1, 2, 3]
    dev = torch.device("cuda")
    ref, got = (DeviceSlotCache(slots, layers, E, T * k, dev) for _ in range(2))
    g = torch.Generator().manual_seed(5)
    ids = {layer: make_ids("hot", E, T, k, g).to(dev) for layer in layers}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles the kernel: not while capturing) on a throwaway cache
        warm = DeviceSlotCache(slots, layers, E, T * k, dev)
        warm.begin_step()
        for layer in layers:
            warm.route(layer, ids[layer])
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got.begin_step()
        outs = {layer: got.route(layer, ids[layer]) for layer in layers}
    assert calls
    for step in range(25):
        for layer in layers:
            ids[layer].copy_(make_ids("hot", E, T, k, g).to(dev))
        graph.replay()
        ref.begin_step()
        for layer in layers:  # the graph ran all layers first: compare state after the last one
            errs = compare(ref, ref, ref._route_torch(layer, ids[layer]), outs[layer])
            assert not errs, f"step {step} layer {layer}: " + "; ".join(errs)
        errs = compare(ref, got, (), ())
        assert not errs, f"step {step}: " + "; ".join(errs)
    assert int(ref.counters[3].sum()) > 0  # evictions happened


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        _worker(sys.argv[2])
    else:
        sys.exit("usage: python tests/test_device_cache_triton.py --worker OUT.json (run the tests with pytest)")


def test_a_miss_left_to_the_cpu_is_fetched_first_when_it_comes_back():
    """hybrid's second touch: of two misses with one to fetch, the lower id goes first, unless the other was left
    to the CPU within SECOND_TOUCH steps; then it is fetched (and cached) and the new one is the CPU's."""
    from moestream.moe.device_cache import SECOND_TOUCH

    c = DeviceSlotCache(4, [0], 16, 8, torch.device("cpu"))
    share = live_share(0.5)  # two misses: one fetched, one to the CPU
    c.begin_step()
    src, *_ = c.route(0, torch.tensor([[3, 9]]), share)
    assert src.tolist()[0] >= 0 and src.tolist()[1] == -1  # by id: 3 fetched, 9 the CPU's
    c.begin_step()
    src, order, rows, count = c.route(0, torch.tensor([[2, 9]]), share)
    assert src.tolist()[0] == -1 and src.tolist()[1] >= 0 and int(count) == 1 and int(order[0]) == 9
    assert 9 in c.resident_rows(0) and 2 not in c.resident_rows(0)
    for _ in range(SECOND_TOUCH + 1):  # long ago: 2 is a first-time miss again, ordered by id
        c.begin_step()
    src, *_ = c.route(0, torch.tensor([[2, 11]]), share)
    assert src.tolist()[0] >= 0 and src.tolist()[1] == -1

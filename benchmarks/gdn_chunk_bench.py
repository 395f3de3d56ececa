"""Gated DeltaNet prefill, one layer at the Qwen3.6 shape (H = 32 value heads, Dk = Dv = 128): the chunk
recurrence as one Triton launch (triton_ops.gdn_chunk_scan) vs the torch loop over chunks, on CUDA.

    PYTHONPATH=$PWD python3 benchmarks/gdn_chunk_bench.py [--lengths 512,4096] [--sweep]

One line per config: chunk_gated_delta_rule end to end (loop, kernel), the chunk terms' prep kernel
(triton_ops.gdn_chunk_prep, MOESTREAM_GDN_PREP=1) against `_chunk_terms` in GPU and host time, then with --sweep the scan alone
under other launch settings (bv, num_warps, num_stages, dot precision) than triton_ops.gdn_chunk_launch's for this GPU.
Median of --reps timed calls (CUDA events) after warm-up; the first kernel call compiles.
"""
from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import time

import torch

from moestream.layers import triton_ops
from moestream.layers.gdn import _chunk_terms, _l2norm, chunk_gated_delta_rule

H, DK, DV = 32, 128, 128


def inputs(L: int, device="cuda"):
    g = torch.Generator(device=device).manual_seed(0)
    q = _l2norm(torch.randn(H, L, DK, device=device, generator=g)) * DK ** -0.5
    k = _l2norm(torch.randn(H, L, DK, device=device, generator=g))
    v = torch.randn(H, L, DV, device=device, generator=g)
    gate = -torch.rand(H, L, device=device, generator=g) ** 2
    beta = torch.rand(H, L, device=device, generator=g)
    state = torch.randn(H, DK, DV, device=device, generator=g) * 0.3
    return q, k, v, gate, beta, state


def time_ms(fn, reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def bench_length(L: int, reps: int, sweep: bool) -> None:
    args = inputs(L)
    loop = time_ms(lambda: chunk_gated_delta_rule(*args, kernel=False), reps)
    kern = time_ms(lambda: chunk_gated_delta_rule(*args, kernel=True), reps)
    o1, s1, _ = chunk_gated_delta_rule(*args, kernel=True)
    o0, s0, _ = chunk_gated_delta_rule(*args, kernel=False)
    err = max(((a - b).abs().max() / b.abs().max()).item() for a, b in ((o1, o0), (s1, s0)))
    terms = _chunk_terms(*args[:5], triton_ops.GDN_CHUNK)
    pre = time_ms(lambda: _chunk_terms(*args[:5], triton_ops.GDN_CHUNK), reps)
    _, c, u0, w, qk, q_dec, k_dec, last = terms
    scan = time_ms(lambda: triton_ops.gdn_chunk_scan(u0, w, q_dec, qk, k_dec, last, args[-1]), reps)
    print(f"L={L} H={H} Dk={DK} Dv={DV}: loop {loop:.3f} ms, kernel {kern:.3f} ms ({loop / kern:.1f}x; "
          f"precompute {pre:.3f} ms + scan {scan:.3f} ms, launch "
          f"{triton_ops.gdn_chunk_launch(torch.cuda.get_device_capability())}), max rel err {err:.1e}", flush=True)
    # the chunk terms in one launch (MOESTREAM_GDN_PREP=1): GPU time, and host time a call (what an all-resident
    # prefill waits on: 50 calls issued back to back, no sync inside)
    prep = time_ms(lambda: triton_ops.gdn_chunk_prep(*args[:5]), reps)
    host = {}
    for name, fn in (("torch terms", lambda: _chunk_terms(*args[:5], triton_ops.GDN_CHUNK)),
                     ("prep kernel", lambda: triton_ops.gdn_chunk_prep(*args[:5]))):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            fn()
        host[name] = (time.perf_counter() - t0) / 50 * 1e3
        torch.cuda.synchronize()
    alt = {nw: time_ms(lambda: triton_ops.gdn_chunk_prep(*args[:5], num_warps=nw), reps) for nw in (4, 16)}
    os.environ["MOESTREAM_GDN_PREP"] = "1"
    both = time_ms(lambda: chunk_gated_delta_rule(*args, kernel=True), reps)
    o2, s2, _ = chunk_gated_delta_rule(*args, kernel=True)
    del os.environ["MOESTREAM_GDN_PREP"]
    err2 = max(((a - b).abs().max() / b.abs().max()).item() for a, b in ((o2, o0), (s2, s0)))
    print(f"  prep kernel {prep:.3f} ms GPU (torch terms {pre:.3f}); host a call: torch terms "
          f"{host['torch terms']:.3f} ms, prep kernel {host['prep kernel']:.3f} ms; rule with both kernels "
          f"{both:.3f} ms, max rel err {err2:.1e}; prep at 4 / 16 warps {alt[4]:.3f} / {alt[16]:.3f} ms "
          f"(launch {triton_ops.gdn_prep_launch(torch.cuda.get_device_capability())})", flush=True)
    if sweep:
        sweep_launch(L, u0, w, q_dec, qk, k_dec, last, args[-1], reps)


STAGES = (1,)
PRECISIONS = ("ieee", "tf32x3", "tf32")


def local_bytes() -> int:
    """Local memory per thread of the chunk kernel this process compiled (its one launch setting): spilled
    registers, which the driver reserves for every thread the GPU can hold, outside torch's allocator."""
    from mem_probe import CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, func_attr

    k = [k for cache in triton_ops._gdn_chunk_kernel.device_caches.values() for k in cache[0].values()][-1]
    k._init_handles()
    return func_attr(k.function, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)


def sweep_launch(L, u0, w, q_dec, qk, k_dec, last, state, reps: int) -> None:
    """The scan alone under each launch setting, each in its own process (a setting that fails — out of
    shared memory, or a fault that would poison this process's CUDA context — reports its error)."""
    for bv, warps, stages, prec in itertools.product((16, 32, 64), (4, 8, 16), STAGES, PRECISIONS):
        cmd = [sys.executable, __file__, "--one", f"{L},{bv},{warps},{stages},{prec}", "--reps", str(reps)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("L=")]
        err = (p.stderr.strip().splitlines() or ["?"])[-1][:140]
        print(line[-1] if line else f"L={L} scan bv={bv} warps={warps} stages={stages} {prec}: failed: {err}",
              flush=True)


def one_launch(spec: str, reps: int) -> None:
    L, bv, warps, stages, prec = spec.split(",")
    L, bv, warps, stages = int(L), int(bv), int(warps), int(stages)
    args = inputs(L)
    _, c, u0, w, qk, q_dec, k_dec, last = _chunk_terms(*args[:5], triton_ops.GDN_CHUNK)
    state = args[-1]
    ref, ref_s, _ = triton_ops.gdn_chunk_scan(u0, w, q_dec, qk, k_dec, last, state, precision="ieee",
                                              bv=32, num_warps=8, num_stages=1)
    run = lambda: triton_ops.gdn_chunk_scan(u0, w, q_dec, qk, k_dec, last, state,  # noqa: E731
                                            precision=prec, bv=bv, num_warps=warps, num_stages=stages)
    ms = time_ms(run, reps)
    local = local_bytes()
    o, s, _ = run()
    err = max(((a - b).abs().max() / b.abs().max()).item() for a, b in ((o, ref), (s, ref_s)))
    print(f"L={L} scan bv={bv} warps={warps} stages={stages} {prec}: {ms:.3f} ms, "
          f"rel err vs ieee {err:.1e}, local {local} B/thread", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="512,4096")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="also time the scan under other launch settings")
    ap.add_argument("--stages", default="1", help="num_stages values of the sweep")
    ap.add_argument("--precisions", default="ieee,tf32x3,tf32", help="tl.dot input precisions of the sweep")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    global STAGES, PRECISIONS
    STAGES = tuple(int(x) for x in a.stages.split(","))
    PRECISIONS = tuple(a.precisions.split(","))
    assert torch.cuda.is_available() and triton_ops.triton is not None, "needs CUDA and triton"
    torch.backends.cuda.matmul.allow_tf32 = False  # the loop in full fp32 (torch's default)
    if a.one:
        return one_launch(a.one, a.reps)
    for L in (int(x) for x in a.lengths.split(",")):
        bench_length(L, a.reps, a.sweep)


if __name__ == "__main__":
    main()

"""The shared expert's activation + down projection at decode batch sizes, two ways (CUDA only):

    PYTHONPATH=$PWD python3 benchmarks/shared_down_bench.py [--rows 1,2,4,8] [--inter 512] [--hidden 2048]

(a) what the model runs by default: triton_ops.silu_mul, then the bf16 down projection through F.linear (cuBLAS);
(b) MOESTREAM_SHARED_DOWN=1's triton_ops.shared_down, both in one launch.
Each is recorded 40 times in one CUDA graph (as 40 MoE layers of a decode step, each with its own weight, so the
weights come from HBM, not L2), replayed; µs a call and the weight's GB/s. The outputs are compared too.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F


def timed(fn, reps: int = 50) -> float:
    """µs a call of fn() (40 calls recorded in one graph), median of reps replays."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / 40)
    return sorted(times)[len(times) // 2]


def main() -> None:
    from moestream.layers import triton_ops

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev, dt, I, H = torch.device("cuda"), torch.bfloat16, args.inter, args.hidden
    ws = [torch.randn(H, I, device=dev, dtype=dt) / I ** 0.5 for _ in range(40)]
    mb = H * I * 2 / 1e6
    out = {"device": torch.cuda.get_device_name(), "inter": I, "hidden": H, "weight_mb": mb, "rows": {}}
    print(f"{out['device']}: shared expert down [{H} x {I}] bf16 ({mb:.2f} MB), 40 weights, µs a call")
    for T in (int(r) for r in args.rows.split(",")):
        gu = torch.randn(T, 2 * I + 1, device=dev, dtype=dt)
        a = timed(lambda: [F.linear(triton_ops.silu_mul(gu, I), w) for w in ws])
        b = timed(lambda: [triton_ops.shared_down(gu, I, w) for w in ws])
        ref = F.linear(triton_ops.silu_mul(gu, I), ws[0]).float()
        err = float((triton_ops.shared_down(gu, I, ws[0]).float() - ref).abs().max() / ref.abs().max())
        out["rows"][T] = {"silu_mul_cublas_us": a, "shared_down_us": b, "max_rel_err": err}
        print(f"  rows {T}: silu_mul + cuBLAS {a:7.2f} us ({mb / a * 1e3:6.0f} GB/s)   shared_down "
              f"{b:7.2f} us ({mb / b * 1e3:6.0f} GB/s)   max |diff| / max |ref| {err:.2e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

"""Routed-expert GEMM throughput from slot-resident (compressed) experts, per weight format.

Run on the GPU machine (device tool), from the repo root:
    PYTHONPATH=$PWD python3 benchmarks/expert_gemm.py            # writes benchmarks/results/expert_gemm_<date>.json
Local smoke test of the same code on CPU with a small shape:
    python benchmarks/expert_gemm.py --device cpu --quick

Shape: one Qwen3.6-35B-A3B expert, gate_up [2I, H] = [1024, 2048] and down [H, I] = [2048, 512], in a
pool of --slots experts (256: far more bytes than the GPU's L2, so every expert is read from HBM).
For each format and tokens-per-expert n, one timed pass runs expert after expert of the pool:
dequantize gate_up (moestream.quant: Triton kernel on CUDA, torch on CPU) -> x @ gate_up.T -> SwiGLU ->
dequantize down -> @ down.T, the way the device path computes a slot-resident expert. Reported:

    us/expert      wall time of that per-expert chain (CUDA events around the whole pass / experts)
    weight GB/s    compressed bytes of the expert (all parts) / us per expert
    TFLOP/s        2 n (2I H + H I) / us per expert
    dequant GB/s   compressed bytes / time of the two dequantizations alone (bf16 output);
    torch deq GB/s the same through the torch decoders (MOESTREAM_TRITON=0), to show the kernels' gain
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from moestream.quant import FP8_BLOCK, MXFP4, NVFP4, gguf_format
from moestream.quant.synthetic import random_raw

FORMATS = {"bf16": None, "fp8_block": FP8_BLOCK, "q4_k": gguf_format("Q4_K"), "q8_0": gguf_format("Q8_0"),
           "q6_k": gguf_format("Q6_K"), "nvfp4": NVFP4, "mxfp4": MXFP4}
DEFAULT = "bf16,fp8_block,q4_k,q8_0,nvfp4"


@contextmanager
def triton_off():
    old = os.environ.get("MOESTREAM_TRITON")
    os.environ["MOESTREAM_TRITON"] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MOESTREAM_TRITON")
        else:
            os.environ["MOESTREAM_TRITON"] = old


class Pool:
    """--slots experts of one format, each array stacked over the slots (as a slot pool is)."""

    def __init__(self, name: str, slots: int, hidden: int, inter: int, device: torch.device):
        self.fmt = FORMATS[name]
        self.shapes = {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}
        self.raw = {}
        for i, (a, (n, k)) in enumerate(self.shapes.items()):
            if self.fmt is None:
                self.raw[a] = torch.randn(slots, n, k, device=device, dtype=torch.bfloat16) * 0.02
            else:
                self.raw[a] = random_raw(self.fmt, (slots, n, k), device, seed=i)
        self.bytes_per_expert = sum(self._nbytes(s) for s in self.shapes.values())

    def _nbytes(self, shape) -> int:
        return shape[0] * shape[1] * 2 if self.fmt is None else self.fmt.nbytes(shape)

    def slot(self, a: str, e: int):
        r = self.raw[a]
        return r[e] if isinstance(r, torch.Tensor) else {k: v[e] for k, v in r.items()}

    def dense(self, a: str, e: int) -> torch.Tensor:
        w = self.slot(a, e)
        return w if self.fmt is None else self.fmt.dequantize(w, self.shapes[a], torch.bfloat16)

    def mlp(self, x: torch.Tensor, e: int) -> torch.Tensor:
        g, u = F.linear(x, self.dense("gate_up", e)).chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, self.dense("down", e))


def timed(fn, experts: int, device: torch.device, repeat: int) -> float:
    """Seconds per expert: best of `repeat` passes of fn(e) over `experts` pool slots."""
    for e in range(min(experts, 8)):  # warm-up (Triton compiles, cuBLAS picks kernels)
        fn(e)
    best = float("inf")
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            for e in range(experts):
                fn(e)
            t1.record()
            t1.synchronize()
            dt = t0.elapsed_time(t1) / 1e3
        else:
            t = time.perf_counter()
            for e in range(experts):
                fn(e)
            dt = time.perf_counter() - t
        best = min(best, dt)
    return best / experts


def run(args) -> dict:
    device = torch.device(args.device)
    h, i = args.hidden, args.inter
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "shape": {"hidden": h, "inter": i, "gate_up": [2 * i, h], "down": [h, i]},
           "slots": args.slots, "results": []}
    try:
        import triton

        res["triton"] = triton.__version__
    except ImportError:
        res["triton"] = None
    torch.manual_seed(0)
    for name in args.formats.split(","):
        res["results"] += bench_format(name, args, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return res


def bench_format(name: str, args, device: torch.device) -> list[dict]:
    h, i = args.hidden, args.inter
    pool = Pool(name, args.slots, h, i, device)
    row = {"format": name, "bytes_per_expert": pool.bytes_per_expert}
    if pool.fmt is not None:
        def deq(e):
            return pool.dense("gate_up", e), pool.dense("down", e)

        row["dequant_gbs"] = pool.bytes_per_expert / timed(deq, args.slots, device, args.repeat) / 1e9
        if device.type == "cuda":
            with triton_off():
                row["torch_dequant_gbs"] = pool.bytes_per_expert / timed(deq, args.slots, device, args.repeat) / 1e9
    rows = []
    for n in args.tokens:
        x = torch.randn(n, h, device=device, dtype=torch.bfloat16)
        t = timed(lambda e: pool.mlp(x, e), args.slots, device, args.repeat)
        rows.append({**row, "n": n, "us_per_expert": t * 1e6, "weight_gbs": pool.bytes_per_expert / t / 1e9,
                     "tflops": 2 * n * 3 * h * i / t / 1e12})
    return rows


def table(res: dict) -> str:
    lines = [f"device {res['device']}, torch {res['torch']}, triton {res['triton']}, expert "
             f"gate_up {res['shape']['gate_up']} + down {res['shape']['down']}, pool of {res['slots']} slots",
             f"{'format':<10}{'MiB/exp':>8}{'n':>6}{'us/expert':>11}{'weight GB/s':>13}{'TFLOP/s':>9}"
             f"{'dequant GB/s':>14}{'torch deq GB/s':>16}"]
    for r in res["results"]:
        fmt = lambda k: f"{r[k]:.3g}" if r.get(k) is not None else "-"  # noqa: E731
        lines.append(f"{r['format']:<10}{r['bytes_per_expert'] / 2**20:>8.2f}{r['n']:>6}{r['us_per_expert']:>11.1f}"
                     f"{r['weight_gbs']:>13.1f}{r['tflops']:>9.2f}{fmt('dequant_gbs'):>14}{fmt('torch_dequant_gbs'):>16}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--formats", default=DEFAULT, help=f"comma list of {sorted(FORMATS)}")
    p.add_argument("--tokens", default="1,8,64,512", help="tokens per expert (n), comma list")
    p.add_argument("--slots", type=int, default=256, help="experts in the pool (one timed pass runs them all)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3, help="timed passes; the best counts")
    p.add_argument("--quick", action="store_true", help="small shape, few slots and tokens (CPU smoke test)")
    p.add_argument("--out", default=None,
                   help="JSON path (default benchmarks/results/expert_gemm_<date>.json, _quick.json with --quick)")
    args = p.parse_args(argv)
    unknown = [f for f in args.formats.split(",") if f not in FORMATS]
    if unknown:
        p.error(f"unknown format(s) {unknown}; known: {sorted(FORMATS)}")
    if args.quick:
        args.hidden, args.inter, args.slots, args.repeat, args.tokens = 512, 256, 4, 1, "1,8"
    args.tokens = [int(t) for t in args.tokens.split(",")]
    res = run(args)
    print(table(res))
    tag = "_quick" if args.quick else ""
    out = Path(args.out or Path(__file__).parent / "results" / f"expert_gemm_{time.strftime('%Y-%m-%d')}{tag}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

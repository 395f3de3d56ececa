"""Why a CPU expert layer call runs slower inside a decode step than alone: the layer kernel
(kernels/cpu_quant.moe_layer) over banks laid out as the engine lays them out, varied one factor at a time.

    PYTHONPATH=$PWD python3 benchmarks/cpu_layer_diag.py [--layers 10] [--tokens 24] [--threads 16,15,8]
        [--types Q8_0] [--out F]

Banks: `--layers` MoE layers x 256 experts at the Qwen3.6-35B-A3B expert shape (H 2048, I 512), one tensor per
(layer, projection) as moe/store.py allocates them (8.5 GB of Q8_0 at 10 layers: beyond any L3). Each "token"
walks the layers in order, 8 random experts a layer, x one bf16 row (what the cpu backend's bridge passes);
GB/s = expert bytes read / time. Factors:
- pages: banks allocated plain (4 KiB pages where transparent huge pages are `madvise`) or advised huge
  (moe/store.advise_huge_pages) before they are filled; and page-locked (cudaHostRegister, as pin_host does)
  when CUDA is there;
- threads: the layer call's OpenMP threads;
- caller: the main thread, or a Python worker thread (as the bridge's worker);
- gap: a busy wait between layer calls (the GPU's share of a layer in a decode step: 100 us);
- threading: the kernels' own thread pool or OpenMP (MOESTREAM_CPU_POOL);
the in-step case (worker thread, gap) at every setting, the others at the first thread count, huge, unpinned;
plus the machine's read bandwidth (a float32 sum over 1 GiB) and its THP setting. Results print as JSON lines."""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moestream.kernels import cpu_quant  # noqa: E402
from moestream.moe import store as store_mod  # noqa: E402
from moestream.quant import gguf_format  # noqa: E402
from moestream.quant.synthetic import random_raw  # noqa: E402

H, I, E, K = 2048, 512, 256, 8


def thp() -> str:
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        return "?"


def read_gbs(threads: int) -> float:
    torch.set_num_threads(threads)
    big = torch.ones(256 << 20)
    big.sum()
    t0 = time.perf_counter()
    for _ in range(3):
        big.sum()
    return 3 * big.numel() * 4 / (time.perf_counter() - t0) / 1e9


def make_banks(layers: int, types: tuple[str, str, str], huge: bool) -> list[list[torch.Tensor]]:
    """layers x [gate, up, down] uint8 banks [E, bytes], filled by copying one valid random layer (fast)."""
    shapes = ((I, H), (I, H), (H, I))
    proto = [random_raw(gguf_format(t), (E, n, k)).reshape(E, -1) for t, (n, k) in zip(types, shapes)]
    out = []
    for _ in range(layers):
        row = []
        for p in proto:
            b = torch.empty_like(p)
            if huge:
                store_mod.advise_huge_pages(b)
            b.copy_(p)
            row.append(b)
        out.append(row)
    return out


def pin(banks) -> list[int]:
    ptrs = []
    for row in banks:
        for b in row:
            if int(torch.cuda.cudart().cudaHostRegister(b.data_ptr(), b.numel(), 0)) == 0:
                ptrs.append(b.data_ptr())
    return ptrs


def huge_bytes() -> int:
    """This process's anonymous memory in transparent huge pages (bytes)."""
    try:
        for line in open("/proc/self/smaps_rollup"):
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


class GpuPoller:
    """`programs` GPU programs spinning on a pinned host word until it is set, as the bridge's collect
    kernels poll while the CPU computes (PCIe reads of host memory the whole time)."""

    def __init__(self, programs: int):
        import triton
        import triton.language as tl

        @triton.jit
        def spin(flag_ptr, out_ptr, LIMIT: tl.constexpr):
            n = 0
            while (tl.load(flag_ptr, volatile=True) == 0) & (n < LIMIT):
                n += 1
            tl.store(out_ptr + tl.program_id(0), n)

        self.kernel, self.programs = spin, programs
        self.flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self.out = torch.zeros(programs, dtype=torch.int64, device="cuda")

    def __enter__(self):
        self.flag[0] = 0
        self.kernel[(self.programs,)](self.flag, self.out, LIMIT=1 << 30)
        return self

    def __exit__(self, *exc):
        self.flag[0] = 1
        torch.cuda.synchronize()


def unpin(ptrs: list[int]) -> None:
    for p in ptrs:
        torch.cuda.cudart().cudaHostUnregister(p)


def record(res: dict, run: dict, gbs: float) -> None:
    run["gbs"] = round(gbs, 1)
    res["runs"].append(run)
    print(json.dumps(run), flush=True)


def walk(banks, types, threads: int, tokens: int, gap_s: float, rng, poll: int = 0) -> float:
    """GB/s of expert bytes over `tokens` walks of all layers (poll: GPU programs polling host memory)."""
    if poll:
        with GpuPoller(poll):
            return walk(banks, types, threads, tokens, gap_s, rng)
    torch.set_num_threads(threads)
    x = torch.randn(1, H).to(torch.bfloat16)
    y = torch.empty(K, H)
    starts, rows = np.arange(K + 1), np.zeros(K, dtype=np.int64)
    w, dst = np.full(K, 0.125, dtype=np.float32), np.arange(K)
    per_expert = sum(b.shape[1] for b in banks[0])
    picks = [[np.sort(rng.choice(E, K, replace=False)) for _ in banks] for _ in range(tokens + 1)]
    ptrs = [[np.stack([b.data_ptr() + p * b.stride(0) for b in row], 1) for row, p in zip(banks, pk)] for pk in picks]
    for pl in ptrs[0]:  # warm-up walk (threads started, code paged in)
        cpu_quant.moe_layer(x, pl, types, starts, rows, w, dst, y, I, h_dtype=torch.bfloat16)
    t0 = time.perf_counter()
    for tok in range(1, tokens + 1):
        for pl in ptrs[tok]:
            cpu_quant.moe_layer(x, pl, types, starts, rows, w, dst, y, I, h_dtype=torch.bfloat16)
            if gap_s:
                end = time.perf_counter() + gap_s
                while time.perf_counter() < end:
                    pass
    dt = time.perf_counter() - t0 - tokens * len(banks) * gap_s
    return tokens * len(banks) * K * per_expert / dt / 1e9


def in_thread(fn, *a):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("v", fn(*a)))
    t.start()
    t.join()
    return box["v"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--threads", default="16,15,8")
    ap.add_argument("--types", default="Q8_0")
    ap.add_argument("--out", default=None)
    ap.add_argument("--in-step", action="store_true",
                    help="only the in-step case (worker thread, 100 us gap, pinned where CUDA is), with and without "
                         "GPU programs polling host memory, plain and huge pages (a whole model's layers: --layers 40)")
    args = ap.parse_args()
    types = tuple(args.types.split("/")) * (3 if "/" not in args.types else 1)
    threads = [int(t) for t in args.threads.split(",")]
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "thp": thp(), "types": types, "layers": args.layers,
           "cpu_count": torch.get_num_threads(), "isa": cpu_quant.isa() if hasattr(cpu_quant, "isa") else None,
           "read_gbs": {t: round(read_gbs(t), 1) for t in threads}, "runs": []}
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}), flush=True)
    rng = np.random.default_rng(0)
    if args.in_step:
        in_step(args, types, threads[0], res, rng)
    else:
        factors(args, types, threads, res, rng)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


def in_step(args, types, t: int, res: dict, rng) -> None:
    """The decode step's case only (worker thread, 100 us gaps, pinned where CUDA is), with and without GPU
    programs polling host memory, plain and huge pages."""
    cuda = torch.cuda.is_available()
    for huge in (False, True):
        banks = make_banks(args.layers, types, huge)
        info = {"huge": huge, "huge_gib": round(huge_bytes() / 2**30, 1)}
        regs = pin(banks) if cuda else []
        for poll in ((0, 8) if cuda else (0,)):
            for mode in ("pool", "omp"):
                os.environ["MOESTREAM_CPU_POOL"] = mode
                gbs = in_thread(walk, banks, types, t, args.tokens, 1e-4, rng, poll)
                record(res, {**info, "pinned": bool(regs), "poll": poll, "threading": mode}, gbs)
        unpin(regs)
        del banks


def factors(args, types, threads: list[int], res: dict, rng) -> None:
    """The in-step case at every setting; main thread and no gap at the first thread count, huge, unpinned."""
    for huge in (False, True):
        banks = make_banks(args.layers, types, huge)
        for pinned in ((False, True) if torch.cuda.is_available() else (False,)):
            regs = pin(banks) if pinned else []
            for t in threads:
                for mode in ("pool", "omp"):
                    for caller in ("main", "thread"):
                        for gap in (0.0, 1e-4):
                            if (caller, gap) != ("thread", 1e-4) and (t != threads[0] or not huge or pinned):
                                continue  # the in-step case everywhere, the other factors once
                            os.environ["MOESTREAM_CPU_POOL"] = mode
                            f = walk if caller == "main" else (lambda *a: in_thread(walk, *a))
                            gbs = f(banks, types, t, args.tokens, gap, rng)
                            record(res, {"huge": huge, "pinned": pinned, "threads": t, "threading": mode,
                                         "caller": caller, "gap_us": gap * 1e6}, gbs)
            unpin(regs)
        del banks

if __name__ == "__main__":
    main()

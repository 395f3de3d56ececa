"""The one module that reads the environment (DESIGN.md §2)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """moestream's cache folder: $XDG_CACHE_HOME/moestream, else ~/.cache/moestream."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moestream"


TRITON_MODES = ("auto", "on", "off")
_TRITON_MODE = ["auto"]  # the engine option --triton (EngineConfig.triton), set by each Engine it builds


def set_triton_mode(mode: str) -> None:
    """The engine option --triton: "on" or "off" decide `triton_enabled` for this process, whatever
    MOESTREAM_TRITON says; "auto" (the default) leaves the decision to MOESTREAM_TRITON."""
    if mode not in TRITON_MODES:
        raise ValueError(f"triton mode must be one of {', '.join(TRITON_MODES)}, got {mode!r}")
    _TRITON_MODE[0] = mode


def triton_enabled() -> bool:
    """The one "use Triton?" decision, asked by every Triton kernel gate (dequantization in moestream.quant;
    the norms, Gated DeltaNet decode step and prefill chunk recurrence, router top-k, attention q/k prep and
    MoE combine in layers/triton_ops.py; the expert pair, grouped, compressed-pair and bridge kernels, the
    device slot table's routing and compressed dense linears in moe/ and the engine), each of which also
    needs triton to import and its tensors on CUDA. False: the torch reference paths run instead. Set by
    --triton on|off; under --triton auto (default) MOESTREAM_TRITON=0 turns the kernels off (read at
    each call, so a test or benchmark can switch within one process)."""
    if _TRITON_MODE[0] != "auto":
        return _TRITON_MODE[0] == "on"
    return os.environ.get("MOESTREAM_TRITON", "1") != "0"


def triton_interpreted() -> bool:
    """TRITON_INTERPRET=1: Triton runs kernels on CPU tensors in its interpreter (the tests), read by triton at
    import; kernels that need a different loop form there ask this."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def split_decode_enabled() -> bool:
    """MOESTREAM_SPLIT_DECODE=0 turns the split-KV decode attention kernel off (layers/attn_decode.py): decode
    attention then gathers the KV and calls SDPA, as before. For A/B measurements."""
    return os.environ.get("MOESTREAM_SPLIT_DECODE", "1") != "0"


def fuse_projections_enabled() -> bool:
    """MOESTREAM_FUSE=0 keeps the loaded projections unfused (models/fuse.py): for A/B measurements."""
    return os.environ.get("MOESTREAM_FUSE", "1") != "0"


def cpu_kernels_enabled() -> bool:
    """MOESTREAM_CPU_KERNELS=0 turns the compiled CPU matmuls of compressed weights off
    (kernels/cpu_quant.py): quant.qlinear then decodes tiles with torch and multiplies them."""
    return os.environ.get("MOESTREAM_CPU_KERNELS", "1") != "0"


def cpu_decode_layer_enabled() -> bool:
    """MOESTREAM_CPU_DECODE_LAYER=0 keeps CPU decode steps on the per-op path instead of one compiled call per
    attention layer (models/cpu_decode.py; read at each step)."""
    return os.environ.get("MOESTREAM_CPU_DECODE_LAYER", "1") != "0"


def cpu_repack_enabled() -> bool:
    """MOESTREAM_CPU_REPACK=0 keeps a CPU decode plan's 4-bit weights (Q4_K, Q4_0, Q4_1; dense layers and routed
    experts) in their GGUF layout instead of 8-row interleaved copies its one-row products read faster
    (models/cpu_decode.py; the experts' copies only where host memory keeps 2 GiB beside them; read when the plan
    is built)."""
    return os.environ.get("MOESTREAM_CPU_REPACK", "1") != "0"


def bridge_interleave() -> bool:
    """MOESTREAM_BRIDGE_X8=1: the cpu/hybrid bridge on a GPU gives each layer's host banks of GGUF experts 8-row
    interleaved copies (moe/cpu_moe.interleave_layer) where host memory keeps 4 GiB beside them, so the worker reads
    the layout its one-row products run fastest on while PCIe copies go on reading the file's layout. Opt-in: it costs
    host memory equal to the experts' bytes, for +4 % (`cpu` at 4.16 GiB, two H100 hosts), −4 % (a third, with 2 groups
    read ahead), +15 % (hybrid at 7.79 GiB, one host) and −2.5 % (hybrid at 11.3 GiB) measured (benchmarks/RESULTS.md,
    twenty-second session; vs_llama.py's `+x8` variant); read when the bridge is built."""
    return os.environ.get("MOESTREAM_BRIDGE_X8", "0") == "1"


def bridge_worker_in_c() -> bool:
    """MOESTREAM_BRIDGE_C=0 runs the cpu/hybrid bridge's worker loop in Python, layer by layer, instead of one
    compiled call per decode step (moe/bridge.py; read at each step)."""
    return os.environ.get("MOESTREAM_BRIDGE_C", "1") != "0"


def cpu_layer_tuning() -> tuple[int, int, int, int, int, int]:
    """MOESTREAM_CPU_LAYER_TUNING="chunks=8,kb=0,x8ahead=0,rowsahead=2,flow=1,tail=1": the compiled MoE layer call's
    chunks per thread, least KiB of weights a chunk (0: max(32, 8 x the call's threads)), interleaved 8-row groups read
    ahead, rows read ahead for the other types, flow (1: a decode call's down rows of an expert start once that expert's
    gate/up rows are done; 0: after a barrier on every expert's) and tail (S > 1: each phase's last chunks, one a
    thread, cut into S: the threads wait less for the last one) (kernels/cpu/qmatmul.cpp, g_layer_chunks, g_layer_flow,
    g_layer_tail; the defaults are those numbers). For timing settings on a machine (benchmarks/cpu_layer_tuning.py,
    vs_llama.py's `+x8aN` / `+raN` / `+kbN` / `+tailN` / `+noflow` variants); results do not depend on them. Read at
    each kernel call; a key left out keeps its default. A malformed value is a ValueError naming it."""
    raw = os.environ.get("MOESTREAM_CPU_LAYER_TUNING", "")
    vals = {"chunks": 8, "kb": 0, "x8ahead": 0, "rowsahead": 2, "flow": 1, "tail": 1}
    for part in filter(None, (p.strip() for p in raw.split(","))):
        key, _, v = part.partition("=")
        if key not in vals or not v.isdigit() or (key not in ("x8ahead", "flow", "kb") and int(v) < 1) or \
                (key == "flow" and v not in ("0", "1")):
            raise ValueError(f"MOESTREAM_CPU_LAYER_TUNING: {part!r} is not chunks=N, rowsahead=N, tail=N (N >= 1), "
                              "kb=N, x8ahead=N or flow=0|1")
        vals[key] = int(v)
    return vals["chunks"], vals["kb"] << 10, vals["x8ahead"], vals["rowsahead"], vals["flow"], vals["tail"]


BRIDGE_AHEAD = (1, 8)  # the bridge worker's read-ahead (interleaved groups, rows), unless the env sets them


def bridge_ahead() -> tuple[int, int]:
    """The cpu/hybrid bridge worker's read-ahead in its layer calls: (interleaved 8-row groups, rows of the file's
    layouts), BRIDGE_AHEAD, each -1 (the library's setting) where MOESTREAM_CPU_LAYER_TUNING names it. On a GPU host
    the bridge reads the file's layout unless MOESTREAM_BRIDGE_X8=1 gives it interleaved copies, so rows ahead is
    what applies there by default: 8 instead of the library's 2 read 8 random Q4_K_M experts of the Qwen3.6 shape a
    call 0-10 % faster on the 2-core VM, 2-expert calls within noise (benchmarks/cpu_layer_tuning.py); not measured on
    a GPU host yet. A whole CPU-only decode did not gain from reading further ahead, so the library's defaults stay
    (benchmarks/RESULTS.md, fifteenth session)."""
    raw = os.environ.get("MOESTREAM_CPU_LAYER_TUNING", "")
    return (-1 if "x8ahead" in raw else BRIDGE_AHEAD[0]), (-1 if "rowsahead" in raw else BRIDGE_AHEAD[1])


def bridge_pool() -> str:
    """MOESTREAM_BRIDGE_POOL: where the cpu/hybrid bridge worker on a GPU computes its layer calls. "1" (default): the
    `cpu` backend's on the CPU kernels' own pool held spinning for the whole decode step, hybrid's on the threading of
    cpu_threading() (default OpenMP); "0": both on cpu_threading()'s; "all": both on the held pool (an A/B setting,
    see moe/bridge.CpuBridge: hybrid's split measured slower held, 18.6 vs 16.5 ms a step on 2026-12-05, and with
    the pair kernels' own fetch 41.3 vs 78.4 tok/s at 11.68 GiB on an H100 host on 2026-12-07). Read at each step."""
    v = os.environ.get("MOESTREAM_BRIDGE_POOL", "1").strip().lower()
    return v if v in ("0", "all") else "1"


def omp_release() -> bool:
    """MOESTREAM_OMP_RELEASE=1: the cpu/hybrid bridge's stepping thread frees its own OpenMP team before each step
    (kernels/cpu_quant.omp_release_team), so that the bridge worker's team is the process's only one and libgomp lets
    its idle threads spin between layer calls instead of sleeping (a 2-core VM: a worker's small call after 300 us
    idle 87-112 us with the main thread's team alive, 20-28 without: benchmarks/omp_team_wake.py). Off by default until timed inside GPU steps
    (a team spinning through the GPU's part of a step takes cores the stepping thread needs). Read at each step."""
    return os.environ.get("MOESTREAM_OMP_RELEASE", "0").strip() == "1"


def cpu_threading() -> tuple[bool, int]:
    """(own pool, spin microseconds) for the compiled CPU kernels' threads (kernels/cpu/qmatmul.cpp):
    MOESTREAM_CPU_POOL=pool runs them on the kernels' own pool instead of OpenMP (default `omp`: the OpenMP
    runtime torch also uses, so the two never compete for cores; the pool measured 2.3x slower decode on a
    2-core machine and no faster inside a GPU decode step, benchmarks/RESULTS.md); MOESTREAM_CPU_SPIN_US
    (default 300) is how long an idle pool worker spins before it sleeps. Read at each kernel call, so a
    benchmark can switch within one process."""
    spin = os.environ.get("MOESTREAM_CPU_SPIN_US", "300")
    return os.environ.get("MOESTREAM_CPU_POOL", "omp") == "pool", int(spin) if spin.isdigit() else 300


def prefetch_top() -> int:
    """MOESTREAM_PREFETCH_TOP=N: the lookahead prefetch of the pair path copies ahead only each token's N likeliest
    next-layer experts (0 or unset: all top_k of them); read when a decode step is built or recorded, for A/B
    measurements of fewer, surer predictions."""
    v = os.environ.get("MOESTREAM_PREFETCH_TOP", "0")
    return int(v) if v.isdigit() else 0


def hybrid_arms() -> bool:
    """MOESTREAM_HYBRID_ARMS=0 keeps hybrid on its live split in every decode step, instead of choosing per batch size
    between the split and fetching every miss (offload's step) by the step times it measures (moe/share.py Arms).
    Read when a hybrid runtime is built."""
    return os.environ.get("MOESTREAM_HYBRID_ARMS", "1") != "0"


def shared_down_fused() -> bool:
    """MOESTREAM_SHARED_DOWN=1 (an A/B setting, measured slower): the shared expert's silu(gate) * up and its bf16 down
    projection in one Triton launch at up to 16 rows (layers/triton_ops.shared_down), instead of the activation kernel
    and cuBLAS's GEMV. Timed on an H100 on 2026-12-07 (benchmarks/shared_down_bench.py): 14.3-15.1 µs a call against
    4.6-5.4 for the two launches replayed alone (the 12 µs of the profile's 4-row GEMV is a step's, not the kernel's
    own), and fused decode 257.3 vs 287.2 tok/s with it. Read at each call."""
    return os.environ.get("MOESTREAM_SHARED_DOWN", "0") == "1"


def q8_words() -> bool:
    """MOESTREAM_Q8_WORDS=1 (opt-in until timed end to end): the pair kernels read Q8_0 experts as 16-bit words (a
    34-byte block is 17 of them: two codes a load where the byte decoder loads one; benchmarks/q8_planar_bench.py
    times it). Read at each layer call."""
    return os.environ.get("MOESTREAM_Q8_WORDS", "0") == "1"


def q8_planar() -> str:
    """MOESTREAM_Q8_PLANAR: where only the GPU's kernels read the expert store (fused and offload on CUDA with Triton),
    its Q8_0 experts are rewritten row-planar at runtime start (Q8_0R: each row's block scales, then its 16-byte-aligned
    codes; same bytes), which the pair kernels read 1.7x faster. "all" (the default): fused and offload; "1": fused
    only; "0": the file's layout everywhere. Measured on an H100 against the file layout in the same run
    (benchmarks/RESULTS.md, thirty-sixth session, Qwen3.6-shaped Q8_0 file): fused 307.4 / 304.9 vs 281.4 tok/s at
    batch 1, 804.8 / 801.2 vs 667.0 at batch 4, pp512 3,657 / 3,352 vs 3,098; offload 121.7 vs 114.0 (22.84 GiB),
    68.7 vs 65.5 (11.68), 52.6 vs 51.5 (8.50). cpu and hybrid always read the file's layout (their CPU kernels read
    Q8_0: backends.q8_planar_wanted)."""
    v = os.environ.get("MOESTREAM_Q8_PLANAR", "all")
    return v if v in ("0", "1") else "all"


def gdn_prep_kernel() -> bool:
    """A Gated DeltaNet prefill chunk's terms (the decay matrix, the triangular solves, q k^T, the decayed q and k)
    computed by one Triton launch per layer (layers/triton_ops.gdn_chunk_prep) where the chunk scan kernel runs,
    instead of ~35 batched torch ops; on by default, MOESTREAM_GDN_PREP=0 turns it off. An all-resident Qwen3.6
    prefill is host-bound (512 tokens: 139 ms wall for 57 ms of kernels on an H100); on an H100 the terms took
    0.245 ms of GPU and 0.097 ms of host time a 512-token layer call against 0.554 / 0.462 in torch, and its CUDA and
    HF parity tests passed (benchmarks/RESULTS.md, thirty-seventh session). Read at each call."""
    return os.environ.get("MOESTREAM_GDN_PREP", "1") != "0"


def gdn_front_kernel() -> bool:
    """MOESTREAM_GDN_FRONT=1 (opt-in until its bf16 parity test passes on a GPU): a Gated DeltaNet prefill's conv,
    SiLU, q/k L2 norms and gates for a sequence's tokens in one Triton launch (layers/triton_ops.gdn_prefill_front)
    instead of ~28 torch launches a layer. On an H100 (thirty-seventh session) it and gdn_prep_kernel took an 8-layer
    512-token prefill from 20.8 to 17.5 ms and the full file's all-resident pp512 from 5,651 to 6,171 tok/s, but a bf16
    model's prefill logits came out 15 % from HF bf16's (SiLU of the conv's fp32 sums rounded once, where torch rounds
    the sums first); the rounding is fixed since and checked bit for bit under the interpreter, not yet on a GPU.
    Read at each call."""
    return os.environ.get("MOESTREAM_GDN_FRONT", "0") == "1"


def q8r_grouped() -> str:
    """MOESTREAM_Q8R_GROUPED: how the grouped (prefill) kernels read Q8_0R experts: "tile" (default: each K step's
    [BN, 64] tile dequantized in registers, one scale a 32-code run, then one tensor-core product) or "scale" (a
    32-column block a step, its int8 codes multiplied on the tensor cores, the scale applied to the fp32 products).
    Read at each launch (benchmarks/grouped_bench.py times both)."""
    return os.environ.get("MOESTREAM_Q8R_GROUPED", "tile")


def fetch_in_pairs() -> str:
    """Where a compressed (GGUF, FP8, NVFP4, MXFP4) layer call's missed experts are copied from pinned host memory
    into their slots: "1" (default) inside the pair kernels when the call has one token (each program copies the rows
    it computes, then computes them, so the hits compute while the misses cross PCIe, and no copy kernel runs
    first: +3-5 % batch-1 decode for offload and hybrid on the Q8_0 file, H100, 2026-12-07); "all" at every batch
    size (a missed expert that several tokens route to then crosses PCIe once per token); "0" always the copy kernel
    before the pair kernels (moe/pairs.stage_experts). Read at each layer call."""
    v = os.environ.get("MOESTREAM_FETCH_IN_PAIRS", "1")
    return v if v in ("0", "1", "all") else "1"


def grouped_fp4_grouped_tiles() -> bool:
    """moe/grouped.py decodes NVFP4 / MXFP4 weight tiles a scale group at a time (each code byte loaded once and split
    into its two nibbles, one scale decoded per group and broadcast): the default since the A/B of 2026-12-07 (H100,
    one Qwen3.6 layer, 1,024 tokens: NVFP4 5,306 -> 2,342 us, MXFP4 5,219 -> 1,594 us, both bit-equal to the loop).
    MOESTREAM_GROUPED_FP4=elem: element by element (each byte loaded for both of its values, a scale decoded per
    value), the earlier form. Read when moe/grouped.py is imported."""
    return os.environ.get("MOESTREAM_GROUPED_FP4", "groups") != "elem"


def prefill_rows() -> int:
    """MOESTREAM_PREFILL_ROWS=N: rows per half of the prefill double buffer (at most 64, at least one layer's top-k)
    instead of the planner's choice (a quarter of the expert slots, at most 64): for measuring long prompts at small
    caps, where few slots leave a buffer of top-k rows and a chunk streams its experts a few at a time. 0: the
    planner's. Read when a plan is made."""
    v = os.environ.get("MOESTREAM_PREFILL_ROWS", "0")
    return int(v) if v.isdigit() else 0


def launch_triple(name: str) -> tuple[int, int, int] | None:
    """A kernel's "BN,BV,WARPS" launch constants from environment variable `name` (powers of two for BN and BV:
    MOESTREAM_QLINEAR_CFG, MOESTREAM_QLINEAR_ROWS_CFG, MOESTREAM_PLANAR_CFG), None when unset; a malformed value is one
    warning and None (the defaults)."""
    env = os.environ.get(name, "")
    if not env:
        return None
    try:
        cfg = tuple(int(v) for v in env.split(","))
        if len(cfg) != 3 or min(cfg) < 1 or any(v & (v - 1) for v in cfg[:2]):
            raise ValueError
        return cfg
    except ValueError:
        import logging

        logging.getLogger("moestream").warning("%s=%r is not BN,BV,WARPS (powers of two for BN and BV): using the "
                                               "defaults", name, env)
        return None

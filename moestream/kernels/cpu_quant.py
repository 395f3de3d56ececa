"""Compiled CPU matmuls on compressed GGUF and HF weights: ``y = x @ W.T`` read straight from the stored bytes.

Source: ``kernels/cpu/qmatmul.cpp``, compiled at first use by the system C++ compiler into moestream's
cache (``env.cache_dir()/kernels``, one file per source and flags) and reused from there; never at
install. It is a plain C-ABI library (no torch headers, so the first build takes seconds) called
through ctypes. Instruction sets (``_ISAS``), chosen by /proc/cpuinfo's flags, best first: AVX512-VNNI
(the 32-value block dot products as one vpdpbusd; AVX2 code otherwise), AVX2+FMA+F16C, portable C++ (the
scalar kernels); explicit flags, not ``-march=native``: the cache key is the source and the flags, so a
cache shared between machines must not hold code for a newer CPU. A compiler that refuses a variant's
flags falls back to the next.

Formats: F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, and the codebook formats IQ4_NL,
MXFP4 (GGUF type 39: e2m1 codes with one e8m0 scale per 32), IQ4_XS and IQ3_S; HF safetensors FP8, NVFP4 and
MXFP4 (below). The 4-bit codebooks (IQ4_NL
levels, doubled e2m1 values) are looked up with one byte shuffle per 32 values; IQ3_S's 512-entry grid is
data, handed to the library at load from the gguf package's table (without that package IQ3_S is refused
by the C side and stays on the torch decoders, like every IQ3_S tensor).

HF FP8 (``fp8_matmul``: quant/base.qlinear's CPU path for fp8_block / fp8_channel / fp8_tensor weights of up
to CPU_FLOAT_KERNEL_MAX_ROWS rows; and ``moe_layer``, type "fp8", each matrix a descriptor ``fp8_descriptors``): the
e4m3 bytes are decoded in
registers (AVX2: moved into a half's bits and converted by F16C) and multiply float32 activations, one float32
partial sum per scale block times its scale.

HF FP4 (``fp4_matmul`` and ``moe_layer``; ``HF_TYPES``): ModelOpt NVFP4 (``weight`` e2m1 pairs, ``weight_scale``
e4m3 per 16, ``weight_scale_2`` fp32) and gpt-oss MXFP4 (``blocks`` e2m1 pairs, ``scales`` e8m0 per 32), the
checkpoint's arrays as stored (element 2i in the low nibble). Codes are looked up as doubled e2m1 values with
one byte shuffle per 32 and multiply int8 activations (one scale per 16 values, stored with each 32-block's
even elements first so the nibbles need no interleave): two integer sub-sums per 32-block, each times its
weight and activation scales; NVFP4's global scale multiplies each output once.

Accuracy: like llama.cpp, the block formats (and HF FP4) multiply
*quantized activations*: each activation row is rounded to int8 per block of 32 values with one float
scale (amax / 127) — per 16 values for HF FP4, per 256 values for the K-quants and the IQ super-block formats
IQ4_XS / IQ3_S
(llama.cpp's Q8_K idea: integer sums across a super-block's 8 sub-blocks, times their scales as integers)
— and the products are summed in integers. Every row count takes them (prefill as decode, as llama.cpp
does): the rounding is per row, so a prompt's rows round alike however the prompt is chunked (a prefix-cache
hit's tail included), and a prefill's expert calls of a few rows each read the blocks as stored instead of
decoding every expert to float32.
The weight side is exact (the same values as ``moestream.quant``'s decoders); the activation rounding adds
an error of at most half a block's scale per value, so ``|y - y_ref| <= sum_blocks amax_b / 254 * sum |w|``
over the block (tests/test_cpu_kernels.py checks this bound against a float64 reference). F16/BF16 weights
multiply float32 activations (no rounding beyond float32 sums), and so do FP8 weights.

``moe_layer``: one call computes a MoE layer's (token, expert) pairs — gate, up, SiLU, down, routing
weight — with the x rows quantized once (moe/cpu_moe.py wires it into the CPU expert paths); an HF FP4 matrix
enters it as the address of a descriptor of its parts (``fp4_descriptors``).

Threads: output rows are split over ``torch.get_num_threads()`` OpenMP threads (the runtime torch loads, so
they share torch's team), or with ``MOESTREAM_CPU_POOL=pool`` the library's own pool (idle workers spin
``MOESTREAM_CPU_SPIN_US`` before sleeping); ``--moe-cpu-threads`` and tensor-parallel core sets apply. If the build fails, or
``MOESTREAM_CPU_KERNELS=0``, ``available()`` is False and callers keep the torch path; a failed build is
reported by one warning line.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import threading

import numpy as np
import torch

from ..env import cache_dir, cpu_kernels_enabled, cpu_layer_tuning, cpu_threading
from ..hardware import cpu_flags

log = logging.getLogger("moestream")

# ggml type ids the kernel computes (a subset of quant.gguf_formats.GGML_TYPE_IDS)
TYPES = {"F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14,
         "IQ4_NL": 20, "IQ3_S": 21, "IQ4_XS": 23, "BF16": 30, "MXFP4": 39}
# HF safetensors formats the kernels read (moestream.quant format names -> the C side's ids; not ggml ids)
HF_TYPES = {"nvfp4": 1001, "mxfp4": 1002, "fp8": 1003}
# The library's own layouts: Q4_K / Q4_0 / Q4_1 / Q6_K / Q8_0 with 8 rows interleaved (repack_x8), type id and
# bytes per row of K
X8_TYPES = {"Q4_K": (1012, lambda k: k // 256 * 148), "Q4_0": (1013, lambda k: k // 32 * 18),
            "Q4_1": (1014, lambda k: k // 32 * 20), "Q6_K": (1015, lambda k: k // 256 * 210),
            "Q8_0": (1016, lambda k: k // 32 * 34)}
# their names where a caller names the types of a call (moe_layer's `types`): the GGUF name and "_x8"
X8_NAMES = {f"{name}_x8": tid for name, (tid, _) in X8_TYPES.items()}
# (values, bytes) per block
_BLOCKS = {"F16": (1, 2), "BF16": (1, 2), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
           "Q8_0": (32, 34), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "IQ4_NL": (32, 18),
           "MXFP4": (32, 17), "IQ4_XS": (256, 136), "IQ3_S": (256, 110)}

_SRC = os.path.join(os.path.dirname(__file__), "cpu", "qmatmul.cpp")
# compiled into the one library with _SRC: the decode layer (models/cpu_decode.py), which calls _SRC's kernels
_SRCS = [_SRC, os.path.join(os.path.dirname(__file__), "cpu", "decode.cpp")]
_LOCK = threading.Lock()
_STATE: dict = {}  # "mod": the built module or None once tried


_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
# (name, /proc/cpuinfo flags needed, compiler flags), best first; the build takes the first this CPU has and
# falls back to the next one if the compiler refuses it (an old compiler without -mavx512vnni)
_ISAS = [
    ("avx512vnni", {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
     _AVX2 + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]),
    ("avx2", {"avx2", "fma", "f16c"}, _AVX2),
    ("generic", set(), []),
]


def _isa_candidates() -> list[tuple[str, list[str]]]:
    """The builds this CPU can run, best first (explicit flags, never -march=native: see the module doc)."""
    flags = cpu_flags()
    return [(name, cflags) for name, need, cflags in _ISAS if need <= flags]


def _isa_flags() -> tuple[str, list[str]]:
    return _isa_candidates()[0]


def _build():
    """Compile the C-ABI library with the system C++ compiler into moestream's cache, once per (source,
    flags): no torch headers and no build tool beyond the compiler (a few seconds). The best instruction
    set this CPU has first; if the compiler refuses its flags, the next one."""
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (c++, g++ or clang++) on PATH")
    cands = _isa_candidates()
    for i, (isa, flags) in enumerate(cands):
        try:
            return _build_isa(cxx, isa, flags)
        except RuntimeError as e:
            if i == len(cands) - 1:
                raise
            log.warning("moestream: CPU kernels: %s build failed (%s); trying %s", isa, e, cands[i + 1][0])


_ARGS = ["-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp"]


def build_library(cxx: str, flags: list[str], out: str) -> None:
    """Compile qmatmul.cpp and decode.cpp with `flags` into `out` (raises RuntimeError with the compiler's
    first error)."""
    args = [*_ARGS, *flags]
    r = subprocess.run([cxx, *args, *_SRCS, "-o", out], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        first = next((line for line in r.stderr.splitlines() if "error" in line), r.stderr.strip()[:200])
        raise RuntimeError(f"{cxx} failed: {first}")


def _build_isa(cxx: str, isa: str, flags: list[str]):
    args = [*_ARGS, *flags]
    digest = hashlib.sha256(" ".join(args).encode())
    for src in _SRCS:
        with open(src, "rb") as f:
            digest.update(f.read())
    key = digest.hexdigest()[:16]
    path = cache_dir() / "kernels" / f"qmatmul_{isa}_{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.so")
        build_library(cxx, flags, str(tmp))
        os.replace(tmp, path)  # atomic: a concurrent build or reader sees a whole library
    lib = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.ms_qmatmul.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, ptr, i64, ctypes.c_int, ctypes.c_int]
    lib.ms_qmatmul.restype = ctypes.c_int
    lib.ms_moe_layer.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64,
                                 ctypes.c_int, ctypes.c_int]
    lib.ms_moe_layer.restype = ctypes.c_int
    lib.ms_has_avx2.restype = ctypes.c_int
    lib.ms_isa.restype = ctypes.c_int
    lib.ms_bridge_step.argtypes = [i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, ptr, ptr, ptr, ptr,
                                   ptr, ptr, ptr, ptr, ctypes.c_double, ctypes.c_int, ctypes.c_int, i64, i64]
    lib.ms_bridge_step.restype = ctypes.c_int
    lib.ms_decode_layer.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int]
    lib.ms_decode_layer.restype = ctypes.c_int
    lib.ms_decode_desc_size.restype = ctypes.c_int
    lib.ms_kv_roundtrip.argtypes = [ctypes.c_int, ptr, i64, ptr, ptr, ptr]
    lib.ms_kv_roundtrip.restype = ctypes.c_int
    lib.ms_decode_profile.argtypes = [ctypes.c_int, ptr, ptr]
    lib.ms_decode_profile.restype = ctypes.c_int
    lib.ms_decode_stack.argtypes = [i64, ptr, ptr, ptr, ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr,
                                    i64, i64, ptr, ctypes.c_int]
    lib.ms_decode_stack.restype = ctypes.c_int
    lib.ms_decode_logits.argtypes = [i64, ptr, ptr, ptr, ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64,
                                     ptr, i64, i64, ptr, ptr, ctypes.c_int]
    lib.ms_decode_logits.restype = ctypes.c_int
    lib.ms_gdn_decode.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, ctypes.c_int]
    lib.ms_gdn_decode.restype = ctypes.c_int
    lib.ms_moe_decode.argtypes = [ptr, i64, ptr, ptr, ptr, ctypes.c_int]
    lib.ms_moe_decode.restype = ctypes.c_int
    lib.ms_float_act_matmul.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, ctypes.c_int]
    lib.ms_float_act_matmul.restype = ctypes.c_int
    lib.ms_omp_release_team.restype = ctypes.c_int
    lib.ms_set_threading.argtypes = [ctypes.c_int, i64]
    lib.ms_set_threading.restype = None
    lib.ms_set_layer_tuning.argtypes = [i64, i64, i64, i64, i64, i64]
    lib.ms_set_layer_tuning.restype = None
    lib.ms_get_layer_tuning.argtypes = [ptr]
    lib.ms_get_layer_tuning.restype = None
    lib.ms_layer_profile.argtypes = [ctypes.c_int, ptr]
    lib.ms_layer_profile.restype = None
    lib.ms_fp8_matmul.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, i64, ptr, i64, ctypes.c_int,
                                  ctypes.c_int]
    lib.ms_fp8_matmul.restype = ctypes.c_int
    lib.ms_fp4_matmul.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, ptr, ptr, i64, ctypes.c_int,
                                  ctypes.c_int]
    lib.ms_fp4_matmul.restype = ctypes.c_int
    lib.ms_qmatmul_segs.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, ctypes.c_int, ctypes.c_int]
    lib.ms_qmatmul_segs.restype = ctypes.c_int
    lib.ms_repack_x8.argtypes = [ptr, i64, i64, i64, i64, ptr, ctypes.c_int]
    lib.ms_repack_x8.restype = ctypes.c_int
    lib.ms_dequant_rows.argtypes = [ptr, i64, i64, i64, i64, ptr, i64, ptr, ctypes.c_int]
    lib.ms_dequant_rows.restype = ctypes.c_int
    lib.ms_set_iq3s_grid.argtypes = [ptr]
    lib.ms_set_iq3s_grid.restype = None
    _set_iq3s_grid(lib)
    return lib


def _set_iq3s_grid(lib) -> None:
    """Hand the IQ3_S codebook (data, read from the gguf package like the torch decoder's) to the library;
    without the package IQ3_S stays refused there (row_bytes -1), the other types are unaffected."""
    try:
        import gguf.quants as gq  # the codebook's one source (quant.gguf_formats.iq_grid reads the same)

        gq.IQ3_S.init_grid()
        grid = torch.from_numpy(gq.IQ3_S.grid.copy()).reshape(512, 4).to(torch.uint8).contiguous()  # values 1..15
    except Exception as e:  # no gguf package: the torch path decodes IQ3_S (and fails the same way)
        log.info("moestream: CPU kernels: no IQ3_S codebook (%s)", e)
        return
    _STATE["iq3s_grid"] = grid  # kept alive; the library copies it anyway
    lib.ms_set_iq3s_grid(grid.data_ptr())


def _threads(mod) -> int:
    """torch's intra-op thread count for this call, after passing the pool setting and the layer call's tuning
    (env.cpu_layer_tuning) on when they changed."""
    want = cpu_threading()
    if _STATE.get("threading") != want:
        mod.ms_set_threading(int(want[0]), want[1])
        _STATE["threading"] = want
    raw = os.environ.get("MOESTREAM_CPU_LAYER_TUNING", "")
    if _STATE.get("tuning") != raw:  # parsed only when it changed (this runs at every kernel call)
        mod.ms_set_layer_tuning(*cpu_layer_tuning())
        _STATE["tuning"] = raw
    return torch.get_num_threads()


def omp_release_team() -> bool:
    """Frees the calling thread's OpenMP team (kernels/cpu/qmatmul.cpp ms_omp_release_team: why the cpu/hybrid bridge's
    stepping thread does); False where the library or the OpenMP runtime cannot."""
    mod = module()
    return mod is not None and mod.ms_omp_release_team() == 0


def layer_tuning() -> tuple[int, int, int, int, int, int]:
    """The MoE layer call's tuning in force in the library (chunks per thread, chunk bytes, interleaved groups
    read ahead, rows read ahead, flow, tail), after passing MOESTREAM_CPU_LAYER_TUNING on."""
    mod = _required_module()
    _threads(mod)
    out = np.zeros(6, dtype=np.int64)
    mod.ms_get_layer_tuning(out.ctypes.data)
    return tuple(int(v) for v in out)


LAYER_PROFILE = ("calls", "setup", "p1_first", "p1_last", "p2_first", "p2_last", "total")


def layer_profile(on: bool) -> dict:
    """Turns the MoE layer call's profile on or off and returns what it summed since the last read (seconds; keys
    LAYER_PROFILE: calls, entry to the first thread's start, from then to the first / last thread done with the gate/up
    rows and with the down rows, entry to return), cleared. For benchmarks: a profiled call reads the clock a few
    times a thread."""
    out = np.zeros(len(LAYER_PROFILE))
    _required_module().ms_layer_profile(int(on), out.ctypes.data)
    return dict(zip(LAYER_PROFILE, out.tolist()))


def threads() -> int:
    """The thread count for a kernel call now (torch's intra-op threads; passes a changed pool setting on)."""
    return _threads(module())


def module():
    """The compiled library (ctypes), building it on first use; None if the build failed."""
    if "mod" in _STATE:
        return _STATE["mod"]
    with _LOCK:
        if "mod" not in _STATE:
            mod = None
            try:
                mod = _build()
            except Exception as e:  # no compiler, no headers, ...: the torch path still works
                log.warning("moestream: CPU quant kernels unavailable (%s: %s); using the torch tile decoders",
                            type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            _STATE["mod"] = mod
    return _STATE["mod"]


def available() -> bool:
    """Whether the kernels run: MOESTREAM_CPU_KERNELS is not 0 (read at each call, so a test or a user can
    switch them off at run time) and the library is built."""
    return cpu_kernels_enabled() and module() is not None


def supports(type_name: str) -> bool:
    """Whether the kernels read this GGUF type (IQ3_S: only once its codebook reached the library)."""
    if type_name == "IQ3_S":
        return module() is not None and "iq3s_grid" in _STATE
    return type_name in TYPES


def type_id(type_name: str) -> int:
    """The C side's id of a GGUF type name (upper case, TYPES), an HF FP4 format's name (lower case, HF_TYPES:
    "mxfp4" is gpt-oss's safetensors layout, "MXFP4" GGUF's) or an interleaved copy's ("Q4_K_x8", X8_NAMES);
    KeyError for one it lacks."""
    if type_name in TYPES:
        return TYPES[type_name]
    return HF_TYPES[type_name] if type_name in HF_TYPES else X8_NAMES[type_name]


def block_values(type_name: str) -> int:
    """Values per block of a GGUF type the kernels read (a row's k must be a multiple)."""
    return _BLOCKS[type_name][0]


def row_bytes(type_name: str, k: int) -> int:
    """Bytes of one row of k values of a GGUF type the kernels read (k a multiple of its block)."""
    values, nbytes = _BLOCKS[type_name]
    return k // values * nbytes


def rows_matmul(x: torch.Tensor, raw2d: torch.Tensor, type_id: int) -> torch.Tensor:
    """The per-step fast path (QuantLinear): x float32 contiguous [n, K], raw2d uint8 [N, row_bytes] already
    checked by the caller; returns float32 [n, N]. Skips qmatmul's conversions and checks (~10 us a call)."""
    n, k = x.shape
    out = torch.empty(n, raw2d.shape[0], dtype=torch.float32)
    mod = _STATE["mod"]
    mod.ms_qmatmul(x.data_ptr(), n, k, raw2d.data_ptr(), raw2d.shape[0], raw2d.stride(0), type_id,
                   out.data_ptr(), raw2d.shape[0], _threads(mod), 0)
    return out


def x8_matmul(x: torch.Tensor, addr: int, n_out: int, row_bytes: int, type_id: int) -> torch.Tensor:
    """rows_matmul for an interleaved copy (repack_x8's: its address, rows, bytes per row, type id), which the
    caller keeps alive; float32 [n, n_out]."""
    n, k = x.shape
    out = torch.empty(n, n_out, dtype=torch.float32)
    mod = _STATE["mod"]
    mod.ms_qmatmul(x.data_ptr(), n, k, addr, n_out, row_bytes, type_id, out.data_ptr(), n_out, _threads(mod), 0)
    return out


def dequant_rows(raw2d: torch.Tensor, type_id: int, ids: torch.Tensor, K: int) -> torch.Tensor | None:
    """Rows `ids` of a weight stored as GGUF bytes (raw2d uint8 [N, row_bytes], rows contiguous) as float32
    [len(ids), K]: an embedding lookup without the torch tile decoder's ~20 small ops. None where the library
    has no scalar unpacker for the type (IQ4_XS, IQ3_S) or is not built; IndexError for an id out of range."""
    mod = module()
    if mod is None or raw2d.device.type != "cpu" or raw2d.stride(1) != 1:
        return None
    raw2d = raw2d.view(torch.uint8)  # 16-bit rows as their bytes
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), K, dtype=torch.float32)
    rc = mod.ms_dequant_rows(raw2d.data_ptr(), raw2d.shape[0], raw2d.stride(0), type_id, K, ids.data_ptr(),
                             ids.numel(), out.data_ptr(), _threads(mod))
    if rc == -3:
        raise IndexError(f"embedding row out of range [0, {raw2d.shape[0]})")
    return out if rc == 0 else None


FLOAT_ACT_TYPES = ("Q8_0", "Q6_K")  # types float_act_matmul reads


def float_act_matmul(x: torch.Tensor, raw2d: torch.Tensor, type_id: int) -> torch.Tensor:
    """As rows_matmul for Q8_0 / Q6_K weights, with float32 activations (no int8 rounding; decode.cpp)."""
    n, k = x.shape
    out = torch.empty(n, raw2d.shape[0], dtype=torch.float32)
    mod = _STATE["mod"]
    rc = mod.ms_float_act_matmul(x.data_ptr(), n, k, raw2d.data_ptr(), raw2d.shape[0], raw2d.stride(0),
                                 out.data_ptr(), raw2d.shape[0], type_id, _threads(mod))
    if rc:
        raise ValueError(f"float-activation matmul: type {type_id} with in_features {k} is not supported")
    return out


ACT_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_LAYER_ERRORS = {-1: "a weight type or shape the kernels lack", -2: "bad groups or dtypes", -3: "a pair row out of range"}


def moe_layer(x: torch.Tensor, wptr: np.ndarray, types: tuple[str, str, str], starts: np.ndarray, rows: np.ndarray,
              weights: np.ndarray | None, dst: np.ndarray, out: torch.Tensor, inter: int,
              h_dtype: torch.dtype = torch.float32, round_mm: bool = False, force_scalar: bool = False) -> torch.Tensor:
    """One MoE layer call's (token, expert) pairs in one C call (``ms_moe_layer`` in qmatmul.cpp).

    x [nx, H] float32/bf16/f16 (contiguous); G experts with pairs grouped by expert: group g is pairs
    ``starts[g]:starts[g+1]``; pair p reads x row ``rows[p]`` and writes ``out[dst[p]]`` (out: float32 [n, H],
    rows contiguous). ``wptr`` int64 [G, 3]: addresses of expert g's gate [I, H], up [I, H], down [H, I]
    bytes (ggml ``types``, each matrix's rows contiguous; an HF type (HF_TYPES): the address of the
    matrix's descriptor, ``fp4_descriptors`` / ``fp8_descriptors``). Per pair: ``out = w * down(round(silu(gate x) *
    up x))`` with float32 matmul outputs, h rounded to ``h_dtype`` (the pair kernels' semantics; round_mm:
    every matmul output rounded too, PairMlp's dense semantics); ``weights`` float32 [P] or None (1).
    The caller keeps the weight bytes alive and sized; the rest is checked here or in C."""
    mod = _required_module()
    if x.dim() != 2 or x.dtype not in ACT_DTYPES or not x.is_contiguous() or x.device.type != "cpu":
        raise ValueError(f"x must be a contiguous CPU [n, H] float32/bf16/f16 tensor, got {x.dtype} {tuple(x.shape)}")
    if h_dtype not in ACT_DTYPES:
        raise ValueError(f"h_dtype must be float32, bfloat16 or float16, got {h_dtype}")
    if out.dtype != torch.float32 or out.dim() != 2 or out.shape[1] != x.shape[1] or out.stride(1) != 1:
        raise ValueError(f"out must be a float32 [n, {x.shape[1]}] tensor with contiguous rows")
    G = len(starts) - 1
    P = int(starts[-1]) if G >= 0 else 0
    wptr = np.ascontiguousarray(wptr, dtype=np.int64)
    starts, rows, dst = (np.ascontiguousarray(a, dtype=np.int64) for a in (starts, rows, dst))
    if G < 0 or wptr.shape != (G, 3) or rows.shape != (P,) or dst.shape != (P,) or int(starts[0]) != 0:
        raise ValueError(f"moe_layer: {G} groups need wptr [G, 3], starts [G + 1] from 0, rows and dst [{P}]")
    if weights is not None:
        weights = np.ascontiguousarray(weights, dtype=np.float32)
        if weights.shape != (P,):
            raise ValueError(f"moe_layer: weights must be [{P}]")
    tids = np.array([type_id(t) for t in types], dtype=np.int64)
    rc = mod.ms_moe_layer(x.data_ptr(), ACT_DTYPES[x.dtype], x.shape[0], x.shape[1], inter, G, wptr.ctypes.data,
                          tids.ctypes.data, starts.ctypes.data, rows.ctypes.data,
                          weights.ctypes.data if weights is not None else None, dst.ctypes.data, out.data_ptr(),
                          out.shape[0], out.stride(0), ACT_DTYPES[h_dtype], int(round_mm), _threads(mod),
                          int(force_scalar))
    if rc:
        raise ValueError(f"CPU MoE layer kernel ({'/'.join(types)}, H={x.shape[1]}, I={inter}): "
                         f"{_LAYER_ERRORS.get(rc, rc)}")
    return out


def moe_layer_unchecked(x: torch.Tensor, wptr: np.ndarray, tids: np.ndarray, starts: np.ndarray, rows: np.ndarray,
                        weights: np.ndarray, dst: np.ndarray, out: torch.Tensor, inter: int, h_code: int,
                        round_mm: bool) -> None:
    """moe_layer for a caller that built and checked every argument itself (moe/cpu_moe.LayerCall: int64 /
    float32 contiguous arrays, ggml type ids, the activation dtype code): one C call, no conversions. The C
    side still checks groups and rows (an error raises ValueError)."""
    mod = _STATE["mod"]
    rc = mod.ms_moe_layer(x.data_ptr(), ACT_DTYPES[x.dtype], x.shape[0], x.shape[1], inter, len(starts) - 1,
                          wptr.ctypes.data, tids.ctypes.data, starts.ctypes.data, rows.ctypes.data, weights.ctypes.data,
                          dst.ctypes.data, out.data_ptr(), out.shape[0], out.stride(0), h_code, int(round_mm),
                          _threads(mod), 0)
    if rc:
        raise ValueError(f"CPU MoE layer kernel (type ids {tids.tolist()}, H={x.shape[1]}, I={inter}): "
                         f"{_LAYER_ERRORS.get(rc, rc)}")


def bridge_step(seq: int, arrays: dict, timeout_s: float, first: int = 0, hold_pool: bool = False,
                ahead: tuple[int, int] = (-1, -1)) -> int:
    """One decode step of the CPU bridge's worker in C (``ms_bridge_step``): every layer's request from index
    `first` on waited for, computed and answered without the interpreter (the GIL is released for the whole
    step). ``arrays``: moe/bridge.CpuBridge's pinned request/answer arrays and per-layer weight tables (see
    CpuBridge._c_tables); `first` > 0 passes every per-layer array from that layer on (the C loop indexes them
    from its start). hold_pool: the layer calls run on the library's pool, whose threads spin from the step's
    first call to its end (no wake-up per layer; for a host whose cores serve the bridge, not a shared one).
    ahead (x8, rows): the step's layer calls read interleaved 8-row groups / rows of the file's layouts that far ahead
    (-1: the library's settings, env.cpu_layer_tuning). Returns 0, -4 (cancelled: the step ended without posting a layer), -5 (timeout) or a layer call error."""
    mod = _STATE["mod"]
    a, f = arrays, first
    P, H = a["P"], a["H"]
    xsize = 4 if a["xdtype"] == 0 else 2  # (ms_bridge_step's esize)
    return mod.ms_bridge_step(a["L"] - f, seq, a["req"] + 8 * f, a["done"] + 8 * f, a["meta"] + 16 * f,
                              a["ids"] + 8 * f * P, a["hw"] + 4 * f * P, a["hx"] + xsize * f * P * H, a["xdtype"],
                              a["hy"] + 4 * f * P * H, P, H, a["I"], a["wbase"].reshape(-1)[3 * f:].ctypes.data,
                              a["wstep"].reshape(-1)[3 * f:].ctypes.data, a["wtype"].reshape(-1)[3 * f:].ctypes.data,
                              a["lflags"][f:].ctypes.data, a["experts"][f:].ctypes.data, a["secs"][f:].ctypes.data,
                              a["waits"][2 * f:].ctypes.data, a["cancel"].ctypes.data, float(timeout_s), _threads(mod), int(hold_pool),
                              int(ahead[0]), int(ahead[1]))


def has_avx2() -> bool:
    mod = module()
    return bool(mod is not None and mod.ms_has_avx2())


def isa() -> str | None:
    """The instruction set the loaded library was built for ("avx512vnni", "avx2", "generic"), or None."""
    mod = module()
    return None if mod is None else ("generic", "avx2", "avx512vnni")[mod.ms_isa()]


def _required_module():
    """The compiled library; RuntimeError where it could not be built."""
    mod = module()
    if mod is None:
        raise RuntimeError("CPU quant kernels are not available")
    return mod


def _float_rows(x: torch.Tensor):
    """(library, x as contiguous float32 rows [n, K], K) for the matmuls below."""
    mod = _required_module()
    k = x.shape[-1]
    x = x.reshape(-1, k)
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    return mod, x, k


def qmatmul(x: torch.Tensor, raw: torch.Tensor, type_name: str, out: torch.Tensor | None = None,
            force_scalar: bool = False) -> torch.Tensor:
    """``x [n, K] @ W.T`` as float32 ``[n, N]``; ``raw`` holds W's GGUF bytes as ``[N, row_bytes]``
    (any dtype; it is viewed as bytes; rows may be strided). ``out``: a float32 ``[n, N]`` view whose
    rows may be strided. ``force_scalar`` runs the portable kernels (tests)."""
    mod, x, k = _float_rows(x)
    if raw.dtype != torch.uint8:
        raw = raw.contiguous().view(torch.uint8)
    if raw.dim() != 2 or raw.stride(-1) != 1:
        raw = raw.contiguous().reshape(raw.shape[0] if raw.dim() == 2 else -1, raw.shape[-1])
    n_out = raw.shape[0]
    bs, ts = _BLOCKS[type_name]
    if k % bs or raw.shape[1] != k // bs * ts:
        raise ValueError(f"{type_name}: K={k} needs rows of {k // bs * ts} bytes in blocks of {bs}; got {raw.shape[1]}")
    if out is None:
        out = torch.empty(x.shape[0], n_out, dtype=torch.float32)
    if out.dtype != torch.float32 or out.shape != (x.shape[0], n_out) or out.stride(-1) != 1:
        raise ValueError(f"out must be a float32 [{x.shape[0]}, {n_out}] view with contiguous rows")
    rc = mod.ms_qmatmul(x.data_ptr(), x.shape[0], k, raw.data_ptr(), n_out, raw.stride(0), TYPES[type_name],
                        out.data_ptr(), out.stride(0), _threads(mod), int(force_scalar))
    if rc:
        raise ValueError(f"CPU quant kernel: type {type_name} with K={k} is not supported")
    return out


def fp8_matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], scale_stride: int,
               out: torch.Tensor | None = None, force_scalar: bool = False) -> torch.Tensor:
    """``x [n, K] @ (W * S).T`` as float32 ``[n, N]`` for HF FP8 weights: ``w`` float8_e4m3fn (or its uint8
    bytes) ``[N, K]`` with contiguous rows, ``scale`` float32 with the scale of row i, column k at
    ``scale.flat[(i // block[0]) * scale_stride + k // block[1]]`` (block FP8: ``weight_scale_inv``
    [ceil(N/128), ceil(K/128)], block (128, 128), stride its row length; a per-row scale: block (1, K),
    stride 1; one scale: block (N, K), stride 0). x multiplies in float32 (no activation rounding); NaN
    codes (0x7F / 0xFF) read as +-480 on the AVX2 path (checkpoints hold none)."""
    mod, x, k = _float_rows(x)
    w = w.view(torch.uint8) if w.dtype != torch.uint8 else w
    scale = scale.to(torch.float32).contiguous()
    bn, bk = block
    if w.dim() != 2 or w.shape[1] != k or w.stride(1) != 1:
        raise ValueError(f"fp8_matmul: w must be [N, {k}] with contiguous rows, got {tuple(w.shape)}")
    n_out = w.shape[0]
    need = ((n_out - 1) // bn) * scale_stride + (k - 1) // bk + 1
    if scale.numel() < need:
        raise ValueError(f"fp8_matmul: {scale.numel()} scales, the blocks need {need}")
    if out is None:
        out = torch.empty(x.shape[0], n_out, dtype=torch.float32)
    if out.dtype != torch.float32 or out.shape != (x.shape[0], n_out) or out.stride(-1) != 1:
        raise ValueError(f"out must be a float32 [{x.shape[0]}, {n_out}] view with contiguous rows")
    rc = mod.ms_fp8_matmul(x.data_ptr(), x.shape[0], k, w.data_ptr(), n_out, w.stride(0), scale.data_ptr(), bn, bk,
                           scale_stride, out.data_ptr(), out.stride(0), _threads(mod), int(force_scalar))
    if rc:
        raise ValueError(f"fp8_matmul: bad block {block} or stride {scale_stride}")
    return out


def fp4_descriptors(codes: np.ndarray, scales: np.ndarray, global_scales: np.ndarray | None) -> np.ndarray:
    """Descriptors of HF FP4 matrices for ``moe_layer``'s wptr: int64 [..., 3] (the addresses of each matrix's
    code bytes, scale bytes and float32 global scale, 0 for none: qmatmul.cpp's FP4Desc; rows contiguous). The
    caller passes ``descriptors.ctypes.data + 24 * index`` and keeps the array alive while it is used."""
    codes = np.asarray(codes, dtype=np.int64)
    g = np.zeros_like(codes) if global_scales is None else np.asarray(global_scales, dtype=np.int64)
    return np.ascontiguousarray(np.stack([codes, np.asarray(scales, dtype=np.int64), g], -1))


def fp8_descriptors(codes: np.ndarray, scales: np.ndarray, block: tuple[int, int], scale_stride: int,
                    bf16_scales: bool = False) -> np.ndarray:
    """Descriptors of HF FP8 matrices for ``moe_layer``'s wptr: int64 [..., 6] (each matrix's code bytes and scales,
    then the scale layout as ``fp8_matmul`` takes it: block rows, block columns, scales per scale row; then 1 for
    bf16 scales, 0 for float32; qmatmul.cpp's FP8Desc; rows contiguous). The caller passes
    ``descriptors.ctypes.data + 48 * index`` and keeps the array alive while it is used."""
    codes = np.asarray(codes, dtype=np.int64)
    lay = np.broadcast_to(np.array([block[0], block[1], scale_stride, int(bf16_scales)], dtype=np.int64),
                          (*codes.shape, 4))
    return np.ascontiguousarray(np.concatenate([np.stack([codes, np.asarray(scales, dtype=np.int64)], -1), lay], -1))


def fp4_matmul(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, fmt: str, global_scale=None,
               out: torch.Tensor | None = None, force_scalar: bool = False) -> torch.Tensor:
    """``x [n, K] @ W.T`` as float32 ``[n, N]`` for HF FP4 weights as stored: ``w`` uint8 ``[N, K/2]`` (two e2m1
    codes a byte, element 2i in the low nibble), ``scales`` ``[N, K/16]`` e4m3 bytes (fmt "nvfp4") or
    ``[N, K/32]`` e8m0 bytes ("mxfp4"), rows of each with contiguous bytes (rows may be strided);
    ``global_scale``: NVFP4's ``weight_scale_2`` (one value; None: 1). x is rounded to int8 per 32 values
    (the module doc bounds the error); K must be a multiple of 32."""
    if fmt not in HF_TYPES:
        raise ValueError(f"fp4_matmul: format {fmt!r} is not one of {sorted(HF_TYPES)}")
    mod, x, k = _float_rows(x)
    w = w.view(torch.uint8) if w.dtype != torch.uint8 else w
    scales = scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales
    per = 16 if fmt == "nvfp4" else 32
    n_out = w.shape[0]
    if k % 32 or w.dim() != 2 or w.shape[1] != k // 2 or w.stride(1) != 1:
        raise ValueError(f"fp4_matmul: K={k} (a multiple of 32) needs w [N, {k // 2}] with contiguous rows, "
                         f"got {tuple(w.shape)}")
    if scales.dim() != 2 or scales.shape != (n_out, k // per) or scales.stride(1) != 1:
        raise ValueError(f"fp4_matmul: {fmt} needs scales [{n_out}, {k // per}] with contiguous rows, "
                         f"got {tuple(scales.shape)}")
    g = None
    if global_scale is not None:
        g = torch.as_tensor(global_scale, dtype=torch.float32).reshape(-1)
        if g.numel() != 1:
            raise ValueError(f"fp4_matmul: one global scale, got {g.numel()}")
        g = g.contiguous()
    if out is None:
        out = torch.empty(x.shape[0], n_out, dtype=torch.float32)
    if out.dtype != torch.float32 or out.shape != (x.shape[0], n_out) or out.stride(-1) != 1:
        raise ValueError(f"out must be a float32 [{x.shape[0]}, {n_out}] view with contiguous rows")
    rc = mod.ms_fp4_matmul(x.data_ptr(), x.shape[0], k, HF_TYPES[fmt], w.data_ptr(), n_out, w.stride(0),
                           scales.data_ptr(), scales.stride(0), None if g is None else g.data_ptr(), out.data_ptr(),
                           out.stride(0), _threads(mod), int(force_scalar))
    if rc:
        raise ValueError(f"fp4_matmul: {fmt} with K={k} is not supported")
    return out


def x8_fits(type_name: str | None, rows: int, k: int) -> bool:
    """Whether a rows x k matrix of GGUF type `type_name` has an 8-row interleaved layout (repack_x8 takes it)."""
    return type_name in X8_TYPES and rows % 8 == 0 and k % block_values(type_name) == 0


def repack_x8(addr: int, rows: int, k: int, stride: int, type_name: str,
              out: np.ndarray | None = None) -> tuple[np.ndarray, int, int]:
    """`rows` rows of a Q4_K / Q4_0 / Q4_1 / Q6_K matrix at `addr` (`stride` bytes apart, k columns) with 8 rows
    interleaved, the kernels' layout for one-row products (qmatmul.cpp: the "8 rows interleaved" sections):
    (uint8 array, its type id, bytes per row). `out`: an array of that many bytes to fill instead of a new one.
    ValueError for another type, rows % 8 or k not a multiple of the block."""
    if type_name not in X8_TYPES:
        raise ValueError(f"no 8-row interleaved layout for {type_name}")
    tid, row_bytes = X8_TYPES[type_name]
    nbytes = rows * row_bytes(k)
    if out is None:
        out = np.empty(nbytes, dtype=np.uint8)
    if out.nbytes != nbytes or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise ValueError(f"interleaved {type_name}: {nbytes} contiguous bytes expected")
    got = module().ms_repack_x8(addr, rows, k, stride, TYPES[type_name], out.ctypes.data, threads())
    if got != tid:
        raise ValueError(f"interleaved {type_name} needs rows % 8 == 0 and whole blocks (rows {rows}, k {k})")
    return out, tid, row_bytes(k)

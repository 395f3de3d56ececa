"""Decode attention split over the KV length (Triton): one query token per sequence against a long KV.

The torch path (attention.py `_decode_padded`) gathers each sequence's K/V rows into a padded copy and
calls SDPA with the query heads of one KV head as that head's query rows: the work is spread over
batch x KV heads programs only, so at batch 1 with 2 KV heads (Qwen3.6) two SMs read the whole context.
At a 32k-token context the 24 GiB edge run decoded 27 tok/s where short prompts give ~200 (2026-12-05
sixteenth session, benchmarks/RESULTS.md).

Here the KV positions of every (sequence, KV head) are cut into splits of whole key blocks, one program
per (sequence, KV head, split): it loads the G query heads sharing that KV head once (padded to 16 rows
for `tl.dot`), reads its keys and values straight from the token-indexed cache through the step's padded
KV index (no gathered copy), and keeps a running max, denominator and unnormalised output (online
softmax, fp32). A second kernel, one program per (sequence, query head), merges the splits. The split
count depends only on the padded width and the batch, so a recorded CUDA graph replays it for every length
up to its bucket; splits past a sequence's length store an empty partial. Scores and the P.V products run
on tensor cores in the cache's 16-bit dtype with fp32 accumulation (as SDPA's fused kernels do); a
float32 cache runs in full fp32; an fp8 (e4m3fn) cache's keys and values are decoded in registers to the
queries' dtype (integer arithmetic: no fp8 hardware needed). MOESTREAM_SPLIT_DECODE=0 (env.split_decode_enabled) keeps the torch path.
Tests: tests/test_attn_decode.py (the kernels under TRITON_INTERPRET=1 on CPU tensors against SDPA).
"""
from __future__ import annotations

import functools
import logging

import torch

from ..env import split_decode_enabled, triton_enabled, triton_interpreted
from .triton_ops import fp8_decode

try:  # optional: absent on CPU-only installs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

log = logging.getLogger("moestream.layers")
BLOCK_N = 64  # keys per inner step

MAX_SPLITS = 256


if triton is not None:
    @triton.jit
    def _block(q, k_ptr, v_ptr, idx_row, start, hi, h, K_ST, K_SH, V_ST, V_SH, m, lsum, acc, d,
               BLOCK: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr, qpos=0, CAUSAL: tl.constexpr = False):
        """One block of keys from `start` (those < hi valid) folded into the running max, sum and output. FP8: the
        caches are uint8 views of e4m3fn caches, decoded to the query's dtype. CAUSAL (prefill, attn_prefill.py):
        each query row sees only the keys at or before its position qpos [rows]; key 0 is visible to every row, so
        the max stays finite from the first block."""
        n = start + tl.arange(0, BLOCK)
        nm = n < hi
        tok = tl.load(idx_row + n, mask=nm, other=0)
        k = tl.load(k_ptr + tok[:, None] * K_ST + h * K_SH + d[None, :], mask=nm[:, None], other=0)
        if FP8:
            k = fp8_decode(k).to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if CAUSAL:
            s = tl.where(nm[None, :] & (n[None, :] <= qpos[:, None]), s, float("-inf"))
        else:
            s = tl.where(nm[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: the block's first key is valid
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        lsum = lsum * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + tok[:, None] * V_ST + h * V_SH + d[None, :], mask=nm[:, None], other=0)
        if FP8:
            v = fp8_decode(v).to(q.dtype)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        return m_new, lsum, acc * alpha[:, None] + pv

    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, idx_ptr, len_ptr, po_ptr, pml_ptr,
                      Q_SB, Q_SH, K_ST, K_SH, V_ST, V_SH, IDX_SB, HK, NSPLIT, SPLIT_KEYS, scale,
                      G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                      IEEE: tl.constexpr, WHILE: tl.constexpr, FP8: tl.constexpr = False):
        bh = tl.program_id(0)  # sequence * HK + KV head
        sp = tl.program_id(1)
        b = bh // HK
        h = bh % HK
        length = tl.load(len_ptr + b)
        lo = sp * SPLIT_KEYS
        hi = tl.minimum(lo + SPLIT_KEYS, length)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        gm = g < G
        q = tl.load(q_ptr + b * Q_SB + (h * G + g)[:, None] * Q_SH + d[None, :], mask=gm[:, None], other=0.0)
        q = (q.to(tl.float32) * scale).to(q_ptr.dtype.element_ty)  # (the cache's dtype unless FP8)
        m = tl.full([GP], float("-inf"), tl.float32)
        lsum = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        idx_row = idx_ptr + b * IDX_SB
        if WHILE:  # Triton's CPU interpreter: no loop with run-time bounds but `while`
            start = lo
            while start < hi:
                m, lsum, acc = _block(q, k_ptr, v_ptr, idx_row, start, hi, h, K_ST, K_SH, V_ST, V_SH, m, lsum,
                                      acc, d, BLOCK, IEEE, FP8)
                start += BLOCK
        else:  # compiled: a `for` the compiler pipelines
            for start in range(lo, hi, BLOCK):
                m, lsum, acc = _block(q, k_ptr, v_ptr, idx_row, start, hi, h, K_ST, K_SH, V_ST, V_SH, m, lsum,
                                      acc, d, BLOCK, IEEE, FP8)
        base = bh * NSPLIT + sp
        tl.store(po_ptr + base * GP * D + g[:, None] * D + d[None, :], acc)
        tl.store(pml_ptr + base * 2 * GP + g, m)
        tl.store(pml_ptr + base * 2 * GP + GP + g, lsum)

    @triton.jit
    def _merge_kernel(po_ptr, pml_ptr, out_ptr, O_SB, O_SH, HK, NSPLIT,
                      G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, SP: tl.constexpr):
        pid = tl.program_id(0)  # sequence * H + query head
        H = HK * G
        b = pid // H
        hq = pid % H
        h = hq // G
        g = hq % G
        bh = b * HK + h
        s = tl.arange(0, SP)
        sm = s < NSPLIT
        pml = pml_ptr + (bh * NSPLIT + s) * 2 * GP + g
        m = tl.load(pml, mask=sm, other=float("-inf"))
        lsum = tl.load(pml + GP, mask=sm, other=0.0)
        mx = tl.max(m, 0)  # finite: split 0 holds the first key of every sequence
        w = tl.where(m > float("-inf"), tl.exp(m - mx), 0.0)
        denom = tl.sum(w * lsum, 0)
        d = tl.arange(0, D)
        acc = tl.zeros([D], tl.float32)
        for i in range(SP):  # splits past NSPLIT: weight 0, nothing read
            wi = tl.sum(tl.where(s == i, w, 0.0), 0)
            acc += wi * tl.load(po_ptr + ((bh * NSPLIT + i) * GP + g) * D + d, mask=(d < D) & (i < NSPLIT),
                                other=0.0)
        tl.store(out_ptr + b * O_SB + hq * O_SH + d, (acc / denom).to(out_ptr.dtype.element_ty))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _splits(width: int, rows: int, device: torch.device) -> tuple[int, int]:
    """(splits, keys per split) for a padded width and rows = sequences x KV heads: about two programs per SM
    in all, whole key blocks per split. Depends on shapes only (graph-stable)."""
    blocks = triton.cdiv(width, BLOCK_N)
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4
    n = max(1, min(blocks, triton.cdiv(2 * sms, rows), MAX_SPLITS))
    keys = triton.cdiv(blocks, n) * BLOCK_N
    return triton.cdiv(width, keys), keys


_FAILED: list[str] = []  # the first launch's error, if the kernels could not run on this GPU (then torch for good)


def usable(q: torch.Tensor, k_cache: torch.Tensor, force: bool = False) -> bool:
    """The kernels apply: Triton on CUDA tensors (or forced, e.g. CPU tensors under TRITON_INTERPRET=1),
    power-of-two head size 16-256, a 16/32-bit or fp8 (e4m3fn) cache with token-major rows [tokens, KV heads, head
    dim]; bf16 (the cache's, or an fp8 cache's queries) needs bf16 tensor cores (compute capability 8.0 or later:
    not Turing, whose fp16 and fp32 caches run)."""
    if triton is None or _FAILED or not (force or (q.is_cuda and triton_enabled() and split_decode_enabled())):
        return False
    D = q.shape[-1]
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    compute = q.dtype if fp8 else k_cache.dtype
    if compute == torch.bfloat16 and k_cache.is_cuda and torch.cuda.get_device_capability(k_cache.device)[0] < 8:
        return False
    return (D & (D - 1) == 0 and 16 <= D <= 256 and compute in (torch.bfloat16, torch.float16, torch.float32)
            and k_cache.dim() == 3 and k_cache.stride(-1) == 1 and q.stride(-1) == 1)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, idx: torch.Tensor,
                     lengths: torch.Tensor, scale: float) -> torch.Tensor | None:
    """q [B, H, D] (one token per sequence), k_cache / v_cache [tokens, Hk, D], idx [B, W] the KV rows of each
    sequence (the first lengths[b] entries valid, lengths >= 1) -> [B, H, D] in q's dtype. None where the kernels
    fail to compile or launch on this GPU (the first call is eager: CUDA graphs record after one): one warning, and
    `usable` says no from then on, so the caller's torch path serves. Out of memory is raised as it is."""
    try:
        return _decode_attention(q, k_cache, v_cache, idx, lengths, scale)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - a compiler or launch error on this GPU: report once, use torch
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise
        _FAILED.append(f"{type(e).__name__}: {e}")
        log.warning("split-KV decode attention disabled for this process (%s); decode attention falls back to "
                    "gather + SDPA", _FAILED[0][:300])
        return None


def kernel_operands(q, k_cache, v_cache):
    """(q, k, v, fp8) as the attention kernels read them: an fp8 (e4m3fn) cache as its uint8 view (decoded to the
    queries' dtype in the kernel), else the queries in the cache's dtype."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8:
        return q, k_cache.view(torch.uint8), v_cache.view(torch.uint8), True
    return (q if q.dtype == k_cache.dtype else q.to(k_cache.dtype)), k_cache, v_cache, False


def _decode_attention(q, k_cache, v_cache, idx, lengths, scale: float) -> torch.Tensor:
    B, H, D = q.shape
    Hk = k_cache.shape[1]
    G = H // Hk
    GP = max(16, triton.next_power_of_2(G))
    W = idx.shape[1]
    nsplit, keys = _splits(W, B * Hk, q.device)
    po = torch.empty((B * Hk * nsplit, GP, D), dtype=torch.float32, device=q.device)
    pml = torch.empty((B * Hk * nsplit, 2, GP), dtype=torch.float32, device=q.device)
    dtype = q.dtype
    q, k_cache, v_cache, fp8 = kernel_operands(q, k_cache, v_cache)
    idx = idx if idx.stride(-1) == 1 else idx.contiguous()
    ieee = q.dtype == torch.float32
    _split_kernel[(B * Hk, nsplit)](q, k_cache, v_cache, idx, lengths, po, pml, q.stride(0), q.stride(1),
                                    k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
                                    idx.stride(0), Hk, nsplit, keys, scale, G=G, GP=GP, D=D, BLOCK=BLOCK_N,
                                    IEEE=ieee, WHILE=triton_interpreted(), FP8=fp8,
                                    num_warps=4 if D <= 128 else 8, num_stages=2)
    out = torch.empty((B, H, D), dtype=dtype, device=q.device)
    _merge_kernel[(B * H,)](po, pml, out, out.stride(0), out.stride(1), Hk, nsplit, G=G, GP=GP, D=D,
                            SP=triton.next_power_of_2(nsplit), num_warps=4)
    return out

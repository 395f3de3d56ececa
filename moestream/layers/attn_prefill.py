"""Prefill attention over the paged KV pool (Triton): a chunk's queries against their whole context, causal.

The torch paths (attention.py) gather the context's K/V rows into one copy and call SDPA (`_attend`: 512 MiB of
bf16 K/V at 262k tokens of the Qwen3.6 shape, beyond what the plan holds), or walk the context in key blocks in
float32 torch ops (`_attend_blocks`: bounded memory, no tensor cores). Here one program takes ROWS query rows of
one KV head with the G query heads that share it, packed into one [ROWS x GP, D] tile (GP: G padded to a power of
two), and reads that head's keys and values straight from the token-indexed cache through the sequence's KV index
in blocks of BLOCK keys, up to its last row's position: scores and P.V on tensor cores in the cache's 16-bit dtype
with fp32 accumulation (a float32 cache: full fp32), a running max, denominator and output per tile row (online
softmax, fp32), the causal mask applied per row (row r sits at position cached + r): the decode kernel's inner
block (attn_decode._block) with its CAUSAL mask. Nothing is gathered; the only memory is the output. An fp8 (e4m3fn)
cache is decoded in registers to the queries' dtype, as attn_decode does.

Used by attention.py where the gathered path would pass GATHER_BYTES (a long context's late chunks); where the
kernel cannot compile or launch on this GPU it says so once and the torch blocks serve (the decode kernel's rule).
Tests: tests/test_attn_prefill.py (the kernel under TRITON_INTERPRET=1 against float64 attention; compiled for
sm_90 and sm_80 without spills).
"""
from __future__ import annotations

import logging

import torch

from ..env import triton_enabled, triton_interpreted

try:  # optional: absent on CPU-only installs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
if triton is not None:
    from .attn_decode import _block, kernel_operands

log = logging.getLogger("moestream.layers")
TILE_ROWS = 64  # query rows x padded group heads per program (ROWS = TILE_ROWS // GP query rows)
BLOCK_N = 32  # keys per inner step

if triton is not None:
    @triton.jit
    def _prefill_kernel(q_ptr, k_ptr, v_ptr, idx_ptr, o_ptr, Q_ST, Q_SH, K_ST, K_SH, V_ST, V_SH, O_ST, O_SH,
                        L, cached, scale,
                        G: tl.constexpr, GP: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
                        BLOCK: tl.constexpr, IEEE: tl.constexpr, WHILE: tl.constexpr, FP8: tl.constexpr):
        pr = tl.program_id(0)  # block of ROWS query rows
        h = tl.program_id(1)  # KV head
        i = tl.arange(0, ROWS * GP)
        r = pr * ROWS + i // GP  # the tile row's query row ...
        g = i % GP  # ... and its query head within the group
        live = (r < L) & (g < G)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + r[:, None] * Q_ST + (h * G + g)[:, None] * Q_SH + d[None, :], mask=live[:, None],
                    other=0.0)
        q = (q.to(tl.float32) * scale).to(q_ptr.dtype.element_ty)
        qpos = cached + r
        hi = tl.minimum(cached + (pr + 1) * ROWS, cached + L)  # keys up to the block's last row, inclusive
        m = tl.full([ROWS * GP], float("-inf"), tl.float32)
        lsum = tl.zeros([ROWS * GP], tl.float32)
        acc = tl.zeros([ROWS * GP, D], tl.float32)
        if WHILE:  # Triton's CPU interpreter: no loop with run-time bounds but `while`
            start = hi * 0
            while start < hi:
                m, lsum, acc = _block(q, k_ptr, v_ptr, idx_ptr, start, hi, h, K_ST, K_SH, V_ST, V_SH, m, lsum, acc,
                                      d, BLOCK, IEEE, FP8, qpos, True)
                start += BLOCK
        else:
            for start in range(0, hi, BLOCK):
                m, lsum, acc = _block(q, k_ptr, v_ptr, idx_ptr, start, hi, h, K_ST, K_SH, V_ST, V_SH, m, lsum, acc,
                                      d, BLOCK, IEEE, FP8, qpos, True)
        out = acc / lsum[:, None]
        tl.store(o_ptr + r[:, None] * O_ST + (h * G + g)[:, None] * O_SH + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=live[:, None])


_FAILED: list[str] = []  # the first launch's error, if the kernel could not run on this GPU (then torch for good)


def usable(q: torch.Tensor, k_cache: torch.Tensor, force: bool = False) -> bool:
    """The kernel applies: Triton on CUDA tensors (or forced: CPU tensors under TRITON_INTERPRET=1), a power-of-two
    head size 16-256, a 16/32-bit or fp8 (e4m3fn) cache with token-major rows [tokens, KV heads, head dim], at most
    TILE_ROWS query heads per KV head; bf16 needs compute capability 8.0 or later."""
    if triton is None or _FAILED or not (force or (q.is_cuda and triton_enabled())):
        return False
    D = q.shape[-1]
    G = q.shape[1] // k_cache.shape[1]
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    compute = q.dtype if fp8 else k_cache.dtype
    if compute == torch.bfloat16 and k_cache.is_cuda and torch.cuda.get_device_capability(k_cache.device)[0] < 8:
        return False
    return (D & (D - 1) == 0 and 16 <= D <= 256 and triton.next_power_of_2(G) <= TILE_ROWS // 2
            and compute in (torch.bfloat16, torch.float16, torch.float32)
            and k_cache.dim() == 3 and k_cache.stride(-1) == 1 and q.stride(-1) == 1)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor,
                      cached: int, scale: float) -> torch.Tensor | None:
    """q [L, H, D] (a chunk's queries at positions cached .. cached + L - 1), k_cache / v_cache [tokens, Hk, D],
    index [cached + L] the sequence's KV rows -> [L, H, D] in q's dtype, causal. None where the kernel fails to
    compile or launch on this GPU: one warning, and `usable` says no from then on. Out of memory is raised."""
    try:
        return _prefill_attention(q, k_cache, v_cache, index, cached, scale)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - a compiler or launch error on this GPU: report once, use torch
        _FAILED.append(f"{type(e).__name__}: {e}")
        log.warning("paged prefill attention disabled for this process (%s); long-context prefill attends in torch "
                    "key blocks", _FAILED[0][:300])
        return None


def _prefill_attention(q, k_cache, v_cache, index, cached: int, scale: float) -> torch.Tensor:
    L, H, D = q.shape
    Hk = k_cache.shape[1]
    G = H // Hk
    GP = triton.next_power_of_2(G)
    rows = max(1, TILE_ROWS // GP)
    dtype = q.dtype
    q, k_cache, v_cache, fp8 = kernel_operands(q, k_cache, v_cache)
    index = index if index.stride(-1) == 1 else index.contiguous()
    out = torch.empty((L, H, D), dtype=dtype, device=q.device)
    _prefill_kernel[(triton.cdiv(L, rows), Hk)](
        q, k_cache, v_cache, index, out, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1), L, cached, scale,
        G=G, GP=GP, ROWS=rows, D=D, BLOCK=BLOCK_N, IEEE=q.dtype == torch.float32, WHILE=triton_interpreted(),
        FP8=fp8, num_warps=4 if D <= 128 else 8, num_stages=2)
    return out

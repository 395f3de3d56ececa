"""Decode-time routed experts over (token, k) pairs, with no host synchronisation.

A decode step routes each of its T tokens to k experts: P = T*k pairs, pair p = t*k + j. Instead of
grouping pairs by expert on the host (moe/compute.py, which needs the route on the host), every pair
names the device row its expert's weights are in, src[p] (a row of the slot pool, or of fused's device
bank), and

    y[t] = sum_j w[t, j] * mlp_{e(t,j)}(x[t])      summed in k order (deterministic)

Misses are first staged from the pinned host bank into their rows (`stage_experts`: an admitted
slot, or a scratch row) by a copy kernel that reads the host bank through its unified address with
wide contiguous loads on every SM, so a miss crosses PCIe once and the expert GEMVs read only VRAM.
Everything has static shapes and reads no device value on the host, so a decode step made of these can
be recorded as a CUDA graph.

Two implementations with one contract: Triton kernels (CUDA) and a torch reference (any device; CPU
tests exercise the same bookkeeping). Dense expert formats here: gate_up [N, 2I, H], down [N, H, I];
compressed ones (GGUF, FP8, NVFP4, MXFP4 rows) are computed by moe/qpairs.py when `fmt` is given, and
staged by the same copy kernel (it copies every array of the pool as bytes).
"""
from __future__ import annotations

import torch

from ..env import triton_enabled
from .swiglu import swiglu

try:  # optional: absent on CPU-only installs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def triton_ready(device: torch.device) -> bool:
    """Whether the pair kernels run here: CUDA, triton imports and env.triton_enabled()."""
    return triton is not None and device.type == "cuda" and triton_enabled()


def pair_moe(x: torch.Tensor, topk_w: torch.Tensor, src: torch.Tensor, pool: dict, fmt=None) -> torch.Tensor:
    """x [T, H]; topk_w [T, k]; src [P] rows of pool = {"gate_up": [N, 2I, H], "down": [N, H, I]}, or of a
    compressed pool when fmt (the layer's expert format) is quantized."""
    return pair_sum(pair_outputs(x, topk_w, src, pool, fmt), topk_w.shape[1], x.dtype)


def pair_outputs(x: torch.Tensor, topk_w: torch.Tensor, src: torch.Tensor, pool: dict, fmt=None,
                 staged: tuple | None = None) -> torch.Tensor:
    """y [P, H] float32: w[p] * mlp(x[p // k]) from pool row src[p]; rows of pairs with src[p] < 0 are left
    for another producer (moe/bridge.py: the CPU) and hold garbage until it fills them. staged: the call's misses
    (caches.PairRows.staged) not yet in their rows, which the caller hands over where qpairs.fetches_in_pairs says
    the compressed pair kernels copy them themselves (every other path copies them first: stage_experts)."""
    if fmt is not None and fmt.quantized:
        from .qpairs import quant_pair_outputs

        return quant_pair_outputs(x, topk_w, src, pool, fmt, staged)
    if staged is not None:
        stage_experts(staged[0], pool, *staged[1:])
    if triton_ready(x.device):
        return _pair_outputs_triton(x, topk_w, src, pool)
    return _pair_outputs_torch(x, topk_w, src, pool)


def pair_sum(y: torch.Tensor, k: int, dtype: torch.dtype, force: bool = False) -> torch.Tensor:
    """[P, H] pair outputs -> [T, H]: each token's k pairs summed in k order in float32 (deterministic), rounded to
    dtype. On CUDA (or force: Triton's interpreter) one launch, where torch's sum and cast take two a layer call."""
    if y.dtype != torch.float32 or not y.is_contiguous() or dtype not in _SUM_DTYPES \
            or not (force or triton_ready(y.device)):
        return y.view(-1, k, y.shape[-1]).sum(1).to(dtype)
    T, N = y.shape[0] // k, y.shape[1]
    out = torch.empty((T, N), dtype=dtype, device=y.device)
    if T and N:
        block = min(1024, triton.next_power_of_2(N))
        bf16 = dtype == torch.bfloat16
        _pair_sum_kernel[(T, triton.cdiv(N, block))](y, out.view(torch.int16) if bf16 else out, N, K_TOP=k,
                                                     OUT_BF16=bf16, BLOCK=block)
    return out


_SUM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def stage_experts(host: dict, pool: dict, experts: torch.Tensor, rows: torch.Tensor, count: torch.Tensor) -> None:
    """Copy host[name][experts[i]] into pool[name][rows[i]] for i < count (a device scalar) and every array
    name of the pool; experts/rows [M]. A pool row may be longer than a host row (slot rows of per-layer
    GGUF type mixes are sized for the largest type): the host row's bytes go to its front."""
    if triton_ready(rows.device):
        return _stage_triton(host, pool, experts, rows, count)
    n = int(count)
    for name, dst in pool.items():
        src = host[name]
        width = src[0].numel()
        rows_of = src[experts[:n].to(src.device)].reshape(n, width).to(dst.device)
        dst.view(dst.shape[0], -1)[:, :width].index_copy_(0, rows[:n], rows_of)


def pair_moe_torch(x, topk_w, src, pool) -> torch.Tensor:
    return pair_sum(_pair_outputs_torch(x, topk_w, src, pool), topk_w.shape[1], x.dtype)


def _pair_outputs_torch(x, topk_w, src, pool) -> torch.Tensor:
    k = topk_w.shape[1]
    y = torch.zeros(src.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    p = torch.nonzero(src >= 0).flatten() if bool((src < 0).any()) else None
    use = src if p is None else src[p]
    gate_up, down = pool["gate_up"][use], pool["down"][use]
    xp = x.repeat_interleave(k, dim=0)  # pair p reads token p // k
    w = topk_w.reshape(-1, 1).float()
    if p is not None:
        xp, w = xp[p], w[p]
    gu = torch.bmm(gate_up, xp.unsqueeze(-1)).squeeze(-1).float()
    g, u = gu.chunk(2, dim=-1)
    h = swiglu(g, u, x.dtype)
    out = torch.bmm(down, h.unsqueeze(-1)).squeeze(-1).float() * w
    if p is None:
        return out
    return y.index_copy_(0, p, out)


if triton is not None:
    from ..quant.triton_dequant import _store

    @triton.jit
    def _pair_sum_kernel(y, out, N, K_TOP: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK: tl.constexpr):
        """out[t, d] = y[t*k, d] + y[t*k + 1, d] + ... in float32, left to right, rounded to out's dtype."""
        t = tl.program_id(0)
        d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = d < N
        base = y + (t * K_TOP).to(tl.int64) * N
        acc = tl.load(base + d, mask=m, other=0.0)
        for j in tl.static_range(1, K_TOP):
            acc += tl.load(base + j * N + d, mask=m, other=0.0)
        _store(out, t.to(tl.int64) * N + d, acc, m, OUT_BF16)

    _CONFIGS = [triton.Config({"BN": bn, "BK": bk}, num_warps=w)
                for bn, bk, w in ((16, 256, 4), (32, 256, 4), (32, 128, 4), (64, 128, 8), (16, 512, 8))]

    # autotuned per (H, I, PB), PB the pair count rounded up to a power of two (unused in the bodies): one benchmark
    # per bucket, not per pair count (speculative verify and drafter passes give many counts, each of which cost a
    # tuning run of every config inside a measured decode)
    @triton.autotune(configs=_CONFIGS, key=["H", "I", "PB"])
    @triton.jit
    def _gate_up_kernel(x_ptr, src_ptr, pool_ptr, h_ptr, H, I, PB, K_TOP, BN: tl.constexpr, BK: tl.constexpr):
        p = tl.program_id(0)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        s = tl.load(src_ptr + p)
        nmask = (n < I) & (s >= 0)  # a pair with no row is another producer's (moe/bridge.py)
        base = pool_ptr + tl.maximum(s, 0) * (2 * I * H)
        row = p // K_TOP
        acc_g = tl.zeros([BN], dtype=tl.float32)
        acc_u = tl.zeros([BN], dtype=tl.float32)
        for k0 in range(0, H, BK):
            kk = k0 + tl.arange(0, BK)
            kmask = kk < H
            m = nmask[:, None] & kmask[None, :]
            xv = tl.load(x_ptr + row * H + kk, mask=kmask, other=0.0).to(tl.float32)
            wg = tl.load(base + n[:, None] * H + kk[None, :], mask=m, other=0.0)
            wu = tl.load(base + (n[:, None] + I) * H + kk[None, :], mask=m, other=0.0)
            acc_g += tl.sum(wg.to(tl.float32) * xv[None, :], axis=1)
            acc_u += tl.sum(wu.to(tl.float32) * xv[None, :], axis=1)
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(h_ptr + p * I + n, h.to(h_ptr.dtype.element_ty), mask=nmask)

    @triton.autotune(configs=_CONFIGS, key=["H", "I", "PB"])
    @triton.jit
    def _down_kernel(h_ptr, w_ptr, src_ptr, pool_ptr, y_ptr, H, I, PB, BN: tl.constexpr, BK: tl.constexpr):
        p = tl.program_id(0)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        s = tl.load(src_ptr + p)
        nmask = (n < H) & (s >= 0)
        base = pool_ptr + tl.maximum(s, 0) * (H * I)
        acc = tl.zeros([BN], dtype=tl.float32)
        for k0 in range(0, I, BK):
            kk = k0 + tl.arange(0, BK)
            kmask = kk < I
            m = nmask[:, None] & kmask[None, :]
            hv = tl.load(h_ptr + p * I + kk, mask=kmask, other=0.0).to(tl.float32)
            wd = tl.load(base + n[:, None] * I + kk[None, :], mask=m, other=0.0)
            acc += tl.sum(wd.to(tl.float32) * hv[None, :], axis=1)
        wt = tl.load(w_ptr + p).to(tl.float32)
        tl.store(y_ptr + p * H + n, acc * wt, mask=nmask)

    @triton.jit
    def _stage_kernel(host_ptr, pool_ptr, experts_ptr, rows_ptr, count_ptr, N, host_stride, pool_stride,
                      CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """Program (i, c) copies chunk c (CHUNK of the N elements of a host row) of expert experts[i] to the
        front of pool row rows[i]."""
        i = tl.program_id(0)
        if i < tl.load(count_ptr):
            e = tl.load(experts_ptr + i)
            r = tl.load(rows_ptr + i)
            start = tl.program_id(1) * CHUNK
            for off in range(0, CHUNK, BLOCK):
                o = start + off + tl.arange(0, BLOCK)
                m = o < N
                v = tl.load(host_ptr + e * host_stride + o, mask=m)
                tl.store(pool_ptr + r * pool_stride + o, v, mask=m)


    @triton.jit
    def _stage_row(host_ptr, pool_ptr, e, r, N, host_stride, pool_stride, start, CHUNK: tl.constexpr,
                   BLOCK: tl.constexpr):
        """Chunk [start, start + CHUNK) of host row e (N words) to the front of pool row r."""
        for off in range(0, CHUNK, BLOCK):
            o = start + off + tl.arange(0, BLOCK)
            m = o < N
            v = tl.load(host_ptr + e * host_stride + o, mask=m)
            tl.store(pool_ptr + r * pool_stride + o, v, mask=m)

    @triton.jit
    def _stage_all_kernel(h0, p0, n0, hs0, ps0, h1, p1, n1, hs1, ps1, h2, p2, n2, hs2, ps2,
                          h3, p3, n3, hs3, ps3, h4, p4, n4, hs4, ps4, h5, p5, n5, hs5, ps5,
                          h6, p6, n6, hs6, ps6, h7, p7, n7, hs7, ps7, h8, p8, n8, hs8, ps8,
                          experts_ptr, rows_ptr, count_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """Program (i, c, a) copies chunk c of array a's host row experts[i] to the front of its pool row rows[i]:
        every array of a layer's misses in ONE launch (up to 9: an NVFP4 layer's three parts of three projections),
        so their copies overlap on PCIe and a call with no miss costs one near-empty launch, not one per array."""
        i = tl.program_id(0)
        if i < tl.load(count_ptr):
            e = tl.load(experts_ptr + i)
            r = tl.load(rows_ptr + i)
            start = tl.program_id(1) * CHUNK
            a = tl.program_id(2)
            if a == 0:
                _stage_row(h0, p0, e, r, n0, hs0, ps0, start, CHUNK, BLOCK)
            elif a == 1:
                _stage_row(h1, p1, e, r, n1, hs1, ps1, start, CHUNK, BLOCK)
            elif a == 2:
                _stage_row(h2, p2, e, r, n2, hs2, ps2, start, CHUNK, BLOCK)
            elif a == 3:
                _stage_row(h3, p3, e, r, n3, hs3, ps3, start, CHUNK, BLOCK)
            elif a == 4:
                _stage_row(h4, p4, e, r, n4, hs4, ps4, start, CHUNK, BLOCK)
            elif a == 5:
                _stage_row(h5, p5, e, r, n5, hs5, ps5, start, CHUNK, BLOCK)
            elif a == 6:
                _stage_row(h6, p6, e, r, n6, hs6, ps6, start, CHUNK, BLOCK)
            elif a == 7:
                _stage_row(h7, p7, e, r, n7, hs7, ps7, start, CHUNK, BLOCK)
            elif a == 8:
                _stage_row(h8, p8, e, r, n8, hs8, ps8, start, CHUNK, BLOCK)


STAGE_ARRAYS = 9  # arrays _stage_all_kernel takes in one launch

if triton is not None:

    @triton.jit
    def _count_routed_kernel(ids, lidx, hits, distinct, E, P: tl.constexpr, BLOCK_E: tl.constexpr,
                             DISTINCT: tl.constexpr):
        """Program i: the distinct experts among ids[i, :P] each add one to hits[lidx[i], e] and (DISTINCT) their
        number to distinct[lidx[i]] (a [BLOCK_E] mask built one id at a time: no [P, E] tile in registers; atomic
        adds, so a layer listed twice counts twice)."""
        i = tl.program_id(0)
        layer = tl.load(lidx + i)
        e = tl.arange(0, BLOCK_E)
        em = e < E
        routed = tl.zeros([BLOCK_E], dtype=tl.int64)
        for j in range(P):
            routed = tl.maximum(routed, (e == tl.load(ids + i * P + j)).to(tl.int64))
        tl.atomic_add(hits + layer * E + e, routed, mask=em & (routed > 0))
        if DISTINCT:
            tl.atomic_add(distinct + layer, tl.sum(routed, axis=0))


COUNT_MAX_PAIRS = 256  # beyond (a prompt-sized call), the torch ops: the kernel's loop runs one id at a time


def count_routed(ids: torch.Tensor, lidx: torch.Tensor, hits: torch.Tensor, distinct: torch.Tensor,
                 add_distinct: bool = True) -> None:
    """ids [n, P] int64 (n layer calls of P pairs each), lidx [n] their layers' rows: hits [L, E] += 1 for each
    distinct expert of each call, distinct [L] += their number (add_distinct): the fused pair path's counts of a decode
    step's calls, one launch on CUDA (torch: a few), no host sync (recordable in a decode graph)."""
    n, P = ids.shape
    if not n:
        return
    if triton_ready(ids.device) and P <= COUNT_MAX_PAIRS:
        E = hits.shape[1]
        _count_routed_kernel[(n,)](ids, lidx, hits, distinct, E, P=P, BLOCK_E=triton.next_power_of_2(E),
                                   DISTINCT=add_distinct)
        return
    routed = torch.zeros(n, hits.shape[1], dtype=torch.long, device=hits.device)
    routed.scatter_(1, ids, 1)
    hits.index_add_(0, lidx, routed)
    if add_distinct:
        distinct.index_add_(0, lidx, routed.sum(1))


def _pair_outputs_triton(x, topk_w, src, pool) -> torch.Tensor:
    T, k = topk_w.shape
    P = T * k
    gu_pool, d_pool = pool["gate_up"], pool["down"]
    I2, H = gu_pool.shape[1], gu_pool.shape[2]
    I = I2 // 2
    x, src = x.contiguous(), src.contiguous()
    h = torch.empty((P, I), dtype=x.dtype, device=x.device)
    PB = triton.next_power_of_2(P)
    _gate_up_kernel[lambda meta: (P, triton.cdiv(I, meta["BN"]))](x, src, gu_pool, h, H, I, PB, k)
    y = torch.empty((P, H), dtype=torch.float32, device=x.device)
    _down_kernel[lambda meta: (P, triton.cdiv(H, meta["BN"]))](h, topk_w.reshape(-1).contiguous(), src, d_pool, y,
                                                               H, I, PB)
    return y


def _words(t: torch.Tensor, size: int) -> torch.Tensor:
    """A contiguous [rows, ...] tensor's bytes as [rows, row_bytes / size] words of `size` bytes."""
    dt = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[size]
    return t.view(torch.uint8).view(t.shape[0], -1).view(dt)


def _word_size(*ts: torch.Tensor) -> int:
    """The widest word (8, 4, 2 or 1 bytes) that divides the row bytes of every tensor (wide loads)."""
    rows = [t[0].numel() * t.element_size() for t in ts]
    return next(size for size in (8, 4, 2, 1) if all(r % size == 0 for r in rows))


def _stage_triton(host, pool, experts, rows, count) -> None:
    M = experts.shape[0]
    names = list(pool)
    if 0 < len(names) <= STAGE_ARRAYS:  # one launch for every array, in words all their rows divide into
        size = _word_size(*(host[n] for n in names), *(pool[n] for n in names))
        chunk, args, chunks = 8192, [], 1
        for n in names:
            src, dst = _words(host[n], size), _words(pool[n], size)
            args += [src, dst, src.shape[1], src.stride(0), dst.stride(0)]
            chunks = max(chunks, triton.cdiv(src.shape[1], chunk))
        args += args[:5] * (STAGE_ARRAYS - len(names))  # slots never reached (program axis 2 < len(names))
        _stage_all_kernel[(M, chunks, len(names))](*args, experts, rows, count, CHUNK=chunk, BLOCK=1024)
        return
    for name, dst_t in pool.items():
        size = _word_size(host[name], dst_t)
        src, dst = _words(host[name], size), _words(dst_t, size)
        N = src.shape[1]
        chunk = 8192
        _stage_kernel[(M, triton.cdiv(N, chunk))](src, dst, experts, rows, count, N, src.stride(0), dst.stride(0),
                                                  CHUNK=chunk, BLOCK=1024)

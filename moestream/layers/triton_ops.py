"""Fused CUDA kernels (Triton) for the small ops that dominate a decode step.

A decode step of Qwen3.6 is launch-bound: an RMSNorm in torch is ~8 kernels and a Gated DeltaNet
decode ~40, each far shorter than its launch. These kernels do the same math in one launch each:

- `rms_norm` / `gated_rms_norm`: one program per row, fp32 math, the same rounding points as the
  torch modules in layers/norm.py (Qwen3: cast the normalised x, then multiply by the weight;
  Qwen3.5: multiply in fp32, cast last; gated: then times silu(gate) in fp32).
- `gdn_decode`: conv window update + depthwise conv + SiLU + L2 norms + the gated delta rule step +
  the state write-back, one program per (sequence, value head, block of value dims).
  With raw_gates it also computes beta and the decay from the b/a projections (no torch gate ops).
- `add_rms_norm`: the decoder's residual add + the post-attention norm.
- `route_topk`: router softmax + top-k + renormalisation + cast, one program per token.
- `silu_mul`, `gated_combine(_norm)`: the shared expert's activation, and routed + sigmoid(gate) * shared
  + residual (+ the next layer's input norm).
- `qk_norm_rope_cache`: attention's q/k norms + rotary + KV-cache write (16/32-bit or fp8 e4m3fn caches;
  `fp8_encode` / `fp8_decode` are the fp8 codes in integer arithmetic, shared with layers/attn_decode.py).
- `gdn_chunk_scan` (prefill, not decode): the Gated DeltaNet chunked prefill's recurrence over 64-token
  chunks in one launch, the state slice of each (value head, value-dim block) in registers.
Inputs may be strided views of a fused projection's product (models/fuse.py): no copies to split it.

Used on CUDA when Triton imports (MOESTREAM_TRITON=0 turns them off); the torch code stays the
reference and the CPU path. tests/test_triton_layers.py compares both on a GPU.
"""
from __future__ import annotations

import functools

import torch

from ..env import triton_enabled
from ..moe.swiglu import swiglu

try:  # optional: absent on CPU-only installs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def enabled(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda and triton_enabled()


if triton is not None:
    @triton.jit
    def _rms_kernel(x_ptr, w_ptr, g_ptr, y_ptr, r_ptr, h_ptr, N, eps, G_INNER, G_STRIDE, ZERO_CENTERED: tl.constexpr,
                    GATED: tl.constexpr, ADD: tl.constexpr, BLOCK: tl.constexpr, MAPPED: tl.constexpr = False,
                    D_GROUP: tl.constexpr = 1):
        """MAPPED (not with ADD): r_ptr is an int32 [D_GROUP] table, row g of each group of D_GROUP rows written to
        the group's row r_ptr[g]."""
        row = tl.program_id(0)
        o = tl.arange(0, BLOCK)
        m = o < N
        x = tl.load(x_ptr + row * N + o, mask=m, other=0.0).to(tl.float32)
        if ADD:  # the decoder's residual add first: h = r + x, rounded to the dtype like torch, then normed
            x = (x + tl.load(r_ptr + row * N + o, mask=m, other=0.0).to(tl.float32)).to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + row * N + o, x, mask=m)
            x = x.to(tl.float32)
        xn = x * tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
        w = tl.load(w_ptr + o, mask=m, other=0.0).to(tl.float32)
        out_ty = y_ptr.dtype.element_ty
        if ZERO_CENTERED:
            y = xn * (1.0 + w)
        else:
            y = (xn.to(out_ty).to(tl.float32) * w).to(out_ty).to(tl.float32)
        if GATED:
            # gate rows: G_INNER rows of N apart, groups of them G_STRIDE apart (a view into a fused GEMM)
            g_row = g_ptr + (row // G_INNER) * G_STRIDE + (row % G_INNER) * N
            g = tl.load(g_row + o, mask=m, other=0.0).to(tl.float32)
            y = y * (g / (1.0 + tl.exp(-g)))
        out_row = row
        if MAPPED:  # rows in groups of D_GROUP (a token's heads), each written to its group's row r_ptr[row % D_GROUP]
            out_row = (row // D_GROUP) * D_GROUP + tl.load(r_ptr + row % D_GROUP)
        tl.store(y_ptr + out_row * N + o, y.to(out_ty), mask=m)

    @triton.jit
    def _window(conv_base, mixed_row, c, taps, KW: tl.constexpr):
        """[len(c), KW] conv window of channels c: the KW-1 kept inputs, then the new token."""
        old = tl.load(conv_base + c[:, None] * (KW - 1) + taps[None, :], mask=taps[None, :] < KW - 1,
                      other=0.0).to(tl.float32)
        new = tl.load(mixed_row + c).to(tl.float32)
        return tl.where(taps[None, :] == KW - 1, new[:, None], old)

    @triton.jit
    def _conv_act(y, w_ty, out_ty):
        """The conv's fp32 sums y as the torch path (and HF) turns them into activations: F.conv1d's output rounded to
        the conv weight's dtype, F.silu rounded to it again, then cast to the rows' dtype."""
        y = y.to(w_ty).to(tl.float32)
        y = (y / (1.0 + tl.exp(-y))).to(w_ty).to(tl.float32)
        return y.to(out_ty).to(tl.float32)

    @triton.jit
    def _conv_silu(win, convw_ptr, c, taps, out_ty, KW: tl.constexpr):
        return _conv_act(tl.sum(win * tl.load(convw_ptr + c[:, None] * KW + taps[None, :]).to(tl.float32), axis=1),
                         convw_ptr.dtype.element_ty, out_ty)

    @triton.jit
    def _softplus(x):
        """torch.nn.functional.softplus (threshold 20) with an accurate log1p (not in the interpreter's libdevice)."""
        e = tl.exp(tl.minimum(x, 20.0))
        u = 1.0 + e
        log1p = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
        return tl.where(x > 20.0, x, log1p)

    @triton.jit
    def _raw_gates(braw, a, h, alog_ptr, dtb_ptr):
        """(g, beta) of value head h from its projections b, a as GatedDeltaNet._gates: beta = sigmoid(b) rounded to
        b's dtype, g = -exp(A_log) * softplus(a + dt_bias) in fp32."""
        beta = (1.0 / (1.0 + tl.exp(-braw.to(tl.float32)))).to(braw.dtype).to(tl.float32)
        x = a.to(tl.float32) + tl.load(dtb_ptr + h).to(tl.float32)
        return -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * _softplus(x), beta

    @triton.jit
    def _decay_beta(b, h, g_ptr, beta_ptr, HV, a_ptr, braw_ptr, A_STRIDE, B_STRIDE, alog_ptr, dtb_ptr,
                    RAW_GATES: tl.constexpr):
        """exp(g) and beta of token b, value head h: read (fp32 [B, Hv]) or, RAW_GATES, computed from the
        projections a, b like GatedDeltaNet._gates: beta = sigmoid(b) rounded to b's dtype,
        g = -exp(A_log) * softplus(a + dt_bias) in fp32."""
        if RAW_GATES:
            g, beta = _raw_gates(tl.load(braw_ptr + b * B_STRIDE + h), tl.load(a_ptr + b * A_STRIDE + h), h, alog_ptr,
                                 dtb_ptr)
        else:
            g = tl.load(g_ptr + b * HV + h)
            beta = tl.load(beta_ptr + b * HV + h)
        return tl.exp(g), beta

    @triton.jit
    def _gdn_decode_kernel(mixed_ptr, conv_ptr, convw_ptr, slots_ptr, g_ptr, beta_ptr, rec_ptr, out_ptr,
                           CONV_DIM, KEY_DIM, HV, REP, scale, MIXED_STRIDE,
                           a_ptr, braw_ptr, A_STRIDE, B_STRIDE, alog_ptr, dtb_ptr,
                           DK: tl.constexpr, DV: tl.constexpr, KW: tl.constexpr, BV: tl.constexpr,
                           RAW_GATES: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        vb = tl.program_id(2)
        slot = tl.load(slots_ptr + b)
        hk = h // REP
        dk = tl.arange(0, DK)
        dv = vb * BV + tl.arange(0, BV)
        taps = tl.arange(0, KW)
        conv_base = conv_ptr + slot * CONV_DIM * (KW - 1)
        mixed_row = mixed_ptr + b * MIXED_STRIDE
        out_ty = out_ptr.dtype.element_ty
        cq = hk * DK + dk
        ck = KEY_DIM + hk * DK + dk
        cv = 2 * KEY_DIM + h * DV + dv
        wv = _window(conv_base, mixed_row, cv, taps, KW)
        q = _conv_silu(_window(conv_base, mixed_row, cq, taps, KW), convw_ptr, cq, taps, out_ty, KW)
        k = _conv_silu(_window(conv_base, mixed_row, ck, taps, KW), convw_ptr, ck, taps, out_ty, KW)
        v = _conv_silu(wv, convw_ptr, cv, taps, out_ty, KW)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        # the v channels' windows belong to this program alone: shift them here (q/k: _conv_shift_kernel)
        shifted = tl.sum(tl.where(taps[None, None, :] == taps[None, :, None] + 1, wv[:, None, :], 0.0), axis=2)
        tl.store(conv_base + cv[:, None] * (KW - 1) + taps[None, :], shifted.to(conv_ptr.dtype.element_ty),
                 mask=taps[None, :] < KW - 1)
        gate, beta = _decay_beta(b, h, g_ptr, beta_ptr, HV, a_ptr, braw_ptr, A_STRIDE, B_STRIDE, alog_ptr, dtb_ptr,
                                 RAW_GATES)
        sp = rec_ptr + ((slot * HV + h) * DK + dk[:, None]) * DV + dv[None, :]
        S = tl.load(sp).to(tl.float32) * gate
        u = (v - tl.sum(S * k[:, None], axis=0)) * beta
        S = S + k[:, None] * u[None, :]
        o = tl.sum(S * q[:, None], axis=0)
        tl.store(sp, S.to(rec_ptr.dtype.element_ty))
        tl.store(out_ptr + (b * HV + h) * DV + dv, o.to(out_ty))

    @triton.jit
    def _conv_shift_kernel(mixed_ptr, conv_ptr, slots_ptr, CONV_DIM, MIXED_STRIDE, NCH, KW: tl.constexpr,
                           BLOCK: tl.constexpr):
        """Shift the conv windows of channels [0, NCH) by one token (after every reader ran)."""
        b = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        taps = tl.arange(0, KW)
        m = c < NCH
        base = conv_ptr + tl.load(slots_ptr + b) * CONV_DIM * (KW - 1)
        win = _window(base, mixed_ptr + b * MIXED_STRIDE, tl.where(m, c, 0), taps, KW)
        shifted = tl.sum(tl.where(taps[None, None, :] == taps[None, :, None] + 1, win[:, None, :], 0.0), axis=2)
        tl.store(base + c[:, None] * (KW - 1) + taps[None, :], shifted.to(conv_ptr.dtype.element_ty),
                 mask=m[:, None] & (taps[None, :] < KW - 1))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool,
             gate: torch.Tensor | None = None, dest: torch.Tensor | None = None) -> torch.Tensor:
    """dest [G] int32 (optional): x's rows in groups of G (x [..., G, N]); row g of a group is written to the
    group's row dest[g] (a Gated DeltaNet's value heads in the order its out_proj stores them)."""
    shape = x.shape
    N = shape[-1]
    x2 = x.reshape(-1, N).contiguous()
    y = torch.empty_like(x2)
    g3 = _gate_rows(gate, N) if gate is not None else x2.view(1, -1, N)
    _rms_kernel[(x2.shape[0],)](x2, weight, g3, y, dest if dest is not None else x2, y, N, eps, g3.shape[1],
                                g3.stride(0), ZERO_CENTERED=zero_centered, GATED=gate is not None, ADD=False,
                                BLOCK=triton.next_power_of_2(N), MAPPED=dest is not None,
                                D_GROUP=dest.numel() if dest is not None else 1)
    return y.view(shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, N] contiguous -> (rms_norm(residual + x), residual + x) in one launch."""
    T, N = x.shape
    y, h = torch.empty_like(x), torch.empty_like(x)
    _rms_kernel[(T,)](x, weight, x.view(1, -1, N), y, residual, h, N, eps, 1, 0, ZERO_CENTERED=zero_centered,
                      GATED=False, ADD=True, BLOCK=triton.next_power_of_2(N))
    return y, h


def _gate_rows(gate: torch.Tensor, N: int) -> torch.Tensor:
    """gate [..., R, N] as [G, R, N] with rows N apart inside a group (a view where possible: GatedDeltaNet's
    z is [T, Hv, Dv] inside the fused projection, groups a product row apart)."""
    g = gate.reshape(-1, gate.shape[-2] if gate.dim() > 1 else 1, N)
    if g.stride(2) != 1 or (g.shape[1] > 1 and g.stride(1) != N) or (g.shape[0] > 1 and g.stride(0) < 0):
        g = g.contiguous()
    return g


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [B, N] with unit stride along N (a view of a fused projection keeps its row stride)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def gdn_decode(mixed, conv_state, conv_w, slots, g, beta, rec_state, out, key_dim, hk, hv, dk, dv,
               raw_gates=None) -> None:
    """mixed [B, conv_dim] (any row stride); conv_state [slots, conv_dim, K-1]; conv_w [conv_dim, K];
    g, beta [B, Hv] fp32, or raw_gates = (b, a [B, Hv] projections, A_log, dt_bias [Hv]) to compute them in the
    kernel; rec_state [slots, Hv, Dk, Dv]; writes out [B, Hv, Dv] and updates both states in place."""
    B, conv_dim = mixed.shape
    K = conv_w.shape[1]
    bv = min(32, dv)
    mixed = _rows(mixed)
    if raw_gates is not None:
        braw, a, alog, dtb = raw_gates
        braw, a = _rows(braw), _rows(a)
        g = beta = a  # unused pointers
    else:
        g, beta = g.contiguous(), beta.contiguous()
        braw = a = alog = dtb = g
    _gdn_decode_kernel[(B, hv, dv // bv)](
        mixed, conv_state, conv_w.contiguous(), slots, g, beta, rec_state,
        out, conv_dim, key_dim, hv, hv // hk, dk ** -0.5, mixed.stride(0),
        a, braw, a.stride(0), braw.stride(0), alog, dtb,
        DK=dk, DV=dv, KW=K, BV=bv, RAW_GATES=raw_gates is not None)
    _conv_shift_kernel[(B, triton.cdiv(2 * key_dim, 128))](mixed, conv_state, slots, conv_dim, mixed.stride(0),
                                                           2 * key_dim, KW=K, BLOCK=128)


def gdn_decode_ok(conv_state: torch.Tensor, K: int, dk: int, dv: int) -> bool:
    """Shapes the kernel handles: power-of-two head dims and conv width, contiguous states."""
    p2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    return p2(dk) and p2(dv) and p2(K) and K >= 2 and conv_state.is_contiguous()


# ---- Gated DeltaNet prefill: the sequential part of the chunked form (layers/gdn.py) ----------------------
# chunk_gated_delta_rule precomputes every chunk's u0, w, q_dec, qk, k_dec, last with batched torch ops; what
# is left is a recurrence over the chunks, ~6 small ops each in torch. Here it is one launch: a program per
# (value head, block of BV value dims) keeps its [Dk, BV] slice of the state in registers across all chunks
# (the columns of S evolve independently: every product below has S or u on the right).

GDN_CHUNK = 64  # the chunk length the kernel is built for
# None: by the GPU (gdn_chunk_launch); "ieee" (tl.dot in full fp32 FMA) or "tf32x3" (three TF32 tensor-core
# products, fp32-accurate: 6e-7 from ieee at pp4096) forces one (tests, benchmarks)
GDN_CHUNK_PRECISION: str | None = None
# The per-thread frame (spilled registers) every launch must stay within: the driver's default stack limit.
# A kernel needing more makes the driver raise the limit for the context and reserve limit x SMs x threads per
# SM of device memory, outside torch's allocator and never given back: the first launch at (bv 32, 8 warps,
# ieee) spilled 7.2 KB per thread on an H200, 1.57 GiB more device memory than any plan counted.
DRIVER_STACK_LIMIT = 1024  # CU_LIMIT_STACK_SIZE's default: every kernel's frame must fit it (tests/test_triton_frames.py)


def gdn_chunk_launch(capability: tuple[int, int]) -> dict:
    """Launch settings of the chunk kernel for a GPU of this compute capability (tests/test_gdn_triton.py
    compiles each for sm_75..sm_90 and checks the frame stays within DRIVER_STACK_LIMIT).
    Ampere and later: TF32x3 dots at (bv 16, 4 warps): no spill frame over 288 B, and on the H200 the fastest
    fp32-accurate setting (scan of pp4096 0.78 ms vs 2.05 ms for the earlier ieee (32, 8) launch; pp64 0.14 vs
    0.45 ms; benchmarks/gdn_chunk_bench.py --sweep). tf32x3 at (16, 8) and (32, 16) faulted there (illegal
    address): not used. Turing has no TF32: ieee FMA dots at (16, 8), the one such setting within the frame."""
    if tuple(capability) >= (8, 0):
        return dict(bv=16, num_warps=4, num_stages=1, precision="tf32x3")
    return dict(bv=16, num_warps=8, num_stages=1, precision="ieee")


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else (9, 0)


if triton is not None:
    @triton.jit(do_not_specialize=["N"])  # N = 1 specialised spills more (7.2 KB vs 1.6 KB at the old launch)
    def _gdn_chunk_kernel(u0_ptr, w_ptr, qd_ptr, qk_ptr, kd_ptr, last_ptr, s0_ptr, out_ptr, sn_ptr, snap_ptr,
                          starts_ptr, N, H, DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
                          SNAP: tl.constexpr, PREC: tl.constexpr, N_STATIC: tl.constexpr):
        """Per chunk i: u = u0_i - w_i S; out_i = q_dec_i S + qk_i u; S <- last_i S + k_dec_i^T u.
        SNAP: the state at the start of chunk i also goes to starts[snap[i]] ([NS, H, Dk, Dv]) where snap[i] >= 0.
        N_STATIC: N again, as a constant, on CPU tensors only (Triton's interpreter cannot range() over a runtime
        int under numpy >= 2.3; compiled, a constant N would mean one compile per prompt length)."""
        h = tl.program_id(0)
        v = tl.program_id(1) * BV + tl.arange(0, BV)
        rk = tl.arange(0, DK)
        rc = tl.arange(0, C)
        s_off = rk[:, None] * DV + v[None, :]  # [DK, BV] within one head's state
        S = tl.load(s0_ptr + h * DK * DV + s_off)
        for i in range(N_STATIC if N_STATIC > 0 else N):
            hi = (h * N + i).to(tl.int64)  # chunk i of head h in the [H, N, C, ...] inputs
            if SNAP:
                slot = tl.load(snap_ptr + i)
                if slot >= 0:
                    tl.store(starts_ptr + (slot * H + h).to(tl.int64) * DK * DV + s_off, S)
            wk = tl.load(w_ptr + hi * C * DK + rc[:, None] * DK + rk[None, :])  # [C, DK]
            u = tl.load(u0_ptr + hi * C * DV + rc[:, None] * DV + v[None, :]) - tl.dot(wk, S, input_precision=PREC)
            qd = tl.load(qd_ptr + hi * C * DK + rc[:, None] * DK + rk[None, :])  # [C, DK]
            qk = tl.load(qk_ptr + hi * C * C + rc[:, None] * C + rc[None, :])  # [C, C]
            o = tl.dot(qd, S, input_precision=PREC) + tl.dot(qk, u, input_precision=PREC)
            tl.store(out_ptr + hi * C * DV + rc[:, None] * DV + v[None, :], o)
            kd_t = tl.load(kd_ptr + hi * C * DK + rc[None, :] * DK + rk[:, None])  # k_dec_i^T [DK, C]
            S = S * tl.load(last_ptr + hi) + tl.dot(kd_t, u, input_precision=PREC)
        tl.store(sn_ptr + h * DK * DV + s_off, S)


def gdn_chunk_ok(dk: int, dv: int, chunk: int) -> bool:
    """Shapes the chunk kernel handles: power-of-two head dims of at least 16 (tl.dot), 64-token chunks."""
    p2 = lambda n: n >= 16 and n & (n - 1) == 0  # noqa: E731
    return triton is not None and p2(dk) and p2(dv) and chunk == GDN_CHUNK


def gdn_chunk_scan(u0, w, q_dec, qk, k_dec, last, state, snap_chunks=(), precision: str | None = None, **launch):
    """The chunk recurrence of chunk_gated_delta_rule in one launch. u0 [H, n, C, Dv]; w, q_dec, k_dec
    [H, n, C, Dk]; qk [H, n, C, C]; last [H, n]; state [H, Dk, Dv] (all fp32, state not modified).
    snap_chunks: chunk indices whose start state is wanted. Returns (out [H, n, C, Dv], final state,
    starts [len(snap_chunks), H, Dk, Dv]: the state at the start of each chunk in snap_chunks).
    launch: bv, num_warps, num_stages overriding gdn_chunk_launch's (benchmarks)."""
    H, n, C, Dv = u0.shape
    Dk = w.shape[-1]
    launch = {**gdn_chunk_launch(_capability(u0.device)), **launch}
    precision = precision or GDN_CHUNK_PRECISION or launch["precision"]
    del launch["precision"]
    bv = min(launch.pop("bv"), Dv)
    args = [t.contiguous() for t in (u0, w, q_dec, qk, k_dec, last, state)]
    out = torch.empty_like(args[0])
    final = torch.empty_like(args[-1])
    starts = torch.empty((len(snap_chunks), H, Dk, Dv), dtype=torch.float32, device=u0.device)
    snap = starts_arg = final  # unused pointers unless there are snapshots (no host-to-device copy per call)
    if len(snap_chunks):
        idx = torch.full((n,), -1, dtype=torch.int32)
        idx[list(snap_chunks)] = torch.arange(len(snap_chunks), dtype=torch.int32)
        snap, starts_arg = idx.to(u0.device), starts
    _gdn_chunk_kernel[(H, Dv // bv)](*args, out, final, snap, starts_arg, n, H, DK=Dk, DV=Dv, C=C, BV=bv,
                                     SNAP=len(snap_chunks) > 0, PREC=precision,
                                     N_STATIC=0 if u0.is_cuda else n, **launch)
    return out, final, starts


# ---- Gated DeltaNet prefill: the conv, SiLU, q/k norms and gates of a sequence's tokens in one launch --------
# GatedDeltaNet._prefill_one's front (the conv window's cat, conv1d, SiLU, casts, the split, two L2 norms, the key
# heads repeated to the value heads, the scale, the gates' ~7 ops): ~28 launches a GDN layer in torch.

if triton is not None:
    @triton.jit
    def _conv_tap(row, kept, c, new, old, convw_ptr, j, in_ty, KW: tl.constexpr):
        """Tap j of channels c for a block of tokens: each token's input from the sequence's rows (`new`) or the
        slot's kept inputs (`old`, rounded to the rows' dtype as the torch path's cat does), times the tap's weight."""
        x = tl.where(new[:, None], tl.load(row + c[None, :], mask=new[:, None], other=0.0).to(tl.float32),
                     tl.load(kept + c[None, :] * (KW - 1), mask=old[:, None], other=0.0).to(in_ty).to(tl.float32))
        return x * tl.load(convw_ptr + c * KW + j).to(tl.float32)[None, :]

    @triton.jit
    def _gdn_front_kernel(mixed_ptr, MIXED_STRIDE, conv_ptr, convw_ptr, braw_ptr, B_STRIDE, a_ptr, A_STRIDE, alog_ptr,
                          dtb_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, L, KEY_DIM, HV, REP, scale,
                          DK: tl.constexpr, DV: tl.constexpr, KW: tl.constexpr, BT: tl.constexpr):
        """Tokens t0 .. t0 + BT - 1 of value head h: the causal depthwise conv over the KW-1 kept inputs (conv_ptr
        [conv_dim, KW-1], rounded to mixed's dtype as the torch path's cat does) and the sequence's rows, its sums
        and SiLU rounded as the torch path's F.conv1d and F.silu round them (_conv_act), q and k of key head h // REP L2-normalised (q times scale), v; the
        gates as GatedDeltaNet._gates (_decay_beta's RAW_GATES math). Writes q, k [HV, L, DK], v [HV, L, DV],
        g (log decay) and beta [HV, L], fp32."""
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        h = tl.program_id(1)
        tm = t < L
        hk = h // REP
        in_ty = mixed_ptr.dtype.element_ty
        cq = hk * DK + tl.arange(0, DK)
        ck = KEY_DIM + hk * DK + tl.arange(0, DK)
        cv = 2 * KEY_DIM + h * DV + tl.arange(0, DV)
        q = tl.zeros((BT, DK), dtype=tl.float32)
        k = tl.zeros((BT, DK), dtype=tl.float32)
        v = tl.zeros((BT, DV), dtype=tl.float32)
        for j in tl.static_range(KW):  # tap j reads the input KW-1-j tokens back
            pos = t + j - (KW - 1)
            new = tm & (pos >= 0)
            old = tm & (pos < 0)
            row = mixed_ptr + pos.to(tl.int64)[:, None] * MIXED_STRIDE
            kept = conv_ptr + (KW - 1 + pos)[:, None]
            q += _conv_tap(row, kept, cq, new, old, convw_ptr, j, in_ty, KW)
            k += _conv_tap(row, kept, ck, new, old, convw_ptr, j, in_ty, KW)
            v += _conv_tap(row, kept, cv, new, old, convw_ptr, j, in_ty, KW)
        # the conv's sums rounded as F.conv1d returns them, SiLU rounded again (_conv_act): with SiLU of the fp32 sums
        # rounded once, half of a bf16 model's v was an ulp off and its prefill logits 15 % from HF bf16's (H100)
        w_ty = convw_ptr.dtype.element_ty
        q, k, v = _conv_act(q, w_ty, in_ty), _conv_act(k, w_ty, in_ty), _conv_act(v, w_ty, in_ty)
        q = q * tl.rsqrt(tl.sum(q * q, axis=1) + 1e-6)[:, None] * scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
        out = (h * L + t).to(tl.int64)
        tl.store(q_ptr + out[:, None] * DK + tl.arange(0, DK)[None, :], q, mask=tm[:, None])
        tl.store(k_ptr + out[:, None] * DK + tl.arange(0, DK)[None, :], k, mask=tm[:, None])
        tl.store(v_ptr + out[:, None] * DV + tl.arange(0, DV)[None, :], v, mask=tm[:, None])
        g, beta = _raw_gates(tl.load(braw_ptr + t * B_STRIDE + h, mask=tm, other=0.0),
                             tl.load(a_ptr + t * A_STRIDE + h, mask=tm, other=0.0), h, alog_ptr, dtb_ptr)
        tl.store(g_ptr + h * L + t, g, mask=tm)
        tl.store(beta_ptr + h * L + t, beta, mask=tm)


def gdn_prefill_front(mixed, conv_old, conv_w, b, a, a_log, dt_bias, key_dim, hk, hv, dk, dv, bt: int = 16):
    """One sequence's GDN front in one launch: mixed [L, conv_dim] (the in-projection's rows, any row stride),
    conv_old [conv_dim, K-1] (the slot's kept inputs, before this chunk), conv_w [conv_dim, K], b, a [L, Hv] (the
    gate projections), A_log, dt_bias [Hv]. Returns q, k [Hv, L, Dk], v [Hv, L, Dv] (q, k normalised, q scaled by
    Dk^-1/2), g, beta [Hv, L], all fp32: what `_split` and `_gates` give, laid out for chunk_gated_delta_rule.
    The conv state is not written (the caller keeps the window's tail and the snapshots)."""
    L = mixed.shape[0]
    K = conv_w.shape[1]
    mixed, b, a = _rows(mixed), _rows(b), _rows(a)
    f32 = dict(dtype=torch.float32, device=mixed.device)
    q, k = torch.empty((hv, L, dk), **f32), torch.empty((hv, L, dk), **f32)
    v = torch.empty((hv, L, dv), **f32)
    g, beta = torch.empty((hv, L), **f32), torch.empty((hv, L), **f32)
    _gdn_front_kernel[(triton.cdiv(L, bt), hv)](
        mixed, mixed.stride(0), conv_old.contiguous(), conv_w.contiguous(), b, b.stride(0), a, a.stride(0),
        a_log, dt_bias, q, k, v, g, beta, L, key_dim, hv, hv // hk, dk ** -0.5, DK=dk, DV=dv, KW=K, BT=bt)
    return q, k, v, g, beta


# ---- Gated DeltaNet prefill: every chunk's terms in one launch (layers/gdn.py `_chunk_terms`) -----------------
# `_chunk_terms` builds the terms the scan above reads with ~35 batched torch ops (cumsum, the decay matrix, two
# triangular solves, two batched products, a dozen elementwise ops): ~1,100 of an all-resident 512-token Qwen3.6
# prefill's 3,806 launches (H100, thirty-sixth session), a prefill whose wall time is the host's (139 ms for 57 ms
# of kernels). Here a program per (value head, chunk) computes them all from q, k, v, g, beta as they are.

if triton is not None:
    @triton.jit
    def _gdn_prep_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, u0_ptr, w_ptr, qk_ptr, qd_ptr, kd_ptr, last_ptr, c_ptr,
                         L, N, sq_h, sq_l, sk_h, sk_l, sv_h, sv_l, sg_h, sg_l, sb_h, sb_l,
                         DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, PREC: tl.constexpr, BD: tl.constexpr):
        """Chunk i of head h (tokens i*C .. i*C+C-1; past L: g = beta = 0 and q = k = v = 0, as `_chunk_terms`
        pads): c = cumsum(g); decay_ij = exp(c_i - c_j) (j <= i); A = beta_i (k_i . k_j) decay_ij (j < i);
        T = (I + A)^-1 by forward substitution (row i = e_i - sum_j A_ij T_j; the stable order of a triangular solve);
        u0 = T (beta v), w = T (beta exp(c) k), qk = (q k^T) decay, q_dec = q exp(c), k_dec = k exp(c_last - c),
        last = exp(c_last), all fp32, written [H, N, C, ...] like `_chunk_terms` (c too, for the snapshots). Head
        dims are read in [C, BD] column blocks (the products accumulate over them)."""
        h = tl.program_id(0)
        i = tl.program_id(1)
        rc = tl.arange(0, C)
        t = i * C + rc
        tm = t < L
        hi = (h * N + i).to(tl.int64)
        gv = tl.load(g_ptr + h * sg_h + t * sg_l, mask=tm, other=0.0)
        bv = tl.load(b_ptr + h * sb_h + t * sb_l, mask=tm, other=0.0)
        c = tl.cumsum(gv, 0)
        c_last = tl.sum(gv, 0)
        tl.store(c_ptr + hi * C + rc, c)
        tl.store(last_ptr + hi, tl.exp(c_last))
        lower = rc[:, None] >= rc[None, :]
        decay = tl.exp(tl.where(lower, c[:, None] - c[None, :], float("-inf")))  # 0 above the diagonal
        e_c, e_rest = tl.exp(c), tl.exp(c_last - c)
        qk = tl.zeros((C, C), dtype=tl.float32)
        kk = tl.zeros((C, C), dtype=tl.float32)
        for d0 in tl.static_range(0, DK, BD):  # [C, BD] column blocks: small tiles, no spilled frame
            rd = d0 + tl.arange(0, BD)
            kb = tl.load(k_ptr + h * sk_h + t[:, None] * sk_l + rd[None, :], mask=tm[:, None], other=0.0)
            qb = tl.load(q_ptr + h * sq_h + t[:, None] * sq_l + rd[None, :], mask=tm[:, None], other=0.0)
            off = hi * C * DK + rc[:, None] * DK + rd[None, :]
            tl.store(kd_ptr + off, kb * e_rest[:, None])
            tl.store(qd_ptr + off, qb * e_c[:, None])
            kt = tl.trans(kb)
            qk = tl.dot(qb, kt, qk, input_precision=PREC)
            kk = tl.dot(kb, kt, kk, input_precision=PREC)
        tl.store(qk_ptr + hi * C * C + rc[:, None] * C + rc[None, :], qk * decay)
        a = tl.where(rc[:, None] > rc[None, :], kk * decay * bv[:, None], 0.0)
        inv = tl.where(lower & (rc[:, None] <= rc[None, :]), 1.0, 0.0)  # the identity, rows replaced in order
        for r in range(1, C):
            a_r = tl.sum(tl.where(rc[:, None] == r, a, 0.0), 0)  # row r of A (zero from column r on)
            inv = tl.where(rc[:, None] == r, inv - tl.sum(a_r[:, None] * inv, 0)[None, :], inv)
        for d0 in tl.static_range(0, DK, BD):
            rd = d0 + tl.arange(0, BD)
            kb = tl.load(k_ptr + h * sk_h + t[:, None] * sk_l + rd[None, :], mask=tm[:, None], other=0.0)
            w = tl.dot(inv, kb * (bv * e_c)[:, None], input_precision=PREC)
            tl.store(w_ptr + hi * C * DK + rc[:, None] * DK + rd[None, :], w)
        for d0 in tl.static_range(0, DV, BD):
            rd = d0 + tl.arange(0, BD)
            vb = tl.load(v_ptr + h * sv_h + t[:, None] * sv_l + rd[None, :], mask=tm[:, None], other=0.0)
            u0 = tl.dot(inv, vb * bv[:, None], input_precision=PREC)
            tl.store(u0_ptr + hi * C * DV + rc[:, None] * DV + rd[None, :], u0)


def gdn_prep_launch(capability: tuple[int, int], precision: str | None = None) -> dict:
    """Launch settings of the prep kernel (8 warps, column blocks of bd): Hopper and later TF32x3 dots in blocks of
    32, every other GPU (or a forced "ieee") FMA dots in blocks of 16 — the settings whose sm_75..sm_120 builds keep
    no spilled frame (TF32x3 spills 1.3-1.7 KB a thread on sm_80-89; ieee in blocks of 32 spills on every GPU:
    tests/test_gdn_triton.py). Its products are 2 x 64 x 64 x (Dk + Dv) a chunk: FMA costs little there."""
    precision = precision or ("tf32x3" if tuple(capability) >= (9, 0) else "ieee")
    return dict(num_warps=8, num_stages=1, bd=32 if precision == "tf32x3" else 16, precision=precision)


def gdn_chunk_prep(q, k, v, g, beta, chunk: int = GDN_CHUNK, precision: str | None = None, **launch):
    """`layers/gdn._chunk_terms` in one launch: q, k [H, L, Dk], v [H, L, Dv] (fp32, the last dim contiguous, any
    head and token strides), g, beta [H, L] (fp32). Returns (c [H, n, C], u0 [H, n, C, Dv], w, q_dec, k_dec
    [H, n, C, Dk], qk [H, n, C, C], last [H, n]) with n = ceil(L / C)."""
    H, L, Dk = k.shape
    Dv = v.shape[-1]
    q, k, v = _rows(q), _rows(k), _rows(v)
    launch = {**gdn_prep_launch(_capability(k.device), precision or GDN_CHUNK_PRECISION), **launch}
    precision = launch.pop("precision")
    bd = min(launch.pop("bd"), Dk, Dv)
    n = triton.cdiv(L, chunk)
    f32 = dict(dtype=torch.float32, device=k.device)
    c, last = torch.empty((H, n, chunk), **f32), torch.empty((H, n), **f32)
    u0 = torch.empty((H, n, chunk, Dv), **f32)
    w, q_dec, k_dec = (torch.empty((H, n, chunk, Dk), **f32) for _ in range(3))
    qk = torch.empty((H, n, chunk, chunk), **f32)
    _gdn_prep_kernel[(H, n)](q, k, v, g, beta, u0, w, qk, q_dec, k_dec, last, c, L, n,
                             q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                             g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
                             DK=Dk, DV=Dv, C=chunk, PREC=precision, BD=bd, **launch)
    return c, u0, w, q_dec, k_dec, qk, last


# ---- the MoE block's small ops: router top-k, shared-expert activation, combine + residual ----------------
# Each public function below takes the kernel on CUDA (enabled()) and otherwise its torch reference
# (`*_torch`, also what the tests compare the kernels with under the interpreter).

if triton is not None:
    @triton.jit
    def _route_topk_kernel(logits_ptr, ids_ptr, w_ptr, E, STRIDE, K: tl.constexpr, KP: tl.constexpr,
                           NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr):
        """One token: softmax over E logits (fp32), the K largest (descending; ties: lowest id first),
        optionally renormalised to sum 1, cast to the weights' dtype."""
        t = tl.program_id(0)
        e = tl.arange(0, BLOCK_E)
        m = e < E
        x = tl.load(logits_ptr + t * STRIDE + e, mask=m, other=-float("inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, axis=0))
        p = p / tl.sum(p, axis=0)
        cur = tl.where(m, p, -1.0)  # probabilities are >= 0: -1 marks taken and padded experts
        j = tl.arange(0, KP)
        top_w = tl.zeros([KP], dtype=tl.float32)
        top_i = tl.zeros([KP], dtype=tl.int64)
        for i in tl.static_range(K):
            best = tl.max(cur, axis=0)
            idx = tl.min(tl.where(cur == best, e, BLOCK_E), axis=0)
            top_w = tl.where(j == i, best, top_w)
            top_i = tl.where(j == i, idx.to(tl.int64), top_i)
            cur = tl.where(e == idx, -1.0, cur)
        if NORMALIZE:
            top_w = top_w / tl.sum(top_w, axis=0)  # padded entries are 0
        tl.store(ids_ptr + t * K + j, top_i, mask=j < K)
        tl.store(w_ptr + t * K + j, top_w.to(w_ptr.dtype.element_ty), mask=j < K)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, INTER, STRIDE, BLOCK: tl.constexpr):
        """out[t] = silu(gu[t, :I]) * gu[t, I:2I], rounded like torch: silu to the dtype, then the product."""
        t = tl.program_id(0)
        o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = o < INTER
        ty = out_ptr.dtype.element_ty
        g = tl.load(gu_ptr + t * STRIDE + o, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + t * STRIDE + INTER + o, mask=m, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(ty).to(tl.float32)
        tl.store(out_ptr + t * INTER + o, (s * u).to(ty), mask=m)

    @triton.jit
    def _shared_down_kernel(gu_ptr, w_ptr, out_ptr, T, STRIDE, N, INTER: tl.constexpr, BT: tl.constexpr,
                            BN: tl.constexpr, BK: tl.constexpr):
        """out[t, n] = sum_k h[t, k] * w[n, k] for t < T <= BT, h = silu(gu[t, :I]) * gu[t, I:2I] rounded as
        _silu_mul_kernel rounds it: the shared expert's activation and down projection in one launch, each program
        reading its BN weight rows once for every row (a float32 dot of the rows padded to BT: the step is bound by
        the weight's bytes, not its arithmetic, and the interpreter has no bf16 dot)."""
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        nm = n < N
        t = tl.arange(0, BT)
        tm = t < T
        ty = out_ptr.dtype.element_ty
        acc = tl.zeros([BT, BN], dtype=tl.float32)
        for k0 in range(0, INTER, BK):
            k = k0 + tl.arange(0, BK)
            km = k < INTER
            m = tm[:, None] & km[None, :]
            g = tl.load(gu_ptr + t[:, None] * STRIDE + k[None, :], mask=m, other=0.0).to(tl.float32)
            u = tl.load(gu_ptr + t[:, None] * STRIDE + INTER + k[None, :], mask=m, other=0.0).to(tl.float32)
            s = (g / (1.0 + tl.exp(-g))).to(ty).to(tl.float32)
            h = (s * u).to(ty).to(tl.float32)
            w = tl.load(w_ptr + n[:, None] * INTER + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            acc = tl.dot(h, tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        tl.store(out_ptr + t[:, None] * N + n[None, :], acc.to(ty), mask=tm[:, None] & nm[None, :])

    @triton.jit
    def _gated_combine_kernel(y_ptr, s_ptr, gate_ptr, r_ptr, out_ptr, nw_ptr, n_ptr, N, GATE_STRIDE, eps,
                              RESIDUAL: tl.constexpr, NORM: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                              BLOCK: tl.constexpr):
        """out[t] = (r[t] +) (y[t] + sigmoid(gate[t]) * s[t]), each op rounded to the dtype as in torch.
        NORM (one program per row, BLOCK >= N): also n[t] = RMSNorm(out[t]) with weight nw, as _rms_kernel."""
        t = tl.program_id(0)
        o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = o < N
        ty = out_ptr.dtype.element_ty
        gl = tl.load(gate_ptr + t * GATE_STRIDE).to(tl.float32)
        sig = (1.0 / (1.0 + tl.exp(-gl))).to(ty).to(tl.float32)
        sh = (sig * tl.load(s_ptr + t * N + o, mask=m, other=0.0).to(tl.float32)).to(ty).to(tl.float32)
        acc = (tl.load(y_ptr + t * N + o, mask=m, other=0.0).to(tl.float32) + sh).to(ty)
        if RESIDUAL:
            acc = (tl.load(r_ptr + t * N + o, mask=m, other=0.0).to(tl.float32) + acc.to(tl.float32)).to(ty)
        tl.store(out_ptr + t * N + o, acc, mask=m)
        if NORM:  # the next layer's input norm of the new residual stream
            h = tl.where(m, acc.to(tl.float32), 0.0)
            xn = h * tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
            w = tl.load(nw_ptr + o, mask=m, other=0.0).to(tl.float32)
            if ZERO_CENTERED:
                v = xn * (1.0 + w)
            else:
                v = xn.to(ty).to(tl.float32) * w
            tl.store(n_ptr + t * N + o, v.to(ty), mask=m)


def route_topk_torch(logits: torch.Tensor, k: int, normalize: bool):
    """logits [T, E] -> ids [T, k] int64, weights [T, k] in logits.dtype (the reference of route_topk)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    w, ids = torch.topk(probs, k, dim=-1)
    if normalize:
        w = w / w.sum(-1, keepdim=True)
    return ids, w.to(logits.dtype)


def route_topk_ok(logits: torch.Tensor, k: int) -> bool:
    """Sizes the one-program-per-token kernel is meant for (E up to 512, k up to 16), unit-stride rows."""
    return logits.dim() == 2 and logits.shape[1] <= 512 and 1 <= k <= min(16, logits.shape[1]) \
        and logits.stride(1) == 1


def route_topk(logits: torch.Tensor, k: int, normalize: bool):
    """Kernel of route_topk_torch: one launch instead of softmax, topk, sum, divide and cast."""
    T, E = logits.shape
    ids = torch.empty((T, k), dtype=torch.int64, device=logits.device)
    w = torch.empty((T, k), dtype=logits.dtype, device=logits.device)
    if T:
        _route_topk_kernel[(T,)](logits, ids, w, E, logits.stride(0), K=k, KP=triton.next_power_of_2(k),
                                 NORMALIZE=normalize, BLOCK_E=triton.next_power_of_2(E), num_warps=4)
    return ids, w


def silu_mul_torch(gu: torch.Tensor, inter: int) -> torch.Tensor:
    return swiglu(gu[:, :inter], gu[:, inter:2 * inter])


def silu_mul(gu: torch.Tensor, inter: int, force: bool = False) -> torch.Tensor:
    """gu [T, >= 2I] (gate | up | ..., unit stride along rows) -> silu(gate) * up [T, I]."""
    if not (force or enabled(gu)) or gu.stride(-1) != 1:
        return silu_mul_torch(gu, inter)
    T = gu.shape[0]
    out = torch.empty((T, inter), dtype=gu.dtype, device=gu.device)
    if T:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_mul_kernel[(T, triton.cdiv(inter, block))](gu, out, inter, gu.stride(0), BLOCK=block)
    return out


SHARED_DOWN_ROWS = 16  # the rows one launch of _shared_down_kernel takes (tl.dot's least M)


def shared_down_ok(gu: torch.Tensor, inter: int, w: torch.Tensor, force: bool = False) -> bool:
    """Whether shared_down's kernel takes this call: a 16-bit decode-sized batch and a plain weight [N, I] of its
    dtype, both with unit stride along rows."""
    return ((force or enabled(gu)) and 0 < gu.shape[0] <= SHARED_DOWN_ROWS
            and gu.dtype in (torch.bfloat16, torch.float16) and gu.stride(-1) == 1
            and w.dtype == gu.dtype and w.dim() == 2 and w.shape[1] == inter and w.is_contiguous())


def shared_down(gu: torch.Tensor, inter: int, w: torch.Tensor, force: bool = False) -> torch.Tensor:
    """gu [T, >= 2I] (gate | up | ...), w [N, I] -> (silu(gate) * up) @ w.T [T, N] in one launch (torch: silu_mul,
    then the GEMM)."""
    if not shared_down_ok(gu, inter, w, force):
        return silu_mul(gu, inter, force) @ w.t()
    T, N = gu.shape[0], w.shape[0]
    out = torch.empty((T, N), dtype=gu.dtype, device=gu.device)
    bn, bk = 16, min(128, max(16, triton.next_power_of_2(inter)))
    _shared_down_kernel[(triton.cdiv(N, bn),)](gu, w, out, T, gu.stride(0), N, INTER=inter, BT=SHARED_DOWN_ROWS,
                                               BN=bn, BK=bk)
    return out


def gated_combine_torch(y, shared, gate, residual=None):
    y = y + torch.sigmoid(gate) * shared
    return y if residual is None else residual + y


def _combine_ok(y, shared, residual) -> bool:
    return (y.is_contiguous() and shared.dtype == y.dtype and shared.is_contiguous()
            and (residual is None or (residual.dtype == y.dtype and residual.is_contiguous())))


def gated_combine(y: torch.Tensor, shared: torch.Tensor, gate: torch.Tensor, residual: torch.Tensor | None = None,
                  force: bool = False) -> torch.Tensor:
    """y, shared [T, H] (routed and shared expert outputs), gate [T, 1] logits (any row stride), residual
    [T, H] or None -> (residual +) y + sigmoid(gate) * shared, in one launch on CUDA."""
    if not (force or enabled(y)) or not _combine_ok(y, shared, residual):
        return gated_combine_torch(y, shared, gate, residual)
    T, N = y.shape
    out = torch.empty_like(y)
    if T:
        block = min(1024, triton.next_power_of_2(N))
        _gated_combine_kernel[(T, triton.cdiv(N, block))](y, shared, gate, y if residual is None else residual, out,
                                                         y, y, N, gate.stride(0), 0.0, RESIDUAL=residual is not None,
                                                         NORM=False, ZERO_CENTERED=False, BLOCK=block)
    return out


def gated_combine_norm_ok(y, shared, residual, force: bool = False) -> bool:
    """Whether gated_combine_norm runs (rows up to 16K wide, held by one program each)."""
    return (force or enabled(y)) and _combine_ok(y, shared, residual) and y.shape[-1] <= 16384


def gated_combine_norm(y, shared, gate, residual, norm_weight, eps: float, zero_centered: bool):
    """gated_combine with a residual, and the next layer's RMSNorm of the result in the same launch:
    -> (h [T, H], norm(h) [T, H]). Callers check gated_combine_norm_ok first."""
    T, N = y.shape
    out, normed = torch.empty_like(y), torch.empty_like(y)
    if T:
        block = triton.next_power_of_2(N)
        _gated_combine_kernel[(T, 1)](y, shared, gate, residual, out, norm_weight, normed, N, gate.stride(0), eps,
                                      RESIDUAL=True, NORM=True, ZERO_CENTERED=zero_centered, BLOCK=block,
                                      num_warps=8 if block >= 2048 else 4)
    return out, normed


# ---- fp8 (e4m3fn) KV-cache elements, by integer arithmetic --------------------------------------------------
# The cache is handed to the kernels as its uint8 view: Triton's own float8e4nv casts need an sm_89+ GPU, and an
# fp8 cache must work on Turing / Ampere too. Encoding saturates at +-448 and rounds to nearest even, as torch's
# `clamp(-448, 448).to(torch.float8_e4m3fn)` does (layers/attention.py kv_write); tests/test_kv_fp8.py checks both
# directions against torch on every code and on random values.
if triton is not None:
    @triton.jit
    def fp8_decode(b):
        """uint8 e4m3fn codes -> fp32 values (0x7f / 0xff, the NaN codes, are never written)."""
        x = b.to(tl.int32)
        mag = x & 0x7F
        normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)  # exponent rebiased 7 -> 127
        val = tl.where(mag >= 8, normal, mag.to(tl.float32) * 0.001953125)  # subnormal: m * 2^-9
        return (val.to(tl.int32, bitcast=True) | ((x & 0x80) << 24)).to(tl.float32, bitcast=True)  # (-0.0 too)

    @triton.jit
    def fp8_encode(v):
        """fp32 values -> uint8 e4m3fn codes: saturated at +-448, rounded to nearest even."""
        bits = v.to(tl.int32, bitcast=True)
        a = tl.minimum(tl.abs(v), 448.0)
        sub = ((a + 16384.0) - 16384.0) * 512.0  # below 2^-6: multiples of 2^-9 (the ulp at 2^14), ties to even
        ab = a.to(tl.int32, bitcast=True)
        norm = ((ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20) - (120 << 3)  # mantissa to 3 bits, ties to even
        code = tl.where(a < 0.015625, sub.to(tl.int32), norm)
        code = tl.minimum(code, 126) | ((bits >> 24) & 0x80)
        return code.to(tl.uint8)


# ---- attention: q/k RMSNorm + rotary + KV-cache write in one launch -------------------------------------------
if triton is not None:
    @triton.jit
    def _head_norm(ptr, w_ptr, d, inv, D: tl.constexpr, ZERO_CENTERED: tl.constexpr, out_ty):
        """Channels d of one head normed like layers/norm.py RMSNorm (inv = 1/rms of the head), as fp32."""
        x = tl.load(ptr + d).to(tl.float32) * inv
        w = tl.load(w_ptr + d).to(tl.float32)
        if ZERO_CENTERED:
            return (x * (1.0 + w)).to(out_ty).to(tl.float32)
        return (x.to(out_ty).to(tl.float32) * w).to(out_ty).to(tl.float32)

    @triton.jit
    def _norm_rope_head(src, w_ptr, cos_row, sin_row, eps, out_ty, D: tl.constexpr, RD: tl.constexpr,
                        ZERO_CENTERED: tl.constexpr):
        """One head [D] at src: RMSNorm, then neox rotary on the first RD channels, rounded like rotary.py."""
        d = tl.arange(0, D)
        x = tl.load(src + d).to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        y = _head_norm(src, w_ptr, d, inv, D, ZERO_CENTERED, out_ty)
        half: tl.constexpr = RD // 2
        rot_d = tl.where(d < half, d + half, d - half)
        in_rd = d < RD
        partner = _head_norm(src, w_ptr, tl.where(in_rd, rot_d, d), inv, D, ZERO_CENTERED, out_ty)
        partner = tl.where(d < half, -partner, partner)
        c = tl.load(cos_row + d, mask=in_rd, other=1.0).to(tl.float32)
        s = tl.load(sin_row + d, mask=in_rd, other=0.0).to(tl.float32)
        rotated = ((y * c).to(out_ty).to(tl.float32) + (partner * s).to(out_ty).to(tl.float32)).to(out_ty)
        return tl.where(in_rd, rotated, y.to(out_ty))

    @triton.jit
    def _qk_norm_rope_cache_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, write_ptr,
                                   qout_ptr, kc_ptr, vc_ptr, H, HK, Q_T, Q_H, K_T, V_T, eps,
                                   D: tl.constexpr, RD: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                                   FP8: tl.constexpr = False):
        """Program (t, j): j < H normalises + rotates query head j into qout [T, H, D]; j >= H does key head
        j - H into the cache row write[t] and copies the matching value head there (FP8: the caches are the uint8
        views of e4m3fn caches, the rounded key and the value encoded)."""
        t = tl.program_id(0)
        j = tl.program_id(1)
        d = tl.arange(0, D)
        out_ty = qout_ptr.dtype.element_ty
        pos = tl.load(pos_ptr + t)
        cos_row = cos_ptr + pos * RD
        sin_row = sin_ptr + pos * RD
        if j < H:
            y = _norm_rope_head(q_ptr + t * Q_T + j * Q_H, qw_ptr, cos_row, sin_row, eps, out_ty, D, RD,
                                ZERO_CENTERED)
            tl.store(qout_ptr + (t * H + j) * D + d, y)
        else:
            hk = j - H
            y = _norm_rope_head(k_ptr + t * K_T + hk * D, kw_ptr, cos_row, sin_row, eps, out_ty, D, RD,
                                ZERO_CENTERED)
            row = tl.load(write_ptr + t)
            v = tl.load(v_ptr + t * V_T + hk * D + d)
            if FP8:
                tl.store(kc_ptr + (row * HK + hk) * D + d, fp8_encode(y.to(tl.float32)))
                tl.store(vc_ptr + (row * HK + hk) * D + d, fp8_encode(v.to(tl.float32)))
            else:
                tl.store(kc_ptr + (row * HK + hk) * D + d, y.to(kc_ptr.dtype.element_ty))
                tl.store(vc_ptr + (row * HK + hk) * D + d, v.to(vc_ptr.dtype.element_ty))


def qk_norm_rope_cache_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                          rotary, head_dim: int) -> bool:
    """Shapes the kernel handles: q [T, H, D] / k, v [T, Hk, D] with unit-stride heads of D apart (k, v),
    a power-of-two D, an even rotary width with contiguous cos/sin tables, contiguous caches."""
    D, rd = head_dim, rotary.rotary_dim
    return (D & (D - 1) == 0 and rd % 2 == 0 and 0 < rd <= D and q.stride(2) == 1
            and k.stride(2) == 1 and k.stride(1) == D and v.stride(2) == 1 and v.stride(1) == D
            and rotary.cos.is_contiguous() and rotary.sin.is_contiguous() and k_cache.is_contiguous())


def qk_norm_rope_cache(q, k, v, q_weight, k_weight, eps: float, zero_centered: bool, rotary, positions,
                       write_index, k_cache, v_cache) -> torch.Tensor:
    """q [T, H, D], k, v [T, Hk, D] (views, any token stride) -> normed and rotated q [T, H, D]; the normed,
    rotated k and v are written to k_cache, v_cache [slots, Hk, D] at rows write_index [T]. Equals
    Attention's q_norm/k_norm + Rotary.apply + kv_write (layers/attention.py), one launch; an fp8 (e4m3fn) cache
    gets the rounded key and the value encoded as kv_write encodes them."""
    T, H, D = q.shape
    Hk = k.shape[1]
    out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    if T:
        _qk_norm_rope_cache_kernel[(T, H + Hk)](
            q, k, v, q_weight, k_weight, rotary.cos, rotary.sin, positions, write_index, out, k_cache, v_cache,
            H, Hk, q.stride(0), q.stride(1), k.stride(0), v.stride(0), eps,
            D=D, RD=rotary.rotary_dim, ZERO_CENTERED=zero_centered, FP8=fp8)
    return out

"""Fused CUDA kernels (Triton) for the small ops that dominate a decode step.

A decode step of Qwen3.6 is launch-bound: an RMSNorm in torch is ~8 kernels and a Gated DeltaNet
decode ~40, each far shorter than its launch. These kernels do the same math in one launch each:

- `rms_norm` / `gated_rms_norm`: one program per row, fp32 math, the same rounding points as the
  torch modules in layers/norm.py (Qwen3: cast the normalised x, then multiply by the weight;
  Qwen3.5: multiply in fp32, cast last; gated: then times silu(gate) in fp32).
- `gdn_decode`: conv window update + depthwise conv + SiLU + L2 norms + the gated delta rule step +
  the state write-back, one program per (sequence, value head, block of value dims).

Used on CUDA when Triton imports (MOESTREAM_TRITON=0 turns them off); the torch code stays the
reference and the CPU path. tests/test_triton_layers.py compares both on a GPU.
"""
from __future__ import annotations

import torch

from ..env import triton_enabled

try:  # optional: absent on CPU-only installs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def enabled(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda and triton_enabled()


if triton is not None:
    @triton.jit
    def _rms_kernel(x_ptr, w_ptr, g_ptr, y_ptr, N, eps, ZERO_CENTERED: tl.constexpr, GATED: tl.constexpr,
                    BLOCK: tl.constexpr):
        row = tl.program_id(0)
        o = tl.arange(0, BLOCK)
        m = o < N
        x = tl.load(x_ptr + row * N + o, mask=m, other=0.0).to(tl.float32)
        xn = x * tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
        w = tl.load(w_ptr + o, mask=m, other=0.0).to(tl.float32)
        out_ty = y_ptr.dtype.element_ty
        if ZERO_CENTERED:
            y = xn * (1.0 + w)
        else:
            y = (xn.to(out_ty).to(tl.float32) * w).to(out_ty).to(tl.float32)
        if GATED:
            g = tl.load(g_ptr + row * N + o, mask=m, other=0.0).to(tl.float32)
            y = y * (g / (1.0 + tl.exp(-g)))
        tl.store(y_ptr + row * N + o, y.to(out_ty), mask=m)

    @triton.jit
    def _window(conv_base, mixed_row, c, taps, KW: tl.constexpr):
        """[len(c), KW] conv window of channels c: the KW-1 kept inputs, then the new token."""
        old = tl.load(conv_base + c[:, None] * (KW - 1) + taps[None, :], mask=taps[None, :] < KW - 1,
                      other=0.0).to(tl.float32)
        new = tl.load(mixed_row + c).to(tl.float32)
        return tl.where(taps[None, :] == KW - 1, new[:, None], old)

    @triton.jit
    def _conv_silu(win, convw_ptr, c, taps, out_ty, KW: tl.constexpr):
        y = tl.sum(win * tl.load(convw_ptr + c[:, None] * KW + taps[None, :]).to(tl.float32), axis=1)
        return (y / (1.0 + tl.exp(-y))).to(out_ty).to(tl.float32)  # rounded like the torch path

    @triton.jit
    def _gdn_decode_kernel(mixed_ptr, conv_ptr, convw_ptr, slots_ptr, g_ptr, beta_ptr, rec_ptr, out_ptr,
                           CONV_DIM, KEY_DIM, HV, REP, scale,
                           DK: tl.constexpr, DV: tl.constexpr, KW: tl.constexpr, BV: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        vb = tl.program_id(2)
        slot = tl.load(slots_ptr + b)
        hk = h // REP
        dk = tl.arange(0, DK)
        dv = vb * BV + tl.arange(0, BV)
        taps = tl.arange(0, KW)
        conv_base = conv_ptr + slot * CONV_DIM * (KW - 1)
        mixed_row = mixed_ptr + b * CONV_DIM
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
        gate = tl.exp(tl.load(g_ptr + b * HV + h))
        beta = tl.load(beta_ptr + b * HV + h)
        sp = rec_ptr + ((slot * HV + h) * DK + dk[:, None]) * DV + dv[None, :]
        S = tl.load(sp).to(tl.float32) * gate
        u = (v - tl.sum(S * k[:, None], axis=0)) * beta
        S = S + k[:, None] * u[None, :]
        o = tl.sum(S * q[:, None], axis=0)
        tl.store(sp, S.to(rec_ptr.dtype.element_ty))
        tl.store(out_ptr + (b * HV + h) * DV + dv, o.to(out_ty))

    @triton.jit
    def _conv_shift_kernel(mixed_ptr, conv_ptr, slots_ptr, CONV_DIM, NCH, KW: tl.constexpr, BLOCK: tl.constexpr):
        """Shift the conv windows of channels [0, NCH) by one token (after every reader ran)."""
        b = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        taps = tl.arange(0, KW)
        m = c < NCH
        base = conv_ptr + tl.load(slots_ptr + b) * CONV_DIM * (KW - 1)
        win = _window(base, mixed_ptr + b * CONV_DIM, tl.where(m, c, 0), taps, KW)
        shifted = tl.sum(tl.where(taps[None, None, :] == taps[None, :, None] + 1, win[:, None, :], 0.0), axis=2)
        tl.store(base + c[:, None] * (KW - 1) + taps[None, :], shifted.to(conv_ptr.dtype.element_ty),
                 mask=m[:, None] & (taps[None, :] < KW - 1))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool,
             gate: torch.Tensor | None = None) -> torch.Tensor:
    shape = x.shape
    N = shape[-1]
    x2 = x.reshape(-1, N).contiguous()
    y = torch.empty_like(x2)
    g2 = gate.reshape(-1, N).contiguous() if gate is not None else x2
    _rms_kernel[(x2.shape[0],)](x2, weight, g2, y, N, eps, ZERO_CENTERED=zero_centered, GATED=gate is not None,
                                BLOCK=triton.next_power_of_2(N))
    return y.view(shape)


def gdn_decode(mixed, conv_state, conv_w, slots, g, beta, rec_state, out, key_dim, hk, hv, dk, dv) -> None:
    """mixed [B, conv_dim]; conv_state [slots, conv_dim, K-1]; conv_w [conv_dim, K]; g, beta [B, Hv] fp32;
    rec_state [slots, Hv, Dk, Dv]; writes out [B, Hv, Dv] and updates both states in place."""
    B, conv_dim = mixed.shape
    K = conv_w.shape[1]
    bv = min(32, dv)
    mixed = mixed.contiguous()
    _gdn_decode_kernel[(B, hv, dv // bv)](
        mixed, conv_state, conv_w.contiguous(), slots, g.contiguous(), beta.contiguous(), rec_state,
        out, conv_dim, key_dim, hv, hv // hk, dk ** -0.5, DK=dk, DV=dv, KW=K, BV=bv)
    _conv_shift_kernel[(B, triton.cdiv(2 * key_dim, 128))](mixed, conv_state, slots, conv_dim, 2 * key_dim,
                                                           KW=K, BLOCK=128)


def gdn_decode_ok(conv_state: torch.Tensor, K: int, dk: int, dv: int) -> bool:
    """Shapes the kernel handles: power-of-two head dims and conv width, contiguous states."""
    p2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    return p2(dk) and p2(dv) and p2(K) and K >= 2 and conv_state.is_contiguous()

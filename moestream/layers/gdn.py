"""Gated DeltaNet (the linear-attention token mixer of Qwen3.5/3.6).

Per value head, the state S [Dk, Dv] evolves token by token:
    S <- exp(g_t) * S;  u_t = beta_t * (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T q_t
with q, k L2-normalised and q scaled by Dk^-1/2. Prefill uses the equivalent chunked form
(`chunk_gated_delta_rule`), decode the step above (`recurrent_gated_delta_rule`). Both in fp32.
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from ..batch import ForwardBatch
from ..env import gdn_front_kernel, gdn_prep_kernel
from . import triton_ops
from ..kernels.linear import Linear
from .norm import GatedRMSNorm


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk: int = 64, states_at=(), kernel: bool | None = None):
    """q, k [H, L, Dk] (normalised, q scaled); v [H, L, Dv]; g, beta [H, L]; state [H, Dk, Dv] (fp32);
    states_at: token counts e (1 <= e <= L) after which the state is wanted too (prefix-cache snapshots).

    Within a chunk with cumulative log-decay c (c_i = g_1 + ... + g_i) and start state S0, the
    written values u solve the unit lower-triangular system
        (I + A) u = beta*v - beta*exp(c) * (K S0),  A_ij = beta_i exp(c_i - c_j) k_i.k_j  (j < i)
    and o = exp(c) * (Q S0) + (QK^T * exp(c_i - c_j), j <= i) u,
        S_end = exp(c_last) S0 + (K * exp(c_last - c))^T u,
    and the state after the chunk's j-th token is the same sum cut at j (`_state_within`).
    Everything but the recurrence over chunks is batched over all chunks (`_chunk_terms`); the recurrence
    is one Triton launch (triton_ops.gdn_chunk_scan) where `kernel` (default: on CUDA with Triton enabled
    and shapes it handles; True forces it, e.g. for CPU tensors under TRITON_INTERPRET=1), else a loop; with
    `kernel` and env.gdn_prep_kernel (on by default; MOESTREAM_GDN_PREP=0: off) the chunk terms are one launch as well
    (triton_ops.gdn_chunk_prep) instead of `_chunk_terms`' batched torch ops.
    Returns (o [H, L, Dv], final state, [state after e tokens for e in states_at]).
    """
    H, L, Dk = k.shape
    if kernel is None:
        kernel = (triton_ops.enabled(q) and triton_ops.gdn_chunk_ok(Dk, v.shape[-1], chunk)
                  and q.dtype == k.dtype == v.dtype == state.dtype == torch.float32)
    if kernel and gdn_prep_kernel():  # the chunk terms in one launch too (triton_ops.gdn_chunk_prep)
        c, u0, w, q_dec, k_dec, qk, last = triton_ops.gdn_chunk_prep(q, k, v, g, beta, chunk)
        if states_at:  # the snapshots' sums read k by chunk
            k = F.pad(k, (0, 0, 0, (-L) % chunk)).reshape(H, -1, chunk, Dk)
    else:
        k, c, u0, w, qk, q_dec, k_dec, last = _chunk_terms(q, k, v, g, beta, chunk)
    wanted = {}  # chunk index -> [(index into states_at, last token's position within the chunk)]
    for a, e in enumerate(states_at):
        assert 1 <= e <= L, (e, L)
        wanted.setdefault((e - 1) // chunk, []).append((a, (e - 1) % chunk))
    mids = [None] * len(states_at)
    if kernel:
        snap_chunks = sorted(wanted)
        out, S, starts = triton_ops.gdn_chunk_scan(u0, w, q_dec, qk, k_dec, last, state, snap_chunks)
        for s, i in enumerate(snap_chunks):  # the chunk's u again from its start state, then the cut sums
            u = u0[:, i] - w[:, i] @ starts[s]
            for a, j in wanted[i]:
                mids[a] = _state_within(starts[s], k[:, i], u, c[:, i], j)
        return out.reshape(H, -1, out.shape[-1])[:, :L], S, mids
    out = torch.empty_like(u0)
    S = state
    for i in range(k.shape[1]):
        u = u0[:, i] - w[:, i] @ S
        out[:, i] = q_dec[:, i] @ S + qk[:, i] @ u
        for a, j in wanted.get(i, ()):
            mids[a] = _state_within(S, k[:, i], u, c[:, i], j)
        S = S * last[:, i, None, None] + k_dec[:, i].transpose(-1, -2) @ u
    return out.reshape(H, -1, out.shape[-1])[:, :L], S, mids


def _chunk_terms(q, k, v, g, beta, chunk: int):
    """The per-chunk terms of chunk_gated_delta_rule, for all chunks at once (L padded to whole chunks):
    k [H, n, C, Dk], c [H, n, C], u0 [H, n, C, Dv], w, q_dec, k_dec [H, n, C, Dk], qk [H, n, C, C], last [H, n]."""
    H, L, Dk = k.shape
    pad = (-L) % chunk
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))  # g = 0 and beta = 0: padding changes nothing
    n = (L + pad) // chunk
    q, k, v = (t.reshape(H, n, chunk, -1) for t in (q, k, v))
    g, beta = g.reshape(H, n, chunk), beta.reshape(H, n, chunk)
    c = g.cumsum(-1)
    diff = c.unsqueeze(-1) - c.unsqueeze(-2)  # [H, n, C, C]: c_i - c_j
    lower_incl = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = diff.masked_fill(~lower_incl, float("-inf")).exp()
    a = (beta.unsqueeze(-1) * (k @ k.transpose(-1, -2))) * decay.tril(-1)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    system = eye + a
    rhs_v = beta.unsqueeze(-1) * v
    rhs_k = (beta * c.exp()).unsqueeze(-1) * k
    u0 = torch.linalg.solve_triangular(system, rhs_v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, rhs_k, upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * c.exp().unsqueeze(-1)
    k_dec = k * (c[..., -1:] - c).exp().unsqueeze(-1)
    last = c[..., -1].exp()  # [H, n]
    return k, c, u0, w, qk, q_dec, k_dec, last


def _state_within(S0, k, u, c, j: int):
    """The state after position j (0-based) of a chunk that started in S0: k [H, C, Dk], u [H, C, Dv] the
    chunk's written values, c [H, C] its cumulative log-decay."""
    k_dec = k[:, :j + 1] * (c[:, j:j + 1] - c[:, :j + 1]).exp().unsqueeze(-1)
    return S0 * c[:, j].exp()[:, None, None] + k_dec.transpose(-1, -2) @ u[:, :j + 1]


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    """One token per sequence: q, k [B, H, Dk]; v [B, H, Dv]; g, beta [B, H]; state [B, H, Dk, Dv]."""
    S = state * g.exp()[..., None, None]
    kv = (S * k.unsqueeze(-1)).sum(-2)  # S^T k: [B, H, Dv]
    u = (v - kv) * beta.unsqueeze(-1)
    S = S + k.unsqueeze(-1) * u.unsqueeze(-2)
    o = (S * q.unsqueeze(-1)).sum(-2)
    return o, S


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden: int, num_k_heads: int, num_v_heads: int, k_dim: int, v_dim: int,
                 conv_kernel: int, eps: float):
        super().__init__()
        self.hk, self.hv, self.dk, self.dv = num_k_heads, num_v_heads, k_dim, v_dim
        self.key_dim, self.value_dim = num_k_heads * k_dim, num_v_heads * v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = conv_kernel
        self.in_proj_qkv = Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = Linear(hidden, num_v_heads, bias=False)
        self.in_proj_a = Linear(hidden, num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads))
        self.A_log = nn.Parameter(torch.empty(num_v_heads))
        self.norm = GatedRMSNorm(v_dim, eps)
        self.out_proj = Linear(self.value_dim, hidden, bias=False)
        self.in_proj = None  # models/fuse.py: in_proj_qkv | in_proj_z | in_proj_b | in_proj_a in one GEMM
        # absorb_out_perm: value head h of the norm's output written at head out_dest[h] (out_proj's stored order)
        self.out_dest: torch.Tensor | None = None
        self._out_perm_checked = False  # tried once on a GPU (a permutation that moves no whole heads stays as it is)

    def absorb_out_perm(self) -> bool:
        """A compressed out_proj whose stored columns are the value heads in another order (a Qwen3.6 GGUF's tiled
        order: layers.QuantLinear's in_perm, head by head) reads them as stored: the gated norm writes each head where
        out_proj stores it (one scattered write inside the norm) instead of the GEMV reading x through the
        permutation (on an H100 the permuted Q6_K GEMV took 17.5 us where the plain one takes 11.0: 30 of them a
        Qwen3.6 decode step). False, nothing changed, where the permutation does not move whole heads."""
        perm = getattr(self.out_proj, "in_perm", None)
        if perm is None or perm.numel() != self.value_dim:
            return False
        heads = perm.view(self.hv, self.dv).cpu()  # (once: a GPU's copy waits for it, before any graph is recorded)
        order = heads[:, 0] // self.dv  # stored head j holds the model's head order[j]
        if not torch.equal(heads, order[:, None] * self.dv + torch.arange(self.dv)):
            return False
        self.out_dest = torch.argsort(order).to(torch.int32).to(perm.device)
        self.out_proj.in_perm = None
        return True

    def _project(self, x: torch.Tensor):
        """x [T, hidden] -> mixed [T, conv_dim], z [T, value_dim], b, a [T, Hv] (views of one GEMM if fused)."""
        if self.in_proj is not None:
            return self.in_proj.split(self.in_proj(x))
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def _gates(self, b: torch.Tensor, a: torch.Tensor):
        """b, a [T, Hv] -> g (log decay), beta [T, Hv] fp32. beta rounds like the reference (sigmoid in x.dtype)."""
        beta = torch.sigmoid(b).float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return g, beta

    def forward(self, x: torch.Tensor, batch: ForwardBatch, conv_state: torch.Tensor,
                rec_state: torch.Tensor) -> torch.Tensor:
        """x [T, hidden]; conv_state [slots, conv_dim, K-1] and rec_state [slots, Hv, Dk, Dv] of this layer."""
        mixed, z, b, a = self._project(x)  # mixed [T, conv_dim], z [T, value_dim], b, a [T, Hv]
        core = torch.empty((x.shape[0], self.hv, self.dv), dtype=x.dtype, device=x.device)
        n = batch.extra.get("verify_n", 1) if batch.is_decode else 1
        if n > 1:  # a verify step as decode rows (engine/graphs.verify_rows): each request's n rows in turn
            slots, ckpt = batch.state_slots[::n].contiguous(), batch.extra.get("verify_ckpt")
            for j in range(n):
                core[j::n] = self._decode_rows(mixed[j::n], b[j::n], a[j::n], slots, conv_state, rec_state)
                if ckpt is not None and j < n - 1:  # checkpoint j: the state after row j (a rejected draft's rollback)
                    conv_state[ckpt[:, j]] = conv_state[slots]
                    rec_state[ckpt[:, j]] = rec_state[slots]
        elif batch.is_decode:
            core = self._decode_rows(mixed, b, a, batch.state_slots, conv_state, rec_state)
        else:
            front = self._triton_front(mixed, conv_state)
            g = beta = None
            for s in batch.seqs:
                sl = slice(s.start, s.start + s.length)
                if front and not s.checkpoints:  # conv, norms and gates in one launch (no speculative verify)
                    core[sl] = self._prefill_front(mixed[sl], b[sl], a[sl], s.state_slot, conv_state, rec_state,
                                                   s.snapshots)
                    continue
                if g is None:
                    g, beta = self._gates(b, a)
                core[sl] = self._prefill_one(mixed[sl], g[sl], beta[sl], s.state_slot, conv_state, rec_state,
                                             s.checkpoints, s.snapshots)
        # z stays a (strided) view: [T, Hv, Dv] rows of the fused product, normed with core [T, Hv, Dv]
        if not self._out_perm_checked and x.is_cuda and not torch.cuda.is_current_stream_capturing():
            self._out_perm_checked = True
            self.absorb_out_perm()  # on a GPU, at the first (eager) call: the GEMV without the permutation
        out = self.norm(core, z.unflatten(-1, (self.hv, self.dv)), self.out_dest).reshape(x.shape[0], -1)
        return self.out_proj(out)

    def _triton_decode(self, mixed, conv_state) -> bool:
        return triton_ops.enabled(mixed) and triton_ops.gdn_decode_ok(conv_state, self.kernel, self.dk, self.dv)

    def _triton_front(self, mixed, conv_state) -> bool:
        """Whether a prefill takes triton_ops.gdn_prefill_front (MOESTREAM_GDN_FRONT=1, CUDA, the decode kernel's
        shapes)."""
        return gdn_front_kernel() and self._triton_decode(mixed, conv_state)

    def _prefill_front(self, mixed, b, a, slot, conv_state, rec_state, snapshots=()):
        """_prefill_one with the conv, SiLU, split, norms and gates in one launch (triton_ops.gdn_prefill_front);
        the conv state's new tail (and the snapshots' windows) cut from the old kept inputs and the last rows."""
        K = self.kernel
        q, k, v, g, beta = triton_ops.gdn_prefill_front(mixed, conv_state[slot], self.conv1d.weight[:, 0, :], b, a,
                                                        self.A_log, self.dt_bias, self.key_dim, self.hk, self.hv,
                                                        self.dk, self.dv)
        old = conv_state[slot].to(mixed.dtype)

        def tail(e: int) -> torch.Tensor:  # the K-1 inputs ending at token e (the cat of _prefill_one, cut)
            return torch.cat([old, mixed[max(0, e - (K - 1)):e].t()], dim=-1)[:, -(K - 1):].to(conv_state.dtype)

        for e, dst in snapshots:
            conv_state[dst] = tail(e)
        conv_state[slot] = tail(mixed.shape[0])
        return self._recur(q, k, v, g, beta, slot, rec_state, snapshots).to(mixed.dtype)

    def _split(self, conv_out: torch.Tensor):
        """conv_out [..., conv_dim] -> q, k [..., Hv, Dk] (normalised, repeated to value heads), v [..., Hv, Dv]."""
        q, k, v = torch.split(conv_out.float(), [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        rep = self.hv // self.hk
        q = _l2norm(q.unflatten(-1, (self.hk, self.dk))).repeat_interleave(rep, dim=-2) * self.dk ** -0.5
        k = _l2norm(k.unflatten(-1, (self.hk, self.dk))).repeat_interleave(rep, dim=-2)
        return q, k, v.unflatten(-1, (self.hv, self.dv))

    def _prefill_one(self, mixed, g, beta, slot, conv_state, rec_state, checkpoints=None, snapshots=()):
        """One sequence's prefill chunk; snapshots: (e, dst slot) pairs, the state after the chunk's first e
        tokens (e < the chunk's length) written into slot dst (a prefix-cache snapshot); checkpoints (a
        speculative verify): slot i gets the state after token i."""
        w = self.conv1d.weight  # [conv_dim, 1, K]
        window = torch.cat([conv_state[slot].to(mixed.dtype), mixed.t()], dim=-1)  # [conv_dim, K-1+L]
        conv_state[slot] = window[:, -(self.kernel - 1):].to(conv_state.dtype)
        for e, dst in snapshots:  # the conv window after e tokens: the K-1 inputs ending at token e
            conv_state[dst] = window[:, e:e + self.kernel - 1].to(conv_state.dtype)
        conv_out = F.silu(F.conv1d(window.unsqueeze(0).to(w.dtype), w, groups=self.conv_dim))[0].t()  # [L, conv]
        conv_out = conv_out.to(mixed.dtype)
        q, k, v = self._split(conv_out)  # [L, Hv, D]
        if checkpoints:  # a speculative verify (a few tokens): the step recurrence, keeping each state
            return self._steps(q, k, v, g, beta, slot, window, conv_state, rec_state, checkpoints,
                               snapshots).to(mixed.dtype)
        return self._recur(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.t(), beta.t(), slot, rec_state,
                           snapshots).to(mixed.dtype)

    @staticmethod
    def _recur(q, k, v, g, beta, slot, rec_state, snapshots):
        """The chunked rule over one sequence's q, k [Hv, L, Dk], v [Hv, L, Dv], g, beta [Hv, L] from the slot's
        state; the slot's state and the snapshots' states written. Returns o [L, Hv, Dv] (fp32)."""
        o, S, mids = chunk_gated_delta_rule(q, k, v, g, beta, rec_state[slot].float(),
                                            states_at=[e for e, _ in snapshots])
        rec_state[slot] = S.to(rec_state.dtype)
        for (_, dst), m in zip(snapshots, mids):
            rec_state[dst] = m.to(rec_state.dtype)
        return o.transpose(0, 1)

    def _steps(self, q, k, v, g, beta, slot, window, conv_state, rec_state, checkpoints, snapshots=()):
        """Token by token (the decode recurrence): the conv window and state after token i also go to
        slot checkpoints[i] (and after e tokens to dst, for the (e, dst) snapshots). q, k, v [L, Hv, D];
        returns o [L, Hv, Dv]."""
        snap = dict(snapshots)
        S = rec_state[slot].float()
        out = torch.empty_like(v)
        for i in range(q.shape[0]):
            o, S = recurrent_gated_delta_rule(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1],
                                              S.unsqueeze(0))
            S, out[i] = S[0], o[0]
            for dst in ([checkpoints[i]] if i < len(checkpoints) else []) + ([snap[i + 1]] if i + 1 in snap else []):
                rec_state[dst] = S.to(rec_state.dtype)
                conv_state[dst] = window[:, i + 1:i + self.kernel].to(conv_state.dtype)
        rec_state[slot] = S.to(rec_state.dtype)
        return out

    def _decode_rows(self, mixed, b, a, slots, conv_state, rec_state) -> torch.Tensor:
        """One token of each sequence (state slot slots[i] for row i) -> core [B, Hv, Dv]; the states advance."""
        core = torch.empty((mixed.shape[0], self.hv, self.dv), dtype=mixed.dtype, device=mixed.device)
        if self._triton_decode(mixed, conv_state):
            # the gate math runs inside the decode kernel (no ~8 elementwise launches)
            triton_ops.gdn_decode(mixed, conv_state, self.conv1d.weight[:, 0, :], slots, None, None, rec_state, core,
                                  self.key_dim, self.hk, self.hv, self.dk, self.dv, raw_gates=(b, a, self.A_log,
                                                                                               self.dt_bias))
        else:
            g, beta = self._gates(b, a)
            self._decode(mixed, g, beta, slots, conv_state, rec_state, core)
        return core

    def _decode(self, mixed, g, beta, slots, conv_state, rec_state, core):
        if self._triton_decode(mixed, conv_state):
            triton_ops.gdn_decode(mixed, conv_state, self.conv1d.weight[:, 0, :], slots, g, beta, rec_state, core,
                                  self.key_dim, self.hk, self.hv, self.dk, self.dv)
            return
        w = self.conv1d.weight[:, 0, :]  # [conv_dim, K]
        window = torch.cat([conv_state[slots].to(mixed.dtype), mixed.unsqueeze(-1)], dim=-1)  # [B, conv, K]
        conv_state[slots] = window[:, :, 1:].to(conv_state.dtype)
        # F.conv1d's products and sums in fp32, rounded to w's dtype once (as the prefill's conv and HF's decode)
        conv_out = F.silu((window.to(w.dtype).float() * w.float()).sum(-1).to(w.dtype)).to(mixed.dtype)  # [B, conv]
        q, k, v = self._split(conv_out)
        o, S = recurrent_gated_delta_rule(q, k, v, g, beta, rec_state[slots].float())
        rec_state[slots] = S.to(rec_state.dtype)
        core.copy_(o.to(core.dtype))

"""GQA attention with q/k norms, optional output gate (Qwen3.5), over the paged KV pool."""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from ..batch import ForwardBatch
from ..kernels.linear import Linear
from . import attn_decode, attn_prefill, triton_ops
from .norm import RMSNorm
from .rotary import Rotary

try:  # bottom-right causal attention without a materialised mask (flash / efficient kernels)
    from torch.nn.attention.bias import causal_lower_right
except ImportError:  # pragma: no cover - older torch
    causal_lower_right = None

# a prefill chunk's queries attend in slices whose [heads, queries, keys] float32 scores stay under this, so the
# attention of a long prompt's late chunks is bounded by the plan's workspace whatever kernel SDPA picks (one with
# a materialised score matrix included)
SCORES_BYTES = 128 << 20
# on a GPU, a prefill chunk whose context's K and V, gathered from the pool in the queries' dtype, would pass this
# reads them in place instead (Attention._attend_long: the paged prefill kernel of layers/attn_prefill.py, or where it
# cannot run the torch key blocks, a float32 online softmax over key blocks of this many bytes), so a long context's
# late chunks need no whole-context copy (512 MiB of K/V at 262k tokens for the Qwen3.6 shape) beyond the plan's
# fixed workspace. In host memory the gathered path (SDPA's fused CPU kernel: 1.6-1.7x faster than
# the blocks on the 2-core VM, 16k-32k context) runs up to HOST_GATHER_BYTES.
GATHER_BYTES = 64 << 20
HOST_GATHER_BYTES = 1 << 30

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value: an fp8 cache saturates there (no scale: --kv-cache-dtype fp8)


def kv_write(cache: torch.Tensor, rows: torch.Tensor, x: torch.Tensor) -> None:
    """x [T, Hk, D] into cache rows `rows` in the cache's dtype; an fp8 (e4m3fn) cache gets x saturated at +-448 and
    rounded to nearest even, written through its uint8 view (torch has no fp8 index_copy_ on every device)."""
    if cache.dtype == FP8:
        cache.view(torch.uint8).index_copy_(0, rows, x.clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8))
    else:
        cache.index_copy_(0, rows, x.to(cache.dtype))


def kv_rows(cache: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache[rows] in `dtype` (an fp8 cache gathered through its uint8 view, then decoded)."""
    if cache.dtype == FP8:
        return cache.view(torch.uint8)[rows].view(FP8).to(dtype)
    return cache[rows].to(dtype)


class Attention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 output_gate: bool, zero_centered_norm: bool, qk_norm: bool = True):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.output_gate = output_gate
        q_out = num_heads * head_dim * (2 if output_gate else 1)
        self.q_proj = Linear(hidden, q_out, bias=False)
        self.k_proj = Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.v_proj = Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.o_proj = Linear(num_heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps, zero_centered_norm) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(head_dim, eps, zero_centered_norm) if qk_norm else nn.Identity()
        self.scale = head_dim ** -0.5
        self.qkv_proj = None  # models/fuse.py: q_proj | k_proj | v_proj in one GEMM

    def _project(self, x: torch.Tensor):
        """x [T, hidden] -> q [T, q_out], k, v [T, Hk*D] (views of one GEMM if fused)."""
        if self.qkv_proj is not None:
            return self.qkv_proj.split(self.qkv_proj(x))
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def _fused_prep(self, q, k, v, k_cache, rotary) -> bool:
        qn, kn = self.q_norm, self.k_norm
        return (triton_ops.enabled(q) and isinstance(qn, RMSNorm) and isinstance(kn, RMSNorm)
                and qn.eps == kn.eps and qn.zero_centered == kn.zero_centered
                and k_cache.dtype in (k.dtype, FP8)
                and triton_ops.qk_norm_rope_cache_ok(q, k, v, k_cache, rotary, self.head_dim))

    def forward(self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
                rotary: Rotary) -> torch.Tensor:
        T = x.shape[0]
        H, Hk, D = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self._project(x)
        gate = None
        if self.output_gate:
            # Per head, the projection holds [query (D) | gate (D)].
            q, gate = q.view(T, H, 2 * D).chunk(2, dim=-1)
            gate = gate.reshape(T, H * D)
        q, k, v = q.view(T, H, D), k.view(T, Hk, D), v.view(T, Hk, D)
        if self._fused_prep(q, k, v, k_cache, rotary):
            # q/k norms, rotary and the KV-cache write in one launch (q: a new contiguous [T, H, D])
            q = triton_ops.qk_norm_rope_cache(q, k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                              self.q_norm.zero_centered, rotary, batch.positions,
                                              batch.kv_write_index, k_cache, v_cache)
        else:
            q = self.q_norm(q.reshape(T, H, D))
            k = self.k_norm(k)
            q, k = rotary.apply(q, k, batch.positions)
            kv_write(k_cache, batch.kv_write_index, k)
            kv_write(v_cache, batch.kv_write_index, v)
        if "decode_kv_index" in batch.extra:
            ex, out = batch.extra, None
            if attn_decode.usable(q, k_cache):
                lengths = ex.get("decode_kv_len")
                lengths = ex["decode_kv_valid"].sum(1) if lengths is None else lengths
                out = attn_decode.decode_attention(q, k_cache, v_cache, ex["decode_kv_index"], lengths, self.scale)
            if out is None:  # (also where the kernels could not run on this GPU)
                out = self._decode_padded(q, ex["decode_kv_index"], ex["decode_kv_valid"], k_cache, v_cache)
        elif batch.is_decode and len(batch.seqs) > 1:
            out = self._decode_batched(q, batch, k_cache, v_cache)
        else:
            out = torch.empty_like(q)
            bound = GATHER_BYTES if q.is_cuda else HOST_GATHER_BYTES
            for s in batch.seqs:
                qs = q[s.start:s.start + s.length]
                if 2 * (s.cached + s.length) * Hk * D * q.element_size() > bound:
                    o = self._attend_long(qs, k_cache, v_cache, s.kv_index, s.cached)
                else:
                    o = self._attend(qs, kv_rows(k_cache, s.kv_index, q.dtype), kv_rows(v_cache, s.kv_index, q.dtype),
                                     s.cached)
                out[s.start:s.start + s.length] = o
        out = out.reshape(T, H * D)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached: int) -> torch.Tensor:
        """q [L, H, D] attends causally to k, v [cached + L, Hk, D]: query i (absolute position cached + i) sees
        keys 0..cached + i. The queries go in slices of at most SCORES_BYTES of scores, each seeing only the keys
        up to its last query; the KV heads are not repeated for the query heads that share them (enable_gqa)."""
        L, H = q.shape[0], self.num_heads
        step = max(16, SCORES_BYTES // (4 * H * max(cached + L, 1)))
        if L <= step:
            return self._attend_slice(q, k, v, cached)
        out = torch.empty_like(q)
        for i in range(0, L, step):
            j = min(i + step, L)
            out[i:j] = self._attend_slice(q[i:j], k[:cached + j], v[:cached + j], cached + i)
        return out

    def _attend_long(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor,
                     cached: int) -> torch.Tensor:
        """A chunk whose context passes the gather bound: the paged prefill kernel (layers/attn_prefill.py: keys read
        from the pool in place, tensor cores) where it runs, else the torch key blocks."""
        if attn_prefill.usable(q, k_cache):
            out = attn_prefill.prefill_attention(q, k_cache, v_cache, index, cached, self.scale)
            if out is not None:
                return out
        return self._attend_blocks(q, k_cache, v_cache, index, cached)

    def _attend_blocks(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor,
                       cached: int) -> torch.Tensor:
        """_attend over the pool rows `index` ([cached + L]) without gathering them at once: keys in blocks whose
        float32 K and V take GATHER_BYTES, each read once, every query row's softmax carried online across them
        (running max, sum and weighted values in float32); the rows of a block's scores go in slices within
        SCORES_BYTES. Queries before a block's first key skip it; only a block reaching past a slice's first query
        is masked."""
        L, H, D = q.shape
        Hk = self.num_kv_heads
        G = H // Hk
        S = cached + L
        block = max(16, GATHER_BYTES // (2 * Hk * D * 4))
        rows = max(16, SCORES_BYTES // (4 * H * block))
        qf = q.float().view(L, Hk, G, D).permute(1, 2, 0, 3) * self.scale  # [Hk, G, L, D]
        acc = torch.zeros_like(qf)
        peak = torch.full((Hk, G, L), float("-inf"), device=q.device)
        total = torch.zeros((Hk, G, L), device=q.device)
        qpos = cached + torch.arange(L, device=q.device)
        for b0 in range(0, S, block):
            b1 = min(b0 + block, S)
            keys = torch.arange(b0, b1, device=q.device)
            kb = kv_rows(k_cache, index[b0:b1], torch.float32).permute(1, 2, 0)[:, None]  # [Hk, 1, D, B]
            vb = kv_rows(v_cache, index[b0:b1], torch.float32).transpose(0, 1)[:, None]  # [Hk, 1, B, D]
            for r0 in range(max(0, b0 - cached), L, rows):
                r1 = min(r0 + rows, L)
                sc = torch.matmul(qf[:, :, r0:r1], kb)  # [Hk, G, R, B]
                if b1 - 1 > cached + r0:  # some key of the block lies after some query of the slice
                    sc.masked_fill_(keys[None, :] > qpos[r0:r1, None], float("-inf"))
                # every row sees the block's first key (r0 >= b0 - cached): the new peak is finite
                new = torch.maximum(peak[..., r0:r1], sc.amax(-1))
                keep = torch.exp(peak[..., r0:r1] - new)
                sc.sub_(new[..., None]).exp_()
                total[..., r0:r1] = total[..., r0:r1] * keep + sc.sum(-1)
                acc[:, :, r0:r1] = acc[:, :, r0:r1] * keep[..., None] + torch.matmul(sc, vb)
                peak[..., r0:r1] = new
        out = acc / total[..., None]
        return out.permute(2, 0, 1, 3).reshape(L, H, D).to(q.dtype)

    def _attend_slice(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cached: int) -> torch.Tensor:
        L, S = q.shape[0], k.shape[0]
        gqa = self.num_heads != self.num_kv_heads
        # [1, H, L, D]: SDPA's fused kernels take 4-D inputs only (3-D ran its math path: 5x slower for a 1,536-token
        # prompt on a CPU); a prompt with nothing cached before it is plain causal attention
        qh = q.transpose(0, 1)[None]
        kh = k.to(q.dtype).transpose(0, 1)[None]
        vh = v.to(q.dtype).transpose(0, 1)[None]
        mask, causal = None, L > 1 and cached == 0
        if L > 1 and cached:
            if causal_lower_right is not None and q.is_cuda:  # flash / efficient kernels, no [L, S] mask
                mask = causal_lower_right(L, S)
            else:
                mask = torch.arange(S, device=q.device)[None, :] <= (cached + torch.arange(L, device=q.device))[:, None]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal, scale=self.scale,
                                           enable_gqa=gqa)
        return o[0].transpose(0, 1)

    def _decode_padded(self, q, idx: torch.Tensor, valid: torch.Tensor, k_cache, v_cache) -> torch.Tensor:
        """Decode with the step's KV positions given as device tensors (idx, valid [B, S], S padded to a
        bucket): no host data per layer, so the step can be a CUDA graph."""
        B = idx.shape[0]
        groups = self.num_heads // self.num_kv_heads
        # the query heads sharing a KV head ride as that head's "query length": no K/V repetition
        k = kv_rows(k_cache, idx, q.dtype).permute(0, 2, 1, 3)  # [B, Hk, S, D]
        v = kv_rows(v_cache, idx, q.dtype).permute(0, 2, 1, 3)
        qh = q.view(B, self.num_kv_heads, groups, self.head_dim)
        o = F.scaled_dot_product_attention(qh, k, v, attn_mask=valid[:, None, None, :], scale=self.scale)
        return o.reshape(B, self.num_heads, self.head_dim)

    def _decode_batched(self, q, batch: ForwardBatch, k_cache, v_cache) -> torch.Tensor:
        """All sequences decode one token: pad their KV to the longest and attend in one call (_decode_padded: the
        query heads sharing a KV head ride as its query length, no K/V repetition)."""
        B = len(batch.seqs)
        S = max(s.total for s in batch.seqs)
        idx = torch.zeros((B, S), dtype=torch.long, device=q.device)
        valid = torch.zeros((B, S), dtype=torch.bool, device=q.device)
        for i, s in enumerate(batch.seqs):
            idx[i, :s.total] = s.kv_index
            valid[i, :s.total] = True
        return self._decode_padded(q, idx, valid, k_cache, v_cache)

"""moestream.layers.attn_decode: the split-KV decode attention kernels equal SDPA over each sequence's gathered K/V.

* Interpreter: every case runs once in a subprocess with TRITON_INTERPRET=1 on CPU tensors (float32 caches:
  the interpreter's dot is exact enough to hold 1e-5), each reported as its own test. Needs only `triton`.
* Compiler: the split kernel compiles for sm_90 (bf16, head dim 256, 8 query heads per KV head; no GPU needed).
* CUDA: bf16 against SDPA, the engine wiring (attention's graph path takes the kernel) and a CUDA graph replayed
  at a longer length than recorded; skipped without a GPU.

Run as a script (`python tests/test_attn_decode.py --worker OUT.json`) it is the interpreter worker.
"""
from __future__ import annotations

import sys
import zlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the worker runs as a script: find moestream
sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_harness import HAS_TRITON, assert_case, compile_sm90, interpreted_results, write_case_results  # noqa: E402

# name -> (lengths per sequence, padded width, query heads, KV heads, head dim)
CASES = {
    "one-token": ([1], 64, 4, 2, 32),
    "gqa8-long": ([1000], 1024, 16, 2, 64),  # Qwen3.6's 8 query heads per KV head; many splits, a partial block
    "batch-ragged": ([5, 300, 129, 64], 320, 8, 2, 32),  # splits past a sequence's length stay empty
    "mha": ([77, 3], 96, 4, 4, 16),  # one query head per KV head (padded to 16 rows)
    "gqa3": ([200], 256, 9, 3, 64),  # a group size that is not a power of two (SmolLM2)
}


def reference(q, k_cache, v_cache, idx, lengths, scale):
    """float64 SDPA over each sequence's own K/V rows (KV heads repeated for their query heads)."""
    B, H, D = q.shape
    G = H // k_cache.shape[1]
    out = torch.empty(B, H, D, dtype=torch.float64)
    for b in range(B):
        rows = idx[b, :int(lengths[b])]
        k = k_cache[rows].double().repeat_interleave(G, dim=1).transpose(0, 1)  # [H, L, D]
        v = v_cache[rows].double().repeat_interleave(G, dim=1).transpose(0, 1)
        out[b] = F.scaled_dot_product_attention(q[b].double()[:, None], k, v, scale=scale)[:, 0]
    return out


def make_case(case: str, device="cpu", dtype=torch.float32):
    lengths, width, H, Hk, D = CASES[case]
    g = torch.Generator().manual_seed(zlib.crc32(case.encode()) % 1000)  # (hash(): salted per process)
    tokens = sum(lengths) + 37
    k_cache = torch.randn(tokens, Hk, D, generator=g).to(dtype)
    v_cache = torch.randn(tokens, Hk, D, generator=g).to(dtype)
    q = torch.randn(len(lengths), H, D, generator=g).to(dtype)
    perm = torch.randperm(tokens, generator=g)  # each sequence's rows scattered over the pool
    idx = torch.zeros(len(lengths), width, dtype=torch.long)
    at = 0
    for b, n in enumerate(lengths):
        idx[b, :n] = perm[at:at + n]
        at += n
    lens = torch.tensor(lengths)
    return [t.to(device) for t in (q, k_cache, v_cache, idx, lens)], D ** -0.5


def check(case: str, device="cpu", dtype=torch.float32, tol=1e-5) -> list[str]:
    from moestream.layers import attn_decode

    (q, k, v, idx, lens), scale = make_case(case, device, dtype)
    assert attn_decode.usable(q, k, force=True)
    got = attn_decode.decode_attention(q, k, v, idx, lens, scale)
    want = reference(q.cpu(), k.cpu(), v.cpu(), idx.cpu(), lens.cpu(), scale)
    err = (got.double().cpu() - want).abs().max().item()
    return [] if err <= tol and got.dtype == q.dtype and got.shape == q.shape else [f"max error {err:.3g}"]


def _worker(out_path: str) -> None:
    write_case_results(CASES, check, out_path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return interpreted_results(__file__, tmp_path_factory)


@pytest.mark.parametrize("case", list(CASES))
def test_interpreted_matches_sdpa(interpreted, case):
    assert_case(interpreted, case)


def test_splits_cover_the_width_in_whole_blocks():
    pytest.importorskip("triton")
    from moestream.layers import attn_decode

    for width in (64, 256, 384, 32768, 49152):
        for rows in (1, 2, 8, 64):
            n, keys = attn_decode._splits(width, rows, torch.device("cpu"))
            assert keys % attn_decode.BLOCK_N == 0 and n * keys >= width and (n - 1) * keys < width
            assert 1 <= n <= attn_decode.MAX_SPLITS


def test_cpu_tensors_and_the_switch_keep_torch(monkeypatch):
    pytest.importorskip("triton")
    from moestream.layers import attn_decode

    (q, k, *_), _ = make_case("one-token")
    assert not attn_decode.usable(q, k)  # CPU tensors: the torch path
    monkeypatch.setenv("MOESTREAM_SPLIT_DECODE", "0")
    assert not attn_decode.usable(q.cuda() if torch.cuda.is_available() else q, k)


def test_a_kernel_that_cannot_run_falls_back_once_with_a_warning(monkeypatch, caplog):
    """A compiler or launch error on this GPU: None (the caller's torch path serves), one warning, and `usable`
    says no from then on; out of memory is raised as it is."""
    pytest.importorskip("triton")
    from moestream.layers import attn_decode

    (q, k, v, idx, lens), scale = make_case("one-token")
    monkeypatch.setattr(attn_decode, "_FAILED", [])
    def fails(err):
        def run(*args):
            raise err
        return run

    monkeypatch.setattr(attn_decode, "_decode_attention", fails(torch.cuda.OutOfMemoryError("x")))
    with pytest.raises(torch.cuda.OutOfMemoryError):
        attn_decode.decode_attention(q, k, v, idx, lens, scale)
    assert attn_decode.usable(q, k, force=True)
    monkeypatch.setattr(attn_decode, "_decode_attention", fails(RuntimeError("no bf16 mma")))
    with caplog.at_level("WARNING", logger="moestream.layers"):
        assert attn_decode.decode_attention(q, k, v, idx, lens, scale) is None
    assert "split-KV decode attention disabled" in caplog.text and "no bf16 mma" in caplog.text
    assert not attn_decode.usable(q, k, force=True)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("D,G", [(256, 8), (128, 4)])
def test_split_kernel_compiles_for_sm90(D, G):
    from moestream.layers import attn_decode as ad

    ptrs = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "idx_ptr": "*i64", "len_ptr": "*i64",
            "po_ptr": "*fp32", "pml_ptr": "*fp32"}
    ints = {n: "i32" for n in ("Q_SB", "Q_SH", "K_ST", "K_SH", "V_ST", "V_SH", "IDX_SB", "HK", "NSPLIT", "SPLIT_KEYS")}
    consts = {"G": G, "GP": 16, "D": D, "BLOCK": ad.BLOCK_N, "IEEE": False}
    sig = {**ptrs, **ints, "scale": "fp32", **{n: "constexpr" for n in consts}}
    k = compile_sm90(ad._split_kernel, sig, consts, {"num_warps": 8, "num_stages": 2})
    assert "mma" in k.asm["ptx"]  # the scores and P.V on tensor cores


# --------------------------------------------------------------------------- CUDA
cuda = pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")


@cuda
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_bf16_matches_sdpa(case):
    errs = check(case, "cuda", torch.bfloat16, tol=2e-2)
    assert not errs, errs


@cuda
def test_cuda_graph_replays_longer_lengths():
    from moestream.layers import attn_decode

    (q, k, v, idx, lens), scale = make_case("batch-ragged", "cuda", torch.bfloat16)
    static_len = lens.clone()
    static_len.fill_(1)
    torch.cuda.synchronize()
    attn_decode.decode_attention(q, k, v, idx, static_len, scale)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = attn_decode.decode_attention(q, k, v, idx, static_len, scale)
    static_len.copy_(lens)
    g.replay()
    want = reference(q.cpu(), k.cpu(), v.cpu(), idx.cpu(), lens.cpu(), scale)
    assert (out.double().cpu() - want).abs().max().item() < 2e-2


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    _worker(sys.argv[2])

"""moestream.moe.pairs.pair_sum: a token's k pair outputs summed in k order in float32 and rounded to the
activations' dtype, in one launch on CUDA (the Triton kernel), equal bit for bit to the same sums done left to
right in torch and rounded by torch (round to nearest even).

* Interpreter: the cases run once in a subprocess with TRITON_INTERPRET=1 (tests/triton_harness.py).
* sm_90: the kernel compiles for an H100/H200 (no GPU needed).
* CUDA (skipped without a GPU): the same cases on the device, and pair_sum taking the kernel there.

Run as a script (`python tests/test_pair_sum.py --worker OUT.json`) it is the interpreter worker.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the worker runs as a script: find moestream
sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_harness import HAS_TRITON, assert_case, compile_sm90, interpreted_results, write_case_results  # noqa: E402

# name -> (tokens, k, hidden, output dtype); hidden not a power of two: masked tails; 2,048: the Qwen3.6 row
CASES = {
    "bf16-k8": (3, 8, 300, torch.bfloat16),
    "bf16-k8-qwen36": (2, 8, 2048, torch.bfloat16),
    "fp16-k2": (4, 2, 77, torch.float16),
    "fp32-k1": (5, 1, 64, torch.float32),
    "bf16-k4-wide": (1, 4, 1500, torch.bfloat16),  # two programs a row (1,024-wide blocks)
}


def reference(y: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    v = y.view(-1, k, y.shape[-1])
    acc = v[:, 0].clone()
    for j in range(1, k):
        acc = acc + v[:, j]  # float32, left to right
    return acc.to(dtype)


def check_case(case: str, device: str = "cpu") -> list[str]:
    from moestream.moe.pairs import pair_sum

    T, k, N, dtype = CASES[case]
    g = torch.Generator().manual_seed(len(case))
    # magnitudes spread over decades, so float32 sums round and bf16 / fp16 roundings tie-break differently
    y = (torch.randn(T * k, N, generator=g) * torch.exp(3 * torch.randn(T * k, N, generator=g))).to(device)
    got = pair_sum(y, k, dtype, force=True).cpu()
    want = reference(y.cpu(), k, dtype)
    if got.dtype != dtype or got.shape != (T, N):
        return [f"got {got.dtype} {tuple(got.shape)}"]
    if not torch.equal(got.view(torch.int16) if dtype != torch.float32 else got, want.view(torch.int16)
                       if dtype != torch.float32 else want):
        bad = (got.float() != want.float()).sum().item()
        return [f"{bad} of {got.numel()} values differ"]
    return []


def _worker(out_path: str) -> None:
    write_case_results(CASES, check_case, out_path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return interpreted_results(__file__, tmp_path_factory)


@pytest.mark.parametrize("case", list(CASES))
def test_interpreted_pair_sum_bit_exact(interpreted, case):
    assert_case(interpreted, case)


def test_cpu_and_other_inputs_keep_torch(monkeypatch):
    """Off CUDA (no force), or float16 pair outputs: torch's sum, the same values as before the kernel."""
    from moestream.moe import pairs

    y = torch.randn(8, 16)
    torch.testing.assert_close(pairs.pair_sum(y, 4, torch.float32), y.view(2, 4, 16).sum(1), rtol=0, atol=0)
    y16 = y.half()
    assert pairs.pair_sum(y16, 4, torch.float32).dtype == torch.float32


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_kernel_compiles_for_sm90():
    from moestream.moe import pairs

    for bf16 in (True, False):
        consts = {"K_TOP": 8, "OUT_BF16": bf16, "BLOCK": 1024}
        sig = {"y": "*fp32", "out": "*i16" if bf16 else "*fp16", "N": "i32", **{n: "constexpr" for n in consts}}
        k = compile_sm90(pairs._pair_sum_kernel, sig, consts, {"num_warps": 4})
        assert "ld.global" in k.asm["ptx"]


cuda = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs an NVIDIA GPU and triton")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_pair_sum(case, monkeypatch):
    from moestream.moe import pairs

    calls = []
    real = pairs._pair_sum_kernel

    class Spy:
        def __getitem__(self, grid):
            calls.append(grid)
            return real[grid]

    monkeypatch.setattr(pairs, "_pair_sum_kernel", Spy())
    errs = check_case(case, "cuda")
    assert calls, "pair_sum did not launch the kernel on CUDA"
    assert not errs, f"{case}: " + "; ".join(errs)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        _worker(sys.argv[2])
    else:
        sys.exit("usage: python tests/test_pair_sum.py --worker OUT.json (run the tests with pytest)")

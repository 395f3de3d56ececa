"""layers/host_embedding.py: the token embedding kept in pinned host memory, its rows gathered by one kernel.

* Interpreter (TRITON_INTERPRET=1 in a subprocess, tests/triton_harness.py): `gather_rows` equals index_select
  exactly (a copy: no arithmetic) for bf16 / float32 / float16 tables, widths that are and are not a multiple of the
  block, repeated ids.
* CPU: the module equals nn.Embedding, stays on the host through Module.to, and the memory plan's dense bytes do
  not count it.
* CUDA (skipped without a GPU): an offload engine with the table on the host (MOESTREAM_HOST_EMBEDDING=1) gives the
  tokens of one with the table on the device, decode graphs recorded and replayed, and plans the table's bytes
  for expert slots.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_harness import assert_case, interpreted_results, write_case_results  # noqa: E402

CASES = {"bf16-64": (torch.bfloat16, 64), "f32-100": (torch.float32, 100), "f16-2048": (torch.float16, 2048),
         "bf16-1500": (torch.bfloat16, 1500)}


def _case(name: str) -> list[str]:
    from moestream.layers.host_embedding import gather_rows

    dtype, D = CASES[name]
    g = torch.Generator().manual_seed(3)
    table = torch.randn(37, D, generator=g).to(dtype)
    ids = torch.tensor([0, 36, 5, 5, 17, 0])
    got = gather_rows(table, ids)
    return [] if torch.equal(got, table.index_select(0, ids)) else [f"{name}: rows differ"]


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    write_case_results(list(CASES), _case, sys.argv[2])


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return interpreted_results(__file__, tmp_path_factory)


@pytest.mark.parametrize("case", list(CASES))
def test_interpreted_gather_equals_index_select(interpreted, case):
    assert_case(interpreted, case)


def test_module_on_a_cpu_and_the_plan():
    from moestream.engine.engine import dense_bytes_held
    from moestream.layers.host_embedding import HostEmbedding

    emb = torch.nn.Embedding(50, 24).to(torch.bfloat16)
    host = HostEmbedding(emb.weight, "cpu")
    ids = torch.tensor([[3, 49, 0], [7, 7, 1]])
    assert torch.equal(host(ids), emb(ids)) and host(ids).shape == (2, 3, 24)
    model = torch.nn.Module()
    model.embed_tokens, model.proj = host, torch.nn.Linear(24, 8, bias=False)
    model.to(torch.float32)
    assert model.embed_tokens.host.dtype == torch.bfloat16  # not a parameter or buffer: left as it is
    assert dense_bytes_held(model) == 24 * 8 * 4


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["qwen3", "qwen35"])
def test_cuda_engine_with_the_embedding_in_host_memory(arch, tiny_checkpoint, monkeypatch):
    from moestream import LLM, SamplingParams
    from moestream.layers.host_embedding import HostEmbedding

    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 100, (n,), generator=g).tolist() for n in (3, 300, 17)]
    common = dict(device="cuda", dtype="bfloat16", moe_backend="offload", moe_cache_size=5, max_running_requests=4)
    runs = {}
    for env in ("0", "1"):
        monkeypatch.setenv("MOESTREAM_HOST_EMBEDDING", env)
        llm = LLM(tiny_checkpoint(arch), **common)
        model = llm.engine.model
        assert isinstance(model.embed_tokens, HostEmbedding) == (env == "1")
        runs[env] = ([o.token_ids for o in llm.generate(prompts, sp)], llm.engine.plan.bytes.dense)
        if env == "1":
            assert model.embed_tokens.host.is_pinned() and llm.engine.graphs.replays > 20
    (want, dense_dev), (got, dense_host) = runs["0"], runs["1"]
    assert got == want
    V, H = llm.model_config.vocab_size, llm.model_config.hidden_size
    assert dense_dev - dense_host == V * H * 2


def test_gather_kernel_compiles_for_sm90_within_the_default_frame():
    """The gather compiles for an H100/H200 (a bf16 table, Qwen3.6's 2,048-value rows in two blocks) with no local
    memory past the driver's default stack frame."""
    from triton_harness import HAS_TRITON, compile_sm90, frame_bytes

    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    from moestream.layers import host_embedding, triton_ops

    sig = {"table": "*bf16", "ids": "*i64", "out": "*bf16", "D": "i32", "stride": "i32", "BLOCK": "constexpr"}
    k = compile_sm90(host_embedding._gather_rows_kernel, sig, {"BLOCK": 1024}, {"num_warps": 4})
    assert frame_bytes(k) <= triton_ops.DRIVER_STACK_LIMIT

"""layers/host_embedding.py: the token embedding kept in pinned host memory, its rows gathered by one kernel.

* Interpreter (TRITON_INTERPRET=1 in a subprocess, tests/triton_harness.py): `gather_rows` equals index_select
  exactly (a copy: no arithmetic) for bf16 / float32 / float16 tables, widths that are and are not a multiple of the
  block, repeated ids.
* CPU: the module equals nn.Embedding, stays on the host through Module.to, and the memory plan's dense bytes do
  not count it.
* Interpreter, GGUF: a compressed table's rows decoded from host memory (triton_dequant.gguf_rows_to) equal the torch
  decoder's; QuantEmbedding.to_host keeps its lookups.
* CPU: a GGUF's planned embedding bytes are its stored rows'; to_host leaves nothing for Module.to to move.
* CUDA (skipped without a GPU): an offload engine with the table on the host (MOESTREAM_HOST_EMBEDDING=1) gives the
  tokens of one with the table on the device, decode graphs recorded and replayed, and plans the table's bytes
  for expert slots; the same for a Q8_0 GGUF's compressed table.
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
GGUF_CASES = {"gguf-Q8_0": ("Q8_0", 96, torch.bfloat16), "gguf-Q4_K": ("Q4_K", 512, torch.float32),
              "gguf-Q6_K": ("Q6_K", 256, torch.bfloat16)}


def _gguf_case(name: str) -> list[str]:
    """A GGUF table's rows decoded by triton_dequant.gguf_rows_to (the host-table gather) equal the torch decoder's,
    and QuantEmbedding.to_host's lookups its lookups before the move."""
    from moestream.layers.quant_linear import QuantEmbedding
    from moestream.quant import gguf_format, triton_dequant
    from moestream.quant.synthetic import random_raw

    qtype, D, dtype = GGUF_CASES[name]
    fmt = gguf_format(qtype)
    raw = random_raw(fmt, (37, D), "cpu", seed=4).reshape(37, -1)
    ids = torch.tensor([0, 36, 5, 5, 17, 0])
    errs = []
    if not torch.equal(triton_dequant.gguf_rows_to(fmt, raw, ids, torch.float32),
                       fmt.dequantize_rows(raw, (37, D), ids, torch.float32)):
        errs.append(f"{name}: gguf_rows_to differs from the torch decoder")
    emb = QuantEmbedding(qtype, raw.clone(), 37, D, dtype)
    before = emb(ids.view(2, 3))
    emb.to_host("cpu")
    if emb.raw.numel() or not torch.equal(emb(ids.view(2, 3)), before):
        errs.append(f"{name}: to_host changed the lookups or kept raw")
    return errs


def _case(name: str) -> list[str]:
    if name in GGUF_CASES:
        return _gguf_case(name)
    from moestream.layers.host_embedding import gather_rows

    dtype, D = CASES[name]
    g = torch.Generator().manual_seed(3)
    table = torch.randn(37, D, generator=g).to(dtype)
    ids = torch.tensor([0, 36, 5, 5, 17, 0])
    got = gather_rows(table, ids)
    return [] if torch.equal(got, table.index_select(0, ids)) else [f"{name}: rows differ"]


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    write_case_results([*CASES, *GGUF_CASES], _case, sys.argv[2])


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return interpreted_results(__file__, tmp_path_factory)


@pytest.mark.parametrize("case", [*CASES, *GGUF_CASES])
def test_interpreted_gather_equals_index_select(interpreted, case):
    assert_case(interpreted, case)


def test_gguf_table_bytes_planned_and_kept_on_the_host(tmp_path, tiny_checkpoint, monkeypatch):
    """A GGUF's compressed embedding: GGUFCheckpoint.embedding_bytes is the stored rows' bytes when the GPU mode keeps
    them (the 16-bit parameter's otherwise), and QuantEmbedding.to_host leaves nothing in `raw` for Module.to to move
    (dense_bytes_held drops by those bytes) while lookups stay the same; from_host undoes it."""
    import gguf_writer
    from gguf import GGMLQuantizationType as Q

    from moestream.engine.engine import dense_bytes_held
    from moestream.layers.quant_linear import QuantEmbedding
    from moestream.models.checkpoint import open_checkpoint
    from moestream.models.qwen_moe import QwenMoeModel
    from moestream.quant import gguf_format
    from moestream.quant.synthetic import random_raw

    path, _ = gguf_writer.write_gguf(tiny_checkpoint("qwen3"), tmp_path / "m.gguf", Q.Q8_0)
    ck = open_checkpoint(path)
    cfg = ck.model_config()
    with torch.device("meta"):
        model = QwenMoeModel(cfg).to(torch.bfloat16)
    V, H = model.embed_tokens.weight.shape
    stored = V * (H // 32) * 34
    assert ck.embedding_bytes(model, cfg, "gpu") == stored
    assert ck.embedding_bytes(model, cfg, None) == V * H * 2
    raw = random_raw(gguf_format("Q8_0"), (V, H), "cpu", seed=1)
    emb = QuantEmbedding("Q8_0", raw, V, H, torch.bfloat16)
    holder = torch.nn.Module()
    holder.embed_tokens = emb
    ids = torch.tensor([1, V - 1])
    want = emb(ids)
    assert dense_bytes_held(holder) == stored
    emb.to_host("cpu")
    holder.to(torch.float32)
    assert dense_bytes_held(holder) == 0 and torch.equal(emb(ids), want)
    emb.from_host()
    assert dense_bytes_held(holder) == stored and torch.equal(emb(ids), want)


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


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_gguf_engine_with_the_compressed_table_in_host_memory(tmp_path, tiny_checkpoint, monkeypatch):
    """A Q8_0 GGUF whose dense layers stay compressed, offload: with MOESTREAM_HOST_EMBEDDING=1 the compressed table is
    in pinned host memory (QuantEmbedding.host), the tokens are those of the table on the device, under recorded
    decode graphs, and the plan's dense bytes drop by the stored rows' bytes."""
    import gguf_writer
    from gguf import GGMLQuantizationType as Q

    from moestream import LLM, SamplingParams
    from moestream.layers.quant_linear import QuantEmbedding

    monkeypatch.setenv("MOESTREAM_DENSE_QUANT", "1")
    path, _ = gguf_writer.write_gguf(tiny_checkpoint("qwen35_causal"), tmp_path / "m.gguf", Q.Q8_0)
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [[4, 8, 15], list(range(30, 90))]
    runs = {}
    for env in ("0", "1"):
        monkeypatch.setenv("MOESTREAM_HOST_EMBEDDING", env)
        llm = LLM(path, device="cuda", dtype="bfloat16", moe_backend="offload", moe_cache_size=5)
        emb = llm.engine.model.embed_tokens
        assert isinstance(emb, QuantEmbedding) and (emb.host is not None) == (env == "1")
        if env == "1":
            assert emb.host.is_pinned() and emb.raw.numel() == 0
        runs[env] = ([o.token_ids for o in llm.generate(prompts, sp)], llm.engine.plan.bytes.dense)
        if env == "1":
            assert llm.engine.graphs.replays > 10
    (want, dense_dev), (got, dense_host) = runs["0"], runs["1"]
    assert got == want
    V, H = llm.model_config.vocab_size, llm.model_config.hidden_size
    assert dense_dev - dense_host == V * (H // 32) * 34


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

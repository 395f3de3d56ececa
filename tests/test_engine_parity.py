"""Our model against HF transformers (the oracle), in fp32 on CPU, for both architectures."""
from __future__ import annotations

import pytest
import torch

import tiny_models
from moestream import LLM, SamplingParams
from moestream.scheduler.request import Request

VARIANTS = ["qwen3", "qwen35", "qwen35_causal"]


def full_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Our logits at every position of one prompt, computed in one prefill pass."""
    sch = llm.scheduler
    req = Request("logits", list(ids), SamplingParams(max_tokens=1))
    llm.llm_engine.add_request(req)
    prefix, sch.prefix = sch.prefix, None  # no reuse and no prefill stop at a snapshot boundary: one pass
    try:
        batch, _ = llm.llm_engine.runner.build(sch.schedule())
        batch.logits_index = torch.arange(len(ids))
        out = llm.engine.forward(batch)
        sch.abort(req.id)
    finally:
        sch.prefix = prefix
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers(variant, tiny_checkpoint, hf_model):
    llm = LLM(tiny_checkpoint(variant), device="cpu", dtype="float32")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, llm.model_config.vocab_size, (48,), generator=g).tolist()
    ours = full_logits(llm, ids)
    ref = tiny_models.hf_logits(hf_model(variant), ids)
    assert ours.shape == ref.shape
    rel = (ours - ref).norm() / ref.norm()
    assert rel < 1e-4, rel
    # and element-wise, relative to the logit scale
    assert (ours - ref).abs().max() < 1e-4 * ref.abs().max() * 10


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("chunk", [2048, 7])
def test_batched_greedy_matches_transformers(variant, chunk, tiny_checkpoint, hf_model):
    """3 prompts of different lengths in one batch (and with 7-token prefill chunks, which mixes
    prefill chunks and decode steps in one forward pass) give HF's greedy tokens for each."""
    llm = LLM(tiny_checkpoint(variant), device="cpu", dtype="float32", chunked_prefill_size=chunk)
    g = torch.Generator().manual_seed(2)
    V = llm.model_config.vocab_size
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 19, 33)]
    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, sp)
    ref = hf_model(variant)
    for p, o in zip(prompts, outs):
        assert o.token_ids == tiny_models.hf_greedy(ref, p, 32)
        assert o.finish_reason == "length"


def test_batched_equals_alone(tiny_checkpoint):
    path = tiny_checkpoint("qwen35")
    llm = LLM(path, device="cpu", dtype="float32", max_running_requests=4)
    prompts = ["The quick brown fox", "Hello", "Numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11", "é 中文"]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompts, sp)]
    alone = [llm.generate([p], sp)[0].token_ids for p in prompts]
    assert together == alone
    llm.scheduler.check_integrity()
    # everything freed after the requests ended, but for the prefix cache's unreferenced pages
    tree = llm.scheduler.prefix
    assert llm.engine.caches.kv.pages.num_used == tree.num_pages == tree.num_evictable


def test_preemption_when_kv_full_keeps_tokens(tiny_checkpoint):
    """A KV pool too small for all requests at once: requests are preempted and recomputed, and
    the tokens are still exactly the unconstrained ones."""
    path = tiny_checkpoint("qwen35")
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[10 + i] * 20 for i in range(4)]
    big = LLM(path, device="cpu", dtype="float32")
    want = [o.token_ids for o in big.generate(prompts, sp)]
    small = LLM(path, device="cpu", dtype="float32", num_tokens=96, page_size=8)
    got = small.generate(prompts, sp)
    assert [o.token_ids for o in got] == want
    small.scheduler.check_integrity()
    assert small.engine.caches.kv.pages.num_used == small.scheduler.prefix.num_evictable


@pytest.mark.parametrize("variant", ["qwen3", "qwen35"])
def test_bf16_matches_transformers_bf16(variant, tiny_checkpoint):
    """bf16 on CPU against HF in bf16. These random tiny models amplify bf16 rounding (HF's own bf16
    run is 4-24% away from its fp32 run), so bf16 is compared with bf16: measured 0.4-1.5%."""
    path = tiny_checkpoint(variant)
    llm = LLM(path, device="cpu", dtype="bfloat16")
    ids = list(range(3, 40))
    ours = full_logits(llm, ids)
    ref = tiny_models.hf_logits(tiny_models.hf_reference(path, dtype=torch.bfloat16), ids)
    assert (ours - ref).norm() / ref.norm() < 3e-2

"""Live cache rebuild (LLMEngine.resize_caches): the KV pool and the expert slot cache change size between
steps while requests run; their pages and Gated DeltaNet states survive, the prefix cache stays consistent,
and a size that cannot fit is refused with nothing changed. The server route and `moestream ctl` are tested
end to end in tests/e2e/test_server_ctl.py."""
from __future__ import annotations

import pytest
import torch

from moestream import LLM, SamplingParams
from moestream.core import ConfigError, RequestError
from moestream.scheduler.request import Request

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# qwen35: three Gated DeltaNet layers and one attention layer; offload: an expert slot cache to resize
OPTS = dict(device="cpu", dtype="float32", moe_backend="offload", moe_cache_size=12, max_running_requests=4,
            chunked_prefill_size=32, page_size=16, moe_cpu_threads=1)
MAX_TOKENS = 40
SP = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def prompts(vocab: int, seed: int, n: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(k),), generator=g).tolist() for k in (21, 9, 30, 14)[:n]]


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen35")


@pytest.fixture(scope="module")
def reference(model_dir):
    cache = {}

    def get(device: str = "cpu"):
        if device not in cache:
            llm = LLM(model_dir, num_tokens=2048, **{**OPTS, "device": device})
            ps = prompts(llm.model_config.vocab_size, seed=1)
            cache[device] = ps, [o.token_ids for o in llm.generate(ps, SP)]
        return cache[device]

    return get


def start(llm, ps) -> list[Request]:
    reqs = [Request(f"live-{i}", p, SP) for i, p in enumerate(ps)]
    for r in reqs:
        llm.llm_engine.add_request(r)
    return reqs


def step_until(llm, cond) -> None:
    while not cond():
        llm.llm_engine.step()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_rebuild_mid_flight_keeps_every_token(model_dir, reference, device):
    """On CUDA: the decode steps replay recorded graphs, which the rebuild drops with the old pools."""
    ps, want = reference(device)
    llm = LLM(model_dir, num_tokens=2048, **{**OPTS, "device": device})
    sched = llm.scheduler
    # other conversations first: their pages stay in the prefix cache at the low page ids
    llm.generate(prompts(llm.model_config.vocab_size, seed=2), SP)
    cached = sched.prefix.num_pages
    assert cached > 0
    reqs = start(llm, ps)
    step_until(llm, lambda: all(len(r.output_ids) >= 8 for r in reqs))
    assert len(sched.running) == 4
    at_end = sum(sched.kv.pages_for(len(p) + MAX_TOKENS) for p in ps)
    top = max(p for r in reqs for p in r.pages)
    assert top >= at_end  # so the shrink below must move pages of running requests
    state_before = sched.state.rec.clone()
    rep = llm.llm_engine.resize_caches(kv_tokens=at_end * 16, moe_slots=5)
    assert rep["kv_tokens"] == {"before": 2048, "after": at_end * 16}
    assert rep["moe_slots"] == {"before": 12, "after": 5} and rep["running"] == 4
    assert rep["moved_pages"] > 0 and rep["evicted_prefix_pages"] > 0 and rep["rebuild_s"] > 0
    assert torch.equal(sched.state.rec, state_before)  # linear states stay in their slots
    assert sched.kv.num_pages == at_end and sched.kv.k.shape[1] == at_end * 16
    assert llm.engine.plan.cache_slots == 5 and llm.engine.plan.kv_tokens == at_end * 16
    assert llm.engine.runtime.stats()["cache"]["slots"] == 5  # the runtime was rebuilt with the new cache
    assert all(p < at_end for r in reqs for p in r.pages)
    sched.check_integrity()
    step_until(llm, lambda: all(len(r.output_ids) >= 20 for r in reqs))
    # grow again, expert slots back to what fits
    rep = llm.llm_engine.resize_caches(kv_tokens=4000, moe_slots="auto")
    assert rep["kv_tokens"]["after"] == 4000 and rep["moe_slots"]["after"] == rep["total_experts"]
    sched.check_integrity()
    step_until(llm, lambda: all(r.finish_reason is not None for r in reqs))
    assert [r.output_ids for r in reqs] == want
    sched.check_integrity()
    assert sched.kv.pages.num_used == sched.prefix.num_pages  # only cached pages are left


def test_rebuild_without_prefix_cache_and_only_one_size(model_dir, reference):
    ps, want = reference()
    llm = LLM(model_dir, num_tokens=2048, prefix_cache=False, **OPTS)
    reqs = start(llm, ps)
    step_until(llm, lambda: all(len(r.output_ids) >= 5 for r in reqs))
    rep = llm.llm_engine.resize_caches(moe_slots=3)  # KV as it is
    assert rep["kv_tokens"] == {"before": 2048, "after": 2048} and rep["moved_pages"] == 0
    rep = llm.llm_engine.resize_caches(kv_tokens=700)  # expert slots as they are; rounded up to whole pages
    assert rep["kv_tokens"]["after"] == 704 and rep["moe_slots"] == {"before": 3, "after": 3}
    step_until(llm, lambda: all(r.finish_reason is not None for r in reqs))
    assert [r.output_ids for r in reqs] == want
    llm.scheduler.check_integrity()


def _snapshot(llm):
    e, s = llm.engine, llm.scheduler
    return (e.plan, e.ecfg, e.runtime, s.kv.k, s.kv.num_pages, s.kv.pages.used_ids(), s.prefix.num_pages,
            [list(r.pages) for r in s.running])


def test_refusals_change_nothing(model_dir):
    # a 0.5 GiB budget (on a CPU --gpu-memory-gb caps host memory the same way)
    llm = LLM(model_dir, num_tokens=1024, gpu_memory_gb=0.5, **OPTS)
    reqs = start(llm, prompts(llm.model_config.vocab_size, seed=1))
    step_until(llm, lambda: all(len(r.output_ids) >= 3 for r in reqs))
    held = llm.scheduler.kv.pages.num_used * 16
    assert held < 128
    llm.llm_engine.add_request(Request("queued", list(range(5, 205)), SP))  # 4 run: this one waits, with 200 tokens
    before = _snapshot(llm)
    sched = llm.scheduler
    with pytest.raises(ConfigError, match="budget"):  # ~1 TB of KV
        llm.llm_engine.resize_caches(kv_tokens=10 ** 9)
    with pytest.raises(ConfigError, match=f"requests in flight hold {held} tokens"):
        llm.llm_engine.resize_caches(kv_tokens=held - 16)
    with pytest.raises(ConfigError, match="a request in flight needs 201 tokens"):
        llm.llm_engine.resize_caches(kv_tokens=128)  # the running ones fit, the queued one never would
    with pytest.raises(RequestError, match="32 routed experts"):
        llm.llm_engine.resize_caches(moe_slots=33)
    with pytest.raises(RequestError, match="positive integer"):
        llm.llm_engine.resize_caches(kv_tokens=0)
    with pytest.raises(ConfigError, match="top-k"):
        llm.llm_engine.resize_caches(moe_slots=1)  # a decode step needs a layer's top-k on the device
    assert _snapshot(llm) == before
    sched.check_integrity()
    fused = LLM(model_dir, num_tokens=1024, **{**OPTS, "moe_backend": "fused", "moe_cache_size": None})
    with pytest.raises(RequestError, match="no expert slot cache"):
        fused.llm_engine.resize_caches(kv_tokens=512, moe_slots=4)
    assert fused.llm_engine.resize_caches(kv_tokens=512, moe_slots="auto")["moe_slots"]["after"] == 0


def test_kv_pool_resize_moves_pages_a_few_at_a_time(monkeypatch):
    from moestream.kvcache import KVPool

    monkeypatch.setattr(KVPool, "RESIZE_CHUNK", 2)
    pool = KVPool(2, 10, 4, 2, 3, torch.float32, torch.device("cpu"))
    pool.k.normal_()
    pool.v.normal_()
    pool.pages.alloc(10)
    pool.pages.free([1, 3, 4, 6, 8])
    k, v = pool.k.clone(), pool.v.clone()
    keep = {0: 0, 2: 2, 5: 1, 7: 3, 9: 4}
    pool.resize(6, keep)
    assert pool.num_pages == 6 and pool.k.shape == (2, 24, 2, 3)
    for old, new in keep.items():
        assert torch.equal(pool.k[:, new * 4:(new + 1) * 4], k[:, old * 4:(old + 1) * 4])
        assert torch.equal(pool.v[:, new * 4:(new + 1) * 4], v[:, old * 4:(old + 1) * 4])
    assert not pool.k[:, 20:].any()
    assert pool.pages.used_ids() == [0, 1, 2, 3, 4] and pool.pages.alloc(1) == [5] and pool.pages.alloc(1) is None
    pool.pages.check_integrity()

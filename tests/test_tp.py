"""Tensor parallelism on CPU (gloo): TP=2 gives TP=1's greedy tokens on both tiny architectures for
every expert backend, ranks are pinned to disjoint cores, invalid sizes are ConfigErrors before any
process starts, experts are sliced exactly (dense and compressed), and the processes end together."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from test_engine_parity import full_logits
from moestream import LLM, SamplingParams
from moestream.config import EngineConfig
from moestream.core import ConfigError, MoestreamError
from moestream.engine.engine import Engine
from moestream.models.loader import load_model_config
from moestream.moe.formats import dense_format, gguf_expert_format, hf_expert_format
from moestream.moe.store import ExpertStore
from moestream.parallel import TPWorkers
from moestream.parallel.cores import split_cores
from moestream.parallel.experts import ShardedExpertStore, check_expert_split
from moestream.quant import FP8_BLOCK, NVFP4

SP = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
COMMON = dict(device="cpu", dtype="float32", chunked_prefill_size=7, max_running_requests=4, moe_cpu_threads=1)
BACKENDS = [
    ("fused", {}),
    ("offload", {"moe_cache_size": 3, "moe_prefetch": "on"}),
    ("cpu", {}),
    ("hybrid", {"moe_cache_size": 3, "moe_prefetch": "on"}),
]
two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPU cores (one per rank)")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def prompts(vocab):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (4, 17, 30)]


def tokens(llm):
    return [o.token_ids for o in llm.generate(prompts(llm.model_config.vocab_size), SP)]


@two_cores
class TestTwoRanks:
    """One spawned worker for the class (this process is rank 0); engines are built on it in turn."""

    @pytest.fixture(scope="class")
    def workers(self):
        before = os.sched_getaffinity(0)
        w = TPWorkers(2, "cpu")
        yield w, before
        w.close()
        assert os.sched_getaffinity(0) == before  # rank 0 unpinned again
        assert not any(p.is_alive() for p in w.procs)

    @pytest.mark.parametrize("arch", ["qwen3", "qwen35"])
    def test_tp2_tokens_equal_tp1_every_backend(self, arch, workers, tiny_checkpoint):
        path = tiny_checkpoint(arch)
        ref = LLM(path, moe_backend="fused", **COMMON)
        want = tokens(ref)
        ids = prompts(ref.model_config.vocab_size)[2][:7]  # one prefill chunk
        cfg = ref.model_config
        for backend, kw in BACKENDS:
            with LLM(path, tp_size=2, tp_workers=workers[0], moe_backend=backend, **COMMON, **kw) as llm:
                assert tokens(llm) == want, backend
                st = llm.stats()
                t = st["total"]
                assert st["backend"] == backend and st["tp_size"] == 2
                assert t["gpu_experts"] + t["cpu_experts"] == t["expert_calls"] > 0
                eng = llm.engine
                # this rank holds half the kv heads and half of every expert
                assert eng.caches.kv.k.shape[2] == cfg.num_kv_heads // 2
                assert eng.runtime.store.inter == cfg.moe_intermediate_size // 2
                if backend == "fused":
                    ours, theirs = full_logits(llm, ids), full_logits(ref, ids)
                    assert ours.shape == theirs.shape == (len(ids), cfg.vocab_size)
                    assert (ours - theirs).norm() / theirs.norm() < 1e-5
                    if cfg.linear_attention_layers:
                        assert eng.caches.state.rec.shape[2] == cfg.linear_num_value_heads // 2

    def test_ranks_on_disjoint_cores(self, workers):
        w, before = workers
        infos = w.ranks()
        assert [i["rank"] for i in infos] == [0, 1] and infos[0]["pid"] == os.getpid() != infos[1]["pid"]
        sets = [set(i["cpus"]) for i in infos]
        assert not sets[0] & sets[1] and sets[0] | sets[1] <= before and all(sets)
        assert [i["threads"] for i in infos] == [c.threads for c in w.cores] == [len(before) // 2] * 2

    def test_one_group_per_process(self, workers):
        with pytest.raises(ConfigError, match="already"):
            TPWorkers(2, "cpu")

    def test_live_cache_rebuild_on_every_rank(self, workers, tiny_checkpoint):
        """LLMEngine.resize_caches mid-flight: every rank plans, agrees and resizes with rank 0's page map; the
        tokens are tp1's without a rebuild. A refusal on the ranks changes nothing."""
        from moestream.scheduler.request import Request

        path, kw = tiny_checkpoint("qwen35"), dict(COMMON, moe_backend="offload", moe_cache_size=6, num_tokens=1024)
        ref = LLM(path, **kw)
        ps = prompts(ref.model_config.vocab_size)
        sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        want = [o.token_ids for o in ref.generate(ps, sp)]
        with LLM(path, tp_size=2, tp_workers=workers[0], **kw) as llm:
            llm.generate([list(range(50, 50 + n)) for n in (20, 30, 40)], sp)  # their pages: the low ids, cached
            reqs = [Request(f"r{i}", p, sp) for i, p in enumerate(ps)]
            for r in reqs:
                llm.llm_engine.add_request(r)
            while not all(len(r.output_ids) >= 4 for r in reqs):
                llm.llm_engine.step()
            plan, k = llm.engine.plan, llm.engine.caches.kv.k
            with pytest.raises(ConfigError, match="budget"):
                llm.llm_engine.resize_caches(kv_tokens=10 ** 9)
            assert llm.engine.plan is plan and llm.engine.caches.kv.k is k
            at_end = sum(llm.scheduler.kv.pages_for(len(p) + 24) for p in ps)
            assert max(p for r in reqs for p in r.pages) >= at_end
            rep = llm.llm_engine.resize_caches(kv_tokens=at_end * 16, moe_slots=3)
            assert rep["moved_pages"] > 0 and rep["moe_slots"]["after"] == 3
            assert llm.engine.caches.kv.num_pages == at_end and llm.engine.runtime.stats()["cache"]["slots"] == 3
            while not all(r.finish_reason is not None for r in reqs):
                llm.llm_engine.step()
            assert [r.output_ids for r in reqs] == want

    def test_a_dead_worker_ends_the_group(self, workers, tiny_checkpoint):
        """Last in the class: the group is gone after it (the fixture's teardown checks the clean-up)."""
        w, _ = workers
        llm = LLM(tiny_checkpoint("qwen35"), tp_size=2, tp_workers=w, **COMMON)
        pid = w.procs[0].pid
        os.kill(pid, signal.SIGKILL)
        assert _wait_gone([pid])
        deadline = time.time() + 10
        while not w.broken and time.time() < deadline:
            time.sleep(0.05)
        with pytest.raises(MoestreamError, match="rank 1 exited"):
            llm.generate([[1, 2, 3]], SP)
        llm.close()


def test_split_cores_keeps_siblings_together():
    smt = [(0, 4), (1, 5), (2, 6), (3, 7)]  # 4 physical cores, 2 threads each
    assert [(c.cpus, c.threads) for c in split_cores(smt, 2)] == [((0, 1, 4, 5), 2), ((2, 3, 6, 7), 2)]
    # equal shares; the leftover core goes to rank 0
    assert [(c.cpus, c.threads) for c in split_cores([(0,), (1,), (2,)], 2)] == [((0, 2), 1), ((1,), 1)]
    # fewer physical cores than ranks: logical CPUs are split
    assert [c.cpus for c in split_cores([(0, 2), (1, 3)], 4)] == [(0,), (1,), (2,), (3,)]
    with pytest.raises(ConfigError, match="at least 3 CPU cores"):
        split_cores([(0,), (1,)], 3)


# ---- invalid sizes ----------------------------------------------------------------------------
def test_invalid_tp_is_a_config_error(tiny_checkpoint):
    import multiprocessing

    path = tiny_checkpoint("qwen3")  # 4 heads, 2 kv heads
    with pytest.raises(ConfigError, match="num_key_value_heads 2"):
        LLM(path, tp_size=4, **COMMON)
    with pytest.raises(ConfigError, match="CPU cores"):
        TPWorkers(len(os.sched_getaffinity(0)) + 1, "cpu")
    with pytest.raises(ConfigError, match="tp_workers needs tp_size > 1"):
        LLM(path, tp_workers=object(), **COMMON)
    with pytest.raises(ConfigError, match="one process per rank"):
        Engine(path, load_model_config(path), EngineConfig(device="cpu", tp_size=2))
    assert not multiprocessing.active_children()  # nothing was spawned


def test_compressed_experts_split_only_between_blocks():
    q4k = gguf_expert_format({"gate": "Q4_K", "up": "Q4_K", "down": "Q4_K"}, 256, 768)
    check_expert_split(q4k, 512, 2)  # 256 per rank: whole Q4_K blocks
    with pytest.raises(ConfigError, match="384, not a multiple of the 256-wide blocks"):
        check_expert_split(q4k, 768, 2)
    fp8 = _hf_format(FP8_BLOCK, 128, 256)
    check_expert_split(fp8, 256, 2)
    with pytest.raises(ConfigError, match="multiple of the 128-wide blocks"):
        check_expert_split(fp8, 256, 4)
    check_expert_split(dense_format(torch.bfloat16), 30, 2)  # dense: any split


# ---- expert slicing ---------------------------------------------------------------------------
def _hf_format(qfmt, H, I):
    dtypes = {f"{p}.{s.name}": s.dtype for p in ("gate", "up", "down") for s in qfmt.parts}
    return hf_expert_format(qfmt, dtypes, H, I)


def test_dense_expert_shards_sum_to_the_full_expert():
    """Per-expert and stacked tensors; sum over ranks of the sliced SwiGLU == the full one (float64)."""
    E, H, I = 3, 8, 6
    g = torch.Generator().manual_seed(0)
    gate, up, down = (torch.randn(E, *s, generator=g, dtype=torch.float64) for s in ((I, H), (I, H), (H, I)))
    x = torch.randn(5, H, generator=g, dtype=torch.float64)
    fmt = dense_format(torch.float64)
    for stacked in (False, True):
        total = torch.zeros(E, 5, H, dtype=torch.float64)
        for r in range(2):
            s = ShardedExpertStore([0], E, H, I, fmt, "cpu", r, 2)
            if stacked:
                s.put_stacked(0, "gate_up", torch.cat([gate, up], dim=1), "gate_up")
                s.put_stacked(0, "down", down, "down")
            else:
                for e in range(E):
                    for name, t in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
                        s.put_expert(0, e, name, t[e], name)
            assert not s.missing(lambda layer: "")
            gu, d = s.weights(0)
            assert gu.shape == (E, 2 * I // 2, H) and d.shape == (E, H, I // 2)
            total += torch.stack([fmt.expert_mlp(x, {"gate_up": gu[e], "down": d[e]}) for e in range(E)])
        full = torch.stack([fmt.expert_mlp(x, {"gate_up": torch.cat([gate[e], up[e]]), "down": down[e]})
                            for e in range(E)])
        torch.testing.assert_close(total, full, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fmt", [
    gguf_expert_format({"gate": "Q8_0", "up": "Q4_0", "down": "Q8_0"}, 64, 64),
    _hf_format(NVFP4, 64, 64),
    _hf_format(FP8_BLOCK, 128, 256),
], ids=lambda f: f.name)
@pytest.mark.parametrize("per_expert", [False, True])
def test_compressed_expert_rows_sliced_between_blocks(fmt, per_expert):
    """Each rank's compressed rows dequantize to exactly its rows of gate/up and columns of down; the ranks' banks
    together hold the experts once (issue 17: host RAM at tensor parallelism is the banks' size, not n copies), up to
    the values every rank keeps whole (NVFP4's per-tensor global scale)."""
    E, H, I = 2, fmt.hidden, fmt.inter
    g = torch.Generator().manual_seed(1)
    raw = {a: torch.randint(0, 256, (E, n), generator=g, dtype=torch.uint8) for a, (n,) in fmt.shapes(H, I).items()}

    def fill(store):
        for a, t in raw.items():
            if per_expert:
                for e in range(E):
                    store.put_raw(0, a, t[e], a, expert=e)
            else:
                store.put_raw(0, a, t, a)
        return store.weights(0, torch.float32)

    def held(store):
        return sum(a.numel() * a.element_size() for a in store.bank(0).values())

    full = ExpertStore([0], E, H, I, fmt, "cpu")
    full_gu, full_d = fill(full)
    half = I // 2
    ranks = 0
    for r in range(2):
        store = ShardedExpertStore([0], E, H, I, fmt, "cpu", r, 2)
        gu, d = fill(store)
        ranks += held(store)
        rows = torch.cat([torch.arange(r * half, (r + 1) * half), I + torch.arange(r * half, (r + 1) * half)])
        torch.testing.assert_close(gu, full_gu[:, rows], rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(d, full_d[:, :, r * half:(r + 1) * half], rtol=0, atol=0, equal_nan=True)
    replicated = 3 * E * 4 if "nvfp4" in fmt.name else 0  # one float32 global scale per matrix, on both ranks
    assert ranks == held(full) + replicated, (ranks, held(full))


# ---- processes end together -------------------------------------------------------------------
def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _wait_gone(pids, timeout=15.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if all(_gone(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"resource_tracker" not in cmd:
                out.append(int(d.name))
    return out


@two_cores
def test_serve_tp2_answers_like_tp1_and_sigterm_ends_every_rank(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("qwen35")
    want = LLM(path, **COMMON).generate(["Hello there"], SamplingParams(max_tokens=8, temperature=0))[0].text
    port = _free_port()
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "moestream.cli", "serve", "--model-path", str(path), "--port",
                             str(port), "--device", "cpu", "--dtype", "float32", "--tp-size", "2"],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None and time.time() < deadline, _read(log)
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        r = httpx.post(url + "/v1/completions", json={"model": path.name, "prompt": "Hello there", "max_tokens": 8,
                                                      "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        engine = _children(proc.pid)
        assert len(engine) == 1, engine
        worker = _children(engine[0])
        assert len(worker) == 1, worker
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert _wait_gone(engine + worker), _read(log)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


def _read(log) -> str:
    log.seek(0)
    return log.read()[-3000:]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

"""Multi-token prediction (issue 22): the MTP block of Qwen3.5/3.6 checkpoints, from HF safetensors and from
GGUF files laid out as llama.cpp's converter writes them, and speculative decoding with it."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from moestream import LLM, SamplingParams
from moestream.core import ConfigError

SP = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
COMMON = dict(device="cpu", dtype="float32", chunked_prefill_size=7, max_running_requests=4, moe_cpu_threads=1)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def prompts(vocab, sizes=(4, 17, 30, 9)):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in sizes]


def tokens(llm, ps, sp=SP):
    return [o.token_ids for o in llm.generate(ps, sp)]


@pytest.fixture(scope="module")
def mtp_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen35_mtp")


@pytest.fixture(scope="module")
def mtp_gguf(tiny_checkpoint, tmp_path_factory):
    import gguf_writer
    from gguf import GGMLQuantizationType as Q

    path, _ = gguf_writer.write_gguf(tiny_checkpoint("qwen35_mtp", layout="causal"),
                                     tmp_path_factory.mktemp("mtp_gguf") / "m.gguf", Q.Q8_0)
    return path


@pytest.fixture(scope="module")
def plain_tokens(tiny_checkpoint):
    """Greedy tokens of the same model without its MTP block (the checkpoint the block was added to)."""
    llm = LLM(tiny_checkpoint("qwen35"), moe_backend="fused", **COMMON)
    ps = prompts(llm.model_config.vocab_size)
    return ps, tokens(llm, ps)


# ---- loading ---------------------------------------------------------------------------------------
def test_hf_checkpoint_with_mtp_loads_without_it_by_default(mtp_dir, plain_tokens):
    llm = LLM(mtp_dir, moe_backend="fused", **COMMON)
    assert llm.model_config.mtp_num_layers == 1
    assert llm.engine.model.mtp is None  # --speculative none: the block is not read, no memory spent
    assert not any(n.startswith("mtp.") for n, _ in llm.engine.model.named_parameters())
    assert llm.engine.runtime.store.moe_layers == [0, 1, 2, 3]
    assert llm.engine.caches.kv.k.shape[0] == 1  # one full-attention layer
    ps, want = plain_tokens
    assert tokens(llm, ps) == want


def test_hf_mtp_block_loads_with_speculative_mtp(mtp_dir):
    from safetensors import safe_open

    llm = LLM(mtp_dir, moe_backend="fused", speculative="mtp", **COMMON)
    model = llm.engine.model
    assert model.mtp is not None and len(model.mtp.layers) == 1
    assert llm.engine.runtime.store.moe_layers == [0, 1, 2, 3, 4]  # the MTP layer's experts: layer id 4
    assert llm.engine.caches.kv.k.shape[0] == 2  # its K/V after the main model's full-attention layer
    files = sorted(mtp_dir.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                if k.startswith("mtp.") and ".experts." not in k:
                    got = dict(model.named_parameters())[k]
                    assert torch.equal(got, sf.get_tensor(k).to(got.dtype)), k
    fc = dict(model.named_parameters())["mtp.fc.weight"]
    assert fc.shape == (64, 128)


def test_speculative_mtp_needs_a_block(tiny_checkpoint):
    with pytest.raises(ConfigError, match="multi-token-prediction block"):
        LLM(tiny_checkpoint("qwen35"), speculative="mtp", **COMMON)
    with pytest.raises(ConfigError, match="--speculative must be none or mtp"):
        LLM(tiny_checkpoint("qwen35"), speculative="eagle", **COMMON)
    with pytest.raises(ConfigError, match="--num-speculative-tokens"):
        LLM(tiny_checkpoint("qwen35"), speculative="mtp", num_speculative_tokens=0, **COMMON)


def test_gguf_with_nextn_block_loads(mtp_gguf, tiny_checkpoint, monkeypatch):
    """A GGUF whose block_count counts the MTP block (blk.4.nextn.*): loads as the 4-layer model, and with
    --speculative mtp its block holds the HF block's weights (Q8_0 rounding aside) and greedy tokens are the
    same. The CPU int8-activation kernels are off: with them a prompt's tokens depend on which requests share
    its decode steps even without speculation (mixed steps compute in float), as on this tiny model."""
    from moestream.models.gguf_loader import open_gguf

    monkeypatch.setenv("MOESTREAM_CPU_KERNELS", "0")

    ck = open_gguf(mtp_gguf)
    assert any(t.name == "blk.4.nextn.eh_proj.weight" for t in ck.reader.tensors)
    llm = LLM(mtp_gguf, moe_backend="fused", **COMMON)
    cfg = llm.model_config
    assert (cfg.num_layers, cfg.mtp_num_layers) == (4, 1)
    assert llm.engine.model.mtp is None
    ps = prompts(cfg.vocab_size)
    want = tokens(llm, ps)
    spec = LLM(mtp_gguf, moe_backend="fused", speculative="mtp", **COMMON)
    hf = LLM(tiny_checkpoint("qwen35_mtp", layout="causal"), moe_backend="fused", speculative="mtp", **COMMON)
    a, b = dict(spec.engine.model.named_parameters()), dict(hf.engine.model.named_parameters())
    for k in b:
        if k.startswith("mtp."):
            tol = 1e-6 if "norm" in k else 0.02  # norms are F32 (stored as 1 + w), matrices Q8_0
            assert torch.allclose(a[k], b[k], atol=tol), k
    ga, gb = spec.engine.runtime.store, hf.engine.runtime.store
    assert ga.moe_layers == gb.moe_layers == [0, 1, 2, 3, 4]
    assert tokens(spec, ps) == want


# ---- speculative decoding -----------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_tokens_equal_without_speculation(mtp_dir, plain_tokens, k):
    ps, want = plain_tokens
    llm = LLM(mtp_dir, moe_backend="fused", speculative="mtp", num_speculative_tokens=k, **COMMON)
    assert tokens(llm, ps) == want  # batch 4
    assert [tokens(llm, [p])[0] for p in ps[:2]] == want[:2]  # batch 1
    st = llm.stats()["speculative"]
    assert st["verify_steps"] > 0 and st["drafted"] > 0
    assert len(st["drafted_per_position"]) == k
    llm.scheduler.check_integrity()


BACKENDS = [("offload", {"moe_cache_size": 3}), ("offload", {"moe_cache_size": 3, "moe_decode_kernel": "pairs"}),
            ("cpu", {}), ("hybrid", {"moe_cache_size": 3}), ("fused", {"moe_decode_kernel": "pairs"})]


@pytest.mark.parametrize("backend,kw", BACKENDS)
def test_every_backend_gives_the_same_greedy_tokens(mtp_dir, plain_tokens, backend, kw):
    ps, want = plain_tokens
    llm = LLM(mtp_dir, moe_backend=backend, speculative="mtp", num_speculative_tokens=2, **COMMON, **kw)
    assert tokens(llm, ps) == want  # batch 4
    assert tokens(llm, [ps[1]]) == [want[1]]  # batch 1
    assert llm.stats()["speculative"]["drafted"] > 0
    llm.scheduler.check_integrity()


def script_drafter(llm, seqs, wrong_from: int | None = None):
    """Make the MTP block's drafts scripted: at position j with input token x[j+1] it proposes x[j+2] of the
    known greedy continuation (a drafter that agrees with the model); from draft step `wrong_from` on it
    proposes a different token. The block still runs (its K/V, its experts): only its logits are replaced."""
    table = {}
    for s in seqs:
        for j in range(len(s) - 2):
            assert table.setdefault((j, s[j + 1]), s[j + 2]) == s[j + 2]  # no ambiguity between prompts
    real, V = llm.engine.draft, llm.model_config.vocab_size

    def draft(batch, hidden, step=0):
        logits = real(batch, hidden, step)
        pos, ids = batch.positions.tolist(), batch.input_ids.tolist()
        out = torch.full_like(logits, -1e4)
        for i, r in enumerate(batch.logits_index.tolist()):
            nxt = table.get((pos[r], ids[r]), 0)
            out[i, (nxt + 1) % V if wrong_from is not None and step >= wrong_from else nxt] = 0.0
        return out

    llm.engine.draft = draft


def expected_counters(max_tokens: int, k: int, right: int) -> tuple[list[int], list[int], int]:
    """Per-position drafted / accepted counts and verify steps of one request whose drafter is right for
    its first `right` drafts of every step (trimmed to what max_tokens leaves)."""
    drafted, accepted, steps, emitted, out = [0] * k, [0] * k, 0, 0, 1
    while out < max_tokens:
        n = min(k, max_tokens - out - 1)
        a = min(n, right)
        if n:  # with no room for a draft the step is a plain decode step
            steps += 1
            emitted += a + 1
        for i in range(n):
            drafted[i] += 1
            accepted[i] += i < a
        out += a + 1
    return drafted, accepted, steps, emitted


@pytest.mark.parametrize("k,right", [(3, 3), (2, 1), (3, 0)])
def test_acceptance_counters_exact_with_a_scripted_drafter(mtp_dir, plain_tokens, k, right):
    ps, want = plain_tokens
    # prompts in one chunk: each request's first token comes from its prefill, every later one from decode
    # steps (a prompt cut at a page boundary would end its prefill with a one-token step that verifies a draft)
    llm = LLM(mtp_dir, moe_backend="fused", speculative="mtp", num_speculative_tokens=k,
              **{**COMMON, "chunked_prefill_size": 64})
    script_drafter(llm, [p + w for p, w in zip(ps, want)], wrong_from=right)
    assert tokens(llm, ps) == want
    st = llm.stats()["speculative"]
    d, a, steps, emitted = expected_counters(SP.max_tokens, k, right)
    assert st["drafted_per_position"] == [x * len(ps) for x in d]
    assert st["accepted_per_position"] == [x * len(ps) for x in a]
    assert st["verify_steps"] == steps * len(ps)
    assert st["acceptance_rate"] == pytest.approx(sum(a) / sum(d))
    assert st["emitted"] == emitted * len(ps)
    llm.scheduler.check_integrity()


def assert_full_pages(llm):
    """Every node of the prefix tree holds a full page of tokens."""
    stack = [llm.scheduler.prefix.root]
    while stack:
        node = stack.pop()
        for key, child in node.children.items():
            assert len(key) == llm.engine.caches.kv.page_size, key
            stack.append(child)


def test_prefix_cache_hits_and_preemption_keep_greedy_tokens(mtp_dir, tiny_checkpoint):
    """Shared prefixes (hits resume from a state snapshot) and a KV pool so small that requests are preempted
    and recomputed: with drafts verified every step the tokens are those of the plain model."""
    plain = LLM(tiny_checkpoint("qwen35"), moe_backend="fused", **COMMON, page_size=4)
    V = plain.model_config.vocab_size
    base = prompts(V, (21,))[0]
    ps = [base + [1, 2], base + [3], base[:13] + [4, 5, 6]]
    want = tokens(plain, ps)
    for kw in ({"prefix_cache_prompt_snapshot": "on"}, {"num_tokens": 48}):
        llm = LLM(mtp_dir, moe_backend="fused", speculative="mtp", num_speculative_tokens=2, page_size=4,
                  **{**COMMON, **kw})
        got = [tokens(llm, [p])[0] for p in ps] if "num_tokens" not in kw else tokens(llm, ps)
        assert got == want, kw
        llm.scheduler.check_integrity()
        if "num_tokens" not in kw:
            assert llm.scheduler.stats()["prefix_cache"]["cached_tokens"] > 0
        assert llm.engine.caches.kv.pages.num_used == llm.scheduler.prefix.num_pages  # nothing leaked
        assert_full_pages(llm)


def test_rejected_pages_are_released(mtp_dir):
    """After each verify step a request holds pages for its tokens only (not for its rejected drafts)."""
    llm = LLM(mtp_dir, moe_backend="fused", speculative="mtp", num_speculative_tokens=3, page_size=2,
              **{**COMMON, "prefix_cache": False})
    V = llm.model_config.vocab_size
    from moestream.scheduler.request import Request

    req = Request("r", prompts(V, (5,))[0], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    llm.llm_engine.add_request(req)
    seen = 0
    while req.finish_reason is None:
        llm.llm_engine.step()
        if req.finish_reason is None and llm.llm_engine.runner.spec_totals["verify_steps"] > seen:
            seen = llm.llm_engine.runner.spec_totals["verify_steps"]
            # the drafter's own K/V may reach ahead by K - 1 positions (pages it took for its drafts)
            assert len(req.pages) <= llm.engine.caches.kv.pages_for(req.num_tokens + 2)
    assert seen > 0 and llm.engine.caches.kv.pages.num_used == 0


def small_gdn(seed: int):
    """A Gated DeltaNet of hidden 32 (2 key / 4 value heads of 8, conv kernel 4) with random weights in range."""
    from moestream.layers.gdn import GatedDeltaNet

    torch.manual_seed(seed)
    gdn = GatedDeltaNet(32, 2, 4, 8, 8, 4, 1e-6)
    with torch.no_grad():
        for n, p in gdn.named_parameters():
            p.copy_(torch.rand_like(p) if n in ("A_log", "dt_bias") else torch.randn_like(p) * 0.3)
        gdn.norm.weight.fill_(1.0)
    return gdn


def test_gdn_checkpoints_hold_the_state_after_each_token():
    """A verify step's per-position states equal the states after each prefix computed on its own."""
    from moestream.batch import ForwardBatch, SeqMeta

    gdn = small_gdn(0)
    x = torch.randn(5, 32)
    conv, rec = torch.zeros(6, gdn.conv_dim, 3), torch.zeros(6, 4, 8, 8)
    conv[0], rec[0] = torch.randn(gdn.conv_dim, 3), torch.randn(4, 8, 8) * 0.1
    start = conv.clone(), rec.clone()

    def batch(n, ckpt=None):
        return ForwardBatch(torch.zeros(n, dtype=torch.long), torch.arange(n),
                            [SeqMeta(0, n, 0, 0, torch.arange(n), checkpoints=ckpt)], torch.arange(n), torch.arange(1),
                            state_slots=torch.zeros(1, dtype=torch.long))

    with torch.no_grad():
        out = gdn(x, batch(5, [1, 2, 3, 4]), conv, rec)  # the state after tokens 0..3 -> slots 1..4
        for i in range(5):
            c, r = start[0].clone(), start[1].clone()
            ref = gdn(x[:i + 1], batch(i + 1), c, r)  # the chunked prefill over the first i + 1 tokens
            got = (conv[0], rec[0]) if i == 4 else (conv[1 + i], rec[1 + i])
            assert torch.allclose(r[0], got[1], atol=1e-5), i
            assert torch.allclose(c[0], got[0], atol=1e-6), i  # the projections of 2 vs 5 rows may round apart
            assert torch.allclose(ref, out[:i + 1], atol=1e-5), i


def test_verify_as_decode_rows_equals_the_verify_pass():
    """engine/graphs.verify_rows: two requests' verify rows as one-token sequences (the Gated DeltaNet taking them
    position by position, the layout CUDA graphs record) give the verify pass's outputs, final states and
    checkpoints."""
    from moestream.batch import ForwardBatch, SeqMeta
    from moestream.engine.graphs import verify_rows

    gdn = small_gdn(1)
    n = 4
    x = torch.randn(2 * n, 32)
    conv, rec = torch.zeros(9, gdn.conv_dim, 3), torch.zeros(9, 4, 8, 8)
    conv[:2], rec[:2] = torch.randn(2, gdn.conv_dim, 3), torch.randn(2, 4, 8, 8) * 0.1
    ckpt = [[2, 3, 4], [5, 6, 7]]
    seqs = [SeqMeta(b * n, n, 3 + b, b, torch.arange(3 + b + n) + 10 * b, checkpoints=ckpt[b]) for b in range(2)]
    batch = ForwardBatch(torch.zeros(2 * n, dtype=torch.long), torch.arange(2 * n), seqs, torch.arange(2 * n),
                         torch.arange(2 * n), state_slots=torch.arange(2), extra={"decode_like": True})
    rows = verify_rows(batch)
    assert rows.is_decode and rows.extra["verify_n"] == n and rows.extra["verify_ckpt"].tolist() == ckpt
    assert [(r.cached, r.total, r.state_slot) for r in rows.seqs[:n]] == [(3, 4, 0), (4, 5, 0), (5, 6, 0), (6, 7, 0)]
    assert torch.equal(rows.seqs[n + 2].kv_index, seqs[1].kv_index[:4 + 3])  # row 2 of request 1 sees 4 + 3 positions
    with torch.no_grad():
        c1, r1 = conv.clone(), rec.clone()
        want = gdn(x, batch, c1, r1)
        c2, r2 = conv.clone(), rec.clone()
        got = gdn(x, rows, c2, r2)
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(r2, r1, atol=1e-5) and torch.allclose(c2, c1, atol=1e-6)
    assert not torch.equal(r2[2], rec[2])  # the checkpoint slots were written
    # any other step keeps its layout: prompt rows, or requests with different row counts
    assert verify_rows(dataclasses.replace(batch, prompt=True)) is None
    assert verify_rows(dataclasses.replace(batch, seqs=[seqs[0], dataclasses.replace(seqs[1], length=3)])) is None


def test_verify_steps_run_as_decode_rows(mtp_dir, plain_tokens, monkeypatch):
    """Speculative verify steps of equal row counts take the decode-row layout (the one CUDA graphs record) and
    give the verify pass's greedy tokens and logits, step by step."""
    from moestream.engine import engine as engine_mod
    from moestream.engine.graphs import verify_rows

    ps, want = plain_tokens
    taken, steps = [], []
    for layout in (lambda b: taken.append(verify_rows(b)) or taken[-1], lambda b: None):  # None: the verify pass
        monkeypatch.setattr(engine_mod, "verify_rows", layout)
        llm = LLM(mtp_dir, moe_backend="fused", speculative="mtp", num_speculative_tokens=2, **COMMON)
        forward, logits = llm.engine.forward, []
        llm.engine.forward = lambda b: logits.append(forward(b)) or logits[-1]
        assert tokens(llm, ps) == want
        steps.append(logits)
    assert sum(t is not None for t in taken) > 5
    assert len(steps[0]) == len(steps[1])
    for i, (a, b) in enumerate(zip(*steps)):
        assert torch.allclose(a, b, atol=1e-3, rtol=1e-3), (i, (a - b).abs().max())  # summation orders


def test_decode_extra_lays_each_row_out_up_to_its_own_position():
    """engine/graphs.decode_extra: row j of a sequence (flat row start + j) sees its KV up to cached + j + 1."""
    from moestream.batch import ForwardBatch, SeqMeta
    from moestream.engine.graphs import decode_extra

    seqs = [SeqMeta(0, 3, 2, 0, torch.tensor([7, 8, 9, 10, 11])), SeqMeta(3, 1, 4, 1, torch.tensor([1, 2, 3, 4, 5]))]
    batch = ForwardBatch(torch.zeros(4, dtype=torch.long), torch.arange(4), seqs, torch.arange(4), torch.arange(4))
    ex = decode_extra(batch)
    assert ex["decode_kv_len"].tolist() == [3, 4, 5, 5]
    assert ex["decode_kv_index"].tolist() == [[7, 8, 9, 0, 0], [7, 8, 9, 10, 0], [7, 8, 9, 10, 11], [1, 2, 3, 4, 5]]
    assert ex["decode_kv_valid"].sum(1).tolist() == [3, 4, 5, 5]


def test_drafter_passes_as_decode_rows_equal_the_per_request_passes(mtp_dir, plain_tokens, monkeypatch):
    """The MTP block's decode-like passes laid out as decode rows (Engine.draft; on CUDA the split-KV attention
    kernel reads them) give the per-request attention's drafts and logits, pass by pass; the greedy tokens stay the
    plain model's. Forced here on the CPU, where the rows run the torch decode path."""
    from moestream.engine.engine import Engine

    ps, want = plain_tokens
    runs = []
    for rows in (True, False):
        monkeypatch.setattr(Engine, "_draft_rows_attention", lambda self, r=rows: r)
        llm = LLM(mtp_dir, moe_backend="fused", speculative="mtp", num_speculative_tokens=2, **COMMON)
        draft, seen = llm.engine.draft, []

        def record(batch, hidden, step=0, draft=draft, seen=seen, model=llm.engine.model):
            out = draft(batch, hidden, step)
            seen.append((step, max(q.length for q in batch.seqs), "decode_kv_index" in batch.extra, out,
                         model.hidden.clone()))  # the drafting rows' outputs the next pass starts from
            return out

        llm.engine.draft = record
        assert tokens(llm, ps) == want
        runs.append(seen)
    laid, plain = runs
    assert len(laid) == len(plain) and not any(r[2] for r in plain)
    assert any(r[2] and r[1] > 1 for r in laid) and any(r[2] and r[0] > 0 for r in laid)  # fill and later passes
    for a, b in zip(laid, plain):
        assert a[:2] == b[:2] and torch.allclose(a[3], b[3], atol=1e-4, rtol=1e-4), (a[:3], (a[3] - b[3]).abs().max())
        assert torch.allclose(a[4], b[4], atol=1e-4, rtol=1e-4), (a[:3], (a[4] - b[4]).abs().max())


# ---- the acceptance rule -------------------------------------------------------------------------
def test_verify_drafts_greedy():
    from moestream.engine.sampler import verify_drafts

    logits = torch.tensor([[0., 3., 1.], [2., 0., 1.], [0., 0., 5.]])
    greedy = SamplingParams(temperature=0.0)
    assert verify_drafts(logits, [1, 0], greedy, None) == [1, 0, 2]  # both accepted + the target's token
    assert verify_drafts(logits, [1, 2], greedy, None) == [1, 0]  # the second rejected: the target's instead
    assert verify_drafts(logits, [0, 0], greedy, None) == [1]
    assert verify_drafts(logits[:1], [], greedy, None) == [1]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3),
                                    SamplingParams(temperature=1.3, top_p=0.8)])
def test_verify_drafts_keeps_the_sampling_distribution(params):
    """Whatever the (one-hot) drafts, each emitted token has the distribution plain sampling gives it: the
    first token's and, given the first draft was kept, the second's (5000 draws, 4-token vocabulary; a draft
    outside top-k / top-p is never kept)."""
    from moestream.engine.sampler import filter_logits, verify_drafts

    logits = torch.tensor([[1.0, 0.2, -0.5, 0.6], [0.1, 1.5, 0.3, -1.0], [0.0, 0.0, 0.0, 2.0]])
    p = [torch.softmax(filter_logits(row, params), -1) for row in logits]
    g = torch.Generator().manual_seed(1)
    n = 5000
    for drafts in ([0, 1], [2, 3]):
        first = torch.zeros(4)
        second, kept = torch.zeros(4), 0
        for _ in range(n):
            out = verify_drafts(logits, drafts, params, g)
            assert 1 <= len(out) <= 3
            first[out[0]] += 1
            if out[0] == drafts[0]:  # the first draft was accepted: the next token is from p[1]
                second[out[1]] += 1
                kept += 1
        # 4.5 standard errors of a binomial proportion
        tol = 4.5 * (p[0] * (1 - p[0]) / n).sqrt() + 1e-9
        assert ((first / n - p[0]).abs() <= tol).all(), (drafts, first / n, p[0])
        assert kept == 0 if p[0][drafts[0]] == 0 else kept > 200
        if kept:
            tol = 4.5 * (p[1] * (1 - p[1]) / kept).sqrt() + 1e-9
            assert ((second / kept - p[1]).abs() <= tol).all(), (drafts, second / kept, p[1])


def test_sampled_requests_speculate_and_finish(mtp_dir):
    llm = LLM(mtp_dir, moe_backend="fused", speculative="mtp", num_speculative_tokens=2, **COMMON)
    V = llm.model_config.vocab_size
    script = [p + [0] * 40 for p in prompts(V)]
    script_drafter(llm, script)  # drafts that are often wrong and sometimes right
    out = llm.generate(prompts(V), SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=3,
                                                  ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [16] * 4
    assert all(0 <= t < V for o in out for t in o.token_ids)
    st = llm.stats()["speculative"]
    assert st["verify_steps"] > 0 and st["emitted"] == st["accepted"] + st["verify_steps"]
    llm.scheduler.check_integrity()


def test_processed_requests_decode_without_drafts(mtp_dir, plain_tokens):
    """Logit processing (penalties here), grammars and logprobs decode one token a step: no drafts."""
    ps, _ = plain_tokens
    llm = LLM(mtp_dir, moe_backend="fused", speculative="mtp", num_speculative_tokens=2, **COMMON)
    llm.generate(ps[:2], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, repetition_penalty=1.3))
    llm.generate(ps[:2], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2))
    assert llm.stats()["speculative"]["drafted"] == 0


def test_engine_loop_stats_and_metrics(mtp_dir):
    from moestream.server.engine_proc import EngineArgs, EngineLoop
    from moestream.server.metrics import Metrics

    class Outbox:
        def __init__(self):
            self.msgs = []

        def send(self, msg):
            self.msgs.append(msg)

    loop = EngineLoop(EngineArgs(str(mtp_dir), {"device": "cpu", "dtype": "float32", "speculative": "mtp",
                                                "num_speculative_tokens": 2}), Outbox())
    script_drafter(loop.llm, [list(range(3, 13)) + [0] * 20])
    from moestream.server.messages import Add, Outputs

    loop._add(Add("a", list(range(3, 13)), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)))
    for _ in range(20):
        loop._step()
    deltas = [d for m in loop.outbox.msgs if isinstance(m, Outputs) for _, d in m.items]
    assert sum(d.tokens for d in deltas) == 8 and deltas[-1].finish_reason == "length"
    spec = loop.stats()["speculative"]
    assert spec["verify_steps"] > 0 and len(spec["acceptance_rate_per_position"]) == 2
    m = Metrics("x")
    m.update_engine(loop.stats())
    text = m.exposition().decode()
    assert f'moestream_spec_decode_drafted_tokens{{model="x"}} {float(spec["drafted"])}' in text
    assert 'moestream_spec_decode_acceptance_rate_per_position{model="x",position="1"}' in text


def test_conversation_resumes_from_a_snapshot_taken_by_a_verify_step(mtp_dir, tiny_checkpoint):
    """A turn decoded with drafts leaves a rolling state snapshot at a page boundary its verify steps reached,
    so the next turn (the conversation so far + new tokens) hits past the first turn's prompt."""
    plain = LLM(tiny_checkpoint("qwen35"), moe_backend="fused", **COMMON, page_size=4)
    V = plain.model_config.vocab_size
    first = prompts(V, (9,))[0]
    sp = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    reply = tokens(plain, [first], sp)[0]
    second = first + reply + [5, 6, 7]
    want = tokens(plain, [second], sp)[0]
    # every draft right, 3 tokens a step from position 9: the state lands on the page boundary 12
    llm = LLM(mtp_dir, moe_backend="fused", speculative="mtp", num_speculative_tokens=2, page_size=4,
              **{**COMMON, "prefix_cache_prompt_snapshot": "off"})
    script_drafter(llm, [first + reply, second + want])
    assert tokens(llm, [first], sp)[0] == reply
    assert llm.llm_engine.runner.spec_totals["accepted"] > 0
    out = llm.generate([second], sp)[0]
    assert out.token_ids == want
    assert out.cached_tokens > len(first)  # a snapshot inside the first turn's reply
    assert out.cached_tokens % 4 == 0
    llm.scheduler.check_integrity()
    assert_full_pages(llm)


def test_stacked_and_quantized_mtp_experts_load(mtp_dir, tiny_checkpoint, tmp_path, plain_tokens):
    """The block's experts stacked (mtp.layers.0.mlp.experts.gate_up_proj) load to the same store rows as
    per-expert ones; NVFP4 / MXFP4 checkpoints keep the block's experts compressed, like every layer's."""
    import tiny_models
    from test_hf_quant import QUANT_CONFIGS, _quantize, _stack, _write

    stacked = tiny_checkpoint("qwen35_mtp", mtp_expert_layout="stacked")
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in tiny_models.tensor_names(stacked)
    a = LLM(mtp_dir, moe_backend="fused", speculative="mtp", **COMMON).engine.runtime.store
    b = LLM(stacked, moe_backend="fused", speculative="mtp", **COMMON).engine.runtime.store
    for name in a.banks:
        assert torch.equal(a.bank(4)[name], b.bank(4)[name]), name
    ps, want = plain_tokens
    sd = tiny_models.read_state_dict(mtp_dir)
    for scheme, stack in (("nvfp4", False), ("mxfp4", True)):
        qsd, _ = _quantize(_stack(sd) if stack else sd, scheme)
        assert any(k.startswith("mtp.layers.0.mlp.experts.") and t.dtype == torch.uint8 for k, t in qsd.items())
        qdir = _write(mtp_dir, tmp_path / scheme, qsd, QUANT_CONFIGS[scheme])
        plain_q = LLM(qdir, moe_backend="fused", **COMMON)
        spec_q = LLM(qdir, moe_backend="fused", speculative="mtp", num_speculative_tokens=2, **COMMON)
        store = spec_q.engine.runtime.store
        assert store.fmt.quantized and 4 in store.moe_layers
        assert store.bytes_per_expert(4) == store.bytes_per_expert(0)
        assert tokens(spec_q, ps) == tokens(plain_q, ps), scheme


def test_a_failing_drafter_loses_no_tokens(mtp_dir, plain_tokens):
    """The drafter runs after the step's tokens are taken: if it fails they still come out, undrafted."""
    ps, want = plain_tokens
    llm = LLM(mtp_dir, moe_backend="fused", speculative="mtp", num_speculative_tokens=2, **COMMON)
    real, calls = llm.engine.draft, []

    def flaky(batch, hidden, step=0):
        calls.append(step)
        if len(calls) % 3 == 0:
            raise RuntimeError("simulated drafter failure")
        return real(batch, hidden, step)

    llm.engine.draft = flaky
    assert tokens(llm, ps) == want
    assert len(calls) >= 3
    llm.scheduler.check_integrity()


def test_a_request_whose_verification_fails_fails_alone(mtp_dir, plain_tokens, monkeypatch):
    """The sampler raises while verifying one request's drafts: that request ends with "error", the others of
    the verify step keep their tokens (the exception failed the whole step: generate() raised for the whole
    batch, and the server recomputed every request in it)."""
    import moestream.engine.runner as runner_mod

    ps, want = plain_tokens
    llm = LLM(mtp_dir, moe_backend="fused", speculative="mtp", num_speculative_tokens=2, **COMMON)
    bad = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    real, calls = runner_mod.verify_drafts, []

    def flaky(logits, drafts, params, generator):
        if params is bad:
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("simulated sampler failure")
        return real(logits, drafts, params, generator)

    monkeypatch.setattr(runner_mod, "verify_drafts", flaky)
    outs = llm.generate(ps, [SP, SP, bad, SP])
    assert [o.finish_reason for o in outs] == ["length", "length", "error", "length"]
    assert [outs[i].token_ids for i in (0, 1, 3)] == [want[i] for i in (0, 1, 3)]
    assert len(calls) == 2
    llm.scheduler.check_integrity()


def test_a_request_whose_grammar_mask_fails_fails_alone_beside_speculation(mtp_dir, plain_tokens, monkeypatch):
    """A constrained request (which decodes without drafts) fails computing its grammar mask in a step where
    the others verify drafts: only it ends, with "error"; the others keep their tokens. The mask's exception
    failed the whole step: generate() raised for the whole batch (the server recomputed every request)."""
    from moestream.tokenizer.grammar import Matcher, compile_grammar

    ps, want = plain_tokens
    llm = LLM(mtp_dir, moe_backend="fused", speculative="mtp", num_speculative_tokens=2, **COMMON)
    real, calls = Matcher.allowed, []

    def flaky(self):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("simulated mask failure")
        return real(self)

    monkeypatch.setattr(Matcher, "allowed", flaky)
    bad = SamplingParams(max_tokens=10, temperature=0.0, grammar=compile_grammar("regex", "(.|\\n){0,200}"))
    outs = llm.generate(ps + [ps[1]], [SP, SP, SP, SP, bad])
    assert [o.finish_reason for o in outs] == ["length"] * 4 + ["error"]
    assert [o.token_ids for o in outs[:4]] == want and len(calls) == 3
    assert llm.llm_engine.runner.spec_totals["verify_steps"] > 0
    llm.scheduler.check_integrity()


def test_a_failed_sampling_leaves_the_verifying_requests_as_they_were(mtp_dir, monkeypatch):
    """A step that samples one request (penalties: no drafts) and verifies another's drafts fails in the
    sampler, for the whole batch: it fails before the verification, so the speculating request still has its
    drafts, its reasoning state and the counters as they were (verified first, it had them cleared and
    advanced for tokens the failed step never appended, and the server then recomputed it from its tokens)."""
    import moestream.engine.runner as runner_mod
    from moestream.scheduler.request import Request

    llm = LLM(mtp_dir, moe_backend="fused", speculative="mtp", num_speculative_tokens=2, **COMMON)
    eng, runner = llm.llm_engine, llm.llm_engine.runner
    spec = Request("spec", [3, 4, 5, 6], SP)
    eng.add_request(spec)
    eng.add_request(Request("pen", [7, 8, 9], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                             repetition_penalty=1.2)))
    while not spec.drafts:
        eng.step()
    drafts, totals, thinking = list(spec.drafts), dict(runner.spec_totals), (spec.thinking, spec.thinking_tokens)

    def broken(*args):
        raise RuntimeError("simulated sampler failure")

    monkeypatch.setattr(runner_mod, "sample", broken)
    with pytest.raises(RuntimeError, match="simulated"):
        eng.step()
    assert spec.drafts == drafts and runner.spec_totals == totals
    assert (spec.thinking, spec.thinking_tokens) == thinking


@pytest.mark.parametrize("backend,kw", [("offload", {"moe_cache_size": 3, "moe_decode_kernel": "pairs"}),
                                        ("hybrid", {"moe_cache_size": 3})])
def test_drafter_passes_after_decode_steps_take_the_decode_path(mtp_dir, plain_tokens, backend, kw):
    """The MTP block's pass over the positions a verify step computed (a few rows a request) runs its experts as a
    decode step does (the slot cache and pairs; no prompt-chunk streaming), a pass after a prompt chunk as prefill;
    the greedy tokens stay the plain model's. Drafts are scripted right so that the passes have several rows."""
    from moestream.moe.runtime import ExpertRuntime

    ps, want = plain_tokens
    llm = LLM(mtp_dir, moe_backend=backend, speculative="mtp", num_speculative_tokens=2,
              **{**COMMON, "chunked_prefill_size": 64}, **kw)
    script_drafter(llm, [p + w for p, w in zip(ps, want)])
    seen, begin = [], ExpertRuntime.begin_step

    def record(self, info=None):
        if (info or {}).get("draft"):
            seen.append((info["decode"], max(q.length for q in info["seqs"])))
        return begin(self, info)

    ExpertRuntime.begin_step = record
    try:
        assert tokens(llm, ps) == want
    finally:
        ExpertRuntime.begin_step = begin
    few = [d for d, rows in seen if 1 < rows <= 3]
    assert len(few) >= 2 and all(few)  # several-row passes after verify steps: decode
    assert not any(d for d, rows in seen if rows > 3)  # passes over a prompt chunk: prefill


@pytest.mark.parametrize("backend,kw", [("cpu", {}), ("hybrid", {"moe_cache_size": 3})])
def test_drafter_passes_through_the_cpu_bridge(mtp_dir, plain_tokens, backend, kw, monkeypatch):
    """cpu and hybrid where the pair path runs (a GPU; here its torch twin): the MTP block's passes post only their
    layer to the CPU bridge, whose worker serves the layers in order, so it must start at that layer — waiting for
    layer 0 it would leave the pass's CPU pairs unanswered (the step fails after the worker's timeout, cut to 5 s
    here). Greedy tokens are the plain model's."""
    from moestream.moe import bridge, share

    monkeypatch.setattr(bridge, "WORKER_TIMEOUT_S", 5.0)
    monkeypatch.setattr(share, "PRIOR_FIXED_S", 0.0)  # hybrid: half of the misses to the CPU, measured or not
    monkeypatch.setattr(share.LiveShare, "observe", lambda self, fit: None)
    monkeypatch.setenv("MOESTREAM_HYBRID_ARMS", "0")
    ps, want = plain_tokens
    llm = LLM(mtp_dir, moe_backend=backend, speculative="mtp", num_speculative_tokens=2, moe_decode_kernel="pairs",
              **COMMON, **kw)
    b = llm.engine.runtime.bridge
    assert b is not None
    assert tokens(llm, ps) == want
    mtp = b.index[llm.model_config.mtp_layer_ids[0]]
    assert b.cpu_experts[mtp] > 0  # the block's own layer had CPU pairs, answered
    assert llm.stats()["speculative"]["drafted"] > 0


def test_drafter_passes_through_the_compiled_bridge_worker(tiny_checkpoint, tmp_path, monkeypatch):
    """The same through the bridge's compiled worker (GGUF experts: ms_bridge_step), which is handed the
    per-layer arrays from the MTP layer on: the pass's CPU pairs are answered and the greedy tokens are those
    of decoding without drafts (one request: its rows' products do not depend on other requests).

    The file's experts are Q8_0 (what the compiled worker reads), its dense layers F16: Q8_0 dense layers round
    their inputs to int8 per block, and a verify pass (3 rows) differs from a decode step (1 row) by ~1e-7 in the
    float ops between them, which now and then crosses a rounding boundary and moves that layer's output by a
    quantum (a random tiny model, 2026-12-08: layer 2's input 1e-6 apart, its output 4e-3, the logits 0.2 by the
    head), enough to flip a greedy token — numerics of int8 activations, not of the drafter or the worker."""
    import gguf_writer
    from gguf import GGMLQuantizationType as Q

    from moestream.kernels import cpu_quant
    from moestream.moe import bridge

    if not cpu_quant.available():
        pytest.skip("the compiled CPU kernels cannot be built here")
    mtp_gguf, _ = gguf_writer.write_gguf(tiny_checkpoint("qwen35_mtp", layout="causal"), tmp_path / "m.gguf", Q.F16,
                                         expert_qtype=lambda layer, name: Q.Q8_0)
    monkeypatch.setattr(bridge, "WORKER_TIMEOUT_S", 5.0)
    firsts, real = [], cpu_quant.bridge_step

    def step(seq, arrays, timeout_s, first=0, **kw):
        firsts.append(first)
        return real(seq, arrays, timeout_s, first, **kw)

    monkeypatch.setattr(cpu_quant, "bridge_step", step)
    outs = {}
    for spec in ("none", "mtp"):
        llm = LLM(mtp_gguf, moe_backend="cpu", moe_decode_kernel="pairs", speculative=spec,
                  num_speculative_tokens=2, **COMMON)
        outs[spec] = tokens(llm, [[5, 6, 7, 8, 9]])
    mtp = llm.engine.runtime.bridge.index[llm.model_config.mtp_layer_ids[0]]
    assert 0 in firsts and mtp in firsts  # model steps from layer 0, drafter passes from the MTP layer
    assert llm.engine.runtime.bridge.cpu_experts[mtp] > 0
    assert outs["mtp"] == outs["none"]

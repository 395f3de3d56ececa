"""The compiled CPU decode layer (models/cpu_decode.py, kernels/cpu/decode.cpp) against the per-op path.

Both compute the same products with the same kernels; only norms, rotary and softmax sum in another order, so
every decode step's logits must agree to float32 rounding, and greedy tokens must be the same, for a batch of
sequences of different lengths (each attends over its own KV slots)."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from moestream.kernels import cpu_quant

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="the CPU kernels did not build")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33]]


@pytest.mark.parametrize("n", [1, 3, 5])
@pytest.mark.parametrize("qtype,K", [("Q8_0", 96), ("Q6_K", 512)])
def test_float_activation_matmul_is_exact(n, qtype, K):
    """The vocabulary head's kernel (Q8_0, or a Q4_K_M file's Q6_K head): stored values times float32 activations
    (Q6_K: x as int16 per 256 values, within its rounding bound), so the result is the float64 product up to that and
    float32 summation — not the int8 rounding of x of the decode matmuls, shown here to be 10x further off."""
    from moestream.quant import gguf_format
    from moestream.quant.synthetic import random_raw

    N = 300
    fmt = gguf_format(qtype)
    raw = random_raw(fmt, (N, K), seed=3)
    w = fmt.dequantize(raw, (N, K), torch.float64)
    x = torch.randn(n, K, dtype=torch.float32)
    got = cpu_quant.float_act_matmul(x, raw.reshape(N, -1), cpu_quant.TYPES[qtype])
    ref = x.double() @ w.t()
    err = (got.double() - ref).abs().max().item()
    bound = 1e-5 * ref.abs().max().item()
    if qtype == "Q6_K":  # x as int16 per 256 values: each value within half a step of the block's largest / 32767
        step = x.abs().reshape(n, -1, 256).amax(-1).double() / 32767
        bound += (0.5 * step.repeat_interleave(256, -1) @ w.abs().t()).max().item()
    assert err < bound, (err, bound)
    rounded = cpu_quant.rows_matmul(x, raw.reshape(N, -1), cpu_quant.TYPES[qtype])  # int8 activations
    assert (rounded.double() - ref).abs().max().item() > 10 * err
    with pytest.raises(ValueError):
        cpu_quant.float_act_matmul(x[:, :64], raw.reshape(N, -1), cpu_quant.TYPES["Q4_K"])


def _gguf(kind: str, qtype_name: str, tmp_path, tiny_checkpoint):
    import gguf_writer
    from gguf import GGMLQuantizationType as Q

    if kind == "llama":
        hf_dir = gguf_writer.make_llama(tmp_path / "hf")
    elif kind == "qwen35_attn":  # Qwen3.5 without Gated DeltaNet: gated attention + the fused MoE block
        import tiny_models

        hf_dir = tiny_models.make_qwen3_5_moe(tmp_path / "hf", layout="causal", layer_types=["full_attention"] * 4)
    else:
        hf_dir = tiny_checkpoint(kind)
    return gguf_writer.write_gguf(hf_dir, tmp_path / "m.gguf", getattr(Q, qtype_name))[0]


def _generate(llm, n: int = 6):
    from moestream import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return [o.token_ids for o in outs]


def ref_logprobs(path, sp):
    """The compiled stack's outputs (top-2 logprobs per token) of PROMPTS: where a near tie is."""
    from moestream import LLM

    return LLM(path, device="cpu", dtype="float32", max_running_requests=4).generate(PROMPTS, sp)


def _both_paths(monkeypatch, diffs: list):
    """QwenMoeModel.forward running every decode step per-op, then compiled (the same K/V rewritten; a Gated
    DeltaNet model's state put back between the two), the relative logit difference of each step in `diffs`."""
    from moestream.models.qwen_moe import QwenMoeModel

    inner = QwenMoeModel.forward

    def both(self, batch):
        if not batch.is_decode:
            return inner(self, batch)
        st = self.caches.state
        saved = (st.conv.clone(), st.rec.clone()) if st is not None and st.conv is not None else None
        monkeypatch.setenv("MOESTREAM_CPU_DECODE_LAYER", "0")
        ref = inner(self, batch)
        if saved is not None:
            st.conv.copy_(saved[0]), st.rec.copy_(saved[1])
        monkeypatch.setenv("MOESTREAM_CPU_DECODE_LAYER", "1")
        steps = self.cpu_decode.steps if self.cpu_decode else 0
        got = inner(self, batch)
        assert self.cpu_decode.steps == steps + 1  # the compiled path ran
        diffs.append(((got - ref).abs().max() / ref.abs().max()).item())
        return got

    monkeypatch.setattr(QwenMoeModel, "forward", both)


@pytest.mark.parametrize("kv,heads,kv_heads,hidden", [
    ("auto", 4, 2, 64), ("float16", 4, 2, 64), ("auto", 4, 4, 64), ("auto", 6, 2, 48), ("float16", 6, 2, 48),
    ("auto", 8, 2, 64), ("float16", 8, 2, 64), ("float16", 16, 2, 128), ("auto", 9, 1, 72), ("float16", 9, 1, 72),
    ("fp8", 4, 2, 64), ("fp8", 8, 2, 64), ("fp8", 9, 1, 72)])
# (float16 4/4/64 and float32 16/2/128 are left out: there one step's 2e-7 upstream difference moves a Q8_0 int8
# activation across a rounding boundary, 2.5e-3 in the logits; with F16 weights 2e-7 — benchmarks/RESULTS.md)
def test_long_context_attention_matches_the_per_op_path(kv, heads, kv_heads, hidden, tmp_path, tiny_checkpoint,
                                                        monkeypatch):
    """Rows over more cached positions than one attention work item holds (decode.cpp ATT_CHUNK = 64: 420 and
    300 positions, split into chunks whose softmaxes are combined by their maxima) beside a short one: the
    compiled layer's logits equal the per-op path's at every step (a dense model: no router whose near-ties a
    rounding difference could flip). Query heads per KV head 1 / 2 / 3 / 4 / 8 / 9 and head sizes 8 / 16 / 24 (the
    AVX2 build's register-blocked groups, 16 or 8 value columns at once, and the plain loop beyond 8)."""
    import gguf_writer
    from gguf import GGMLQuantizationType as Q

    from moestream import LLM, SamplingParams

    hf = gguf_writer.make_llama(tmp_path / "hf", max_position_embeddings=1024, heads=heads, kv_heads=kv_heads,
                                hidden=hidden)
    path = gguf_writer.write_gguf(hf, tmp_path / "m.gguf", Q.Q8_0)[0]
    llm = LLM(path, device="cpu", dtype="float32", max_running_requests=4, kv_cache_dtype=kv)
    diffs = []
    _both_paths(monkeypatch, diffs)
    prompts = [[5 + i % 200 for i in range(420)], [7 + i % 150 for i in range(300)], [3, 4, 5]]
    llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert len(diffs) >= 4 and max(diffs) < 1e-4, diffs


@pytest.mark.parametrize("kind,qtype,kv", [("llama", "Q4_1", "auto"), ("llama", "Q8_0", "auto"), ("llama", "Q5_0", "auto"),
                                           ("qwen3", "Q8_0", "auto"), ("qwen35_attn", "Q8_0", "auto"),
                                           ("qwen35_causal", "Q8_0", "auto"), ("llama", "Q4_1", "float16"),
                                           ("qwen35_attn", "Q8_0", "float16"), ("llama", "Q4_1", "fp8"),
                                           ("qwen35_attn", "Q8_0", "fp8")])
def test_decode_layer_logits_match_the_per_op_path(kind, qtype, kv, tmp_path, tiny_checkpoint, monkeypatch):
    """Every decode step runs twice — per-op, then compiled (rewriting the same K/V; a Gated DeltaNet model's
    state pools put back between the two) — and the logits agree; with --kv-cache-dtype float16 both paths
    round the K/V they write the same way and widen what they read; with fp8 (e4m3fn) both encode as torch's saturating
    cast does (decode.cpp to_fp8 / kv8 against layers/attention.kv_write / kv_rows)."""
    from moestream import LLM
    from moestream.models.cpu_decode import M

    llm = LLM(_gguf(kind, qtype, tmp_path, tiny_checkpoint), device="cpu", dtype="float32", max_running_requests=4,
              kv_cache_dtype=kv)
    assert llm.engine.caches.kv.k.dtype == {"float16": torch.float16, "fp8": torch.float8_e4m3fn}.get(kv, torch.float32)
    model = llm.engine.model
    diffs = []
    _both_paths(monkeypatch, diffs)
    _generate(llm)
    plan = model.cpu_decode
    assert plan.layers == len(model.layers)
    moe = [type(layer.mlp).__name__ == "SparseMoeBlock" for layer in model.layers]
    assert plan.has_mlp == [not b for b in moe]  # a dense MLP goes into the layer's call
    assert [d is not None for d in plan.moe] == moe  # a MoE block: its own call
    assert any(moe) == (kind != "llama")
    # qwen35: models/fuse.py's [router | shared gate | up | shared_expert_gate] GEMM, computed in the call
    assert [d[M["FW"]] != 0 for d in plan.moe if d is not None] == [kind.startswith("qwen35")] * sum(moe)
    # per-op and compiled sum in different orders (~1e-7 apart); a Q8_0 matmul rounds its activations to int8 per
    # block, and on some CPUs one such difference moves a near-tied activation to the next int8 code in one step,
    # which moves that step's logits by ~1e-3 of their range (measured 1.6e-3 on an AMD EPYC VM): at most one step
    # may, within 5e-3; a wrong result is of order 1
    assert len(diffs) >= 5 and sorted(diffs)[-2] < 1e-4 and max(diffs) < 5e-3, diffs


@pytest.mark.parametrize("kind,backend", [("qwen3", "fused"), ("qwen3", "cpu"), ("qwen35_attn", "cpu")])
def test_moe_block_call_books_the_per_op_statistics(kind, backend, tmp_path, tiny_checkpoint, monkeypatch):
    """A MoE block computed in one call gives the per-op tokens, and the runtime's statistics (tokens, routed
    pairs, expert calls, hits or CPU experts, per-expert hits) are what the per-op path books (qwen35_attn: the
    fused shared-expert block)."""
    from moestream import LLM

    path = _gguf(kind, "Q8_0", tmp_path, tiny_checkpoint)
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("MOESTREAM_CPU_DECODE_LAYER", flag)
        llm = LLM(path, device="cpu", dtype="float32", moe_backend=backend, max_running_requests=4)
        tokens = _generate(llm, 6)
        st = llm.engine.runtime.stats()
        runs[flag] = tokens, st["total"], st["layers"], st.get("expert_hits")
        plan = llm.engine.model.cpu_decode
        assert (plan.steps > 0 and sum(d is not None for d in plan.moe) >= 2) == (flag == "1")
    assert runs["0"] == runs["1"]


@pytest.mark.parametrize("kind", ["llama", "qwen35_causal", "hf:qwen3"])
def test_decode_layer_gives_the_per_op_tokens(kind, tmp_path, tiny_checkpoint, monkeypatch):
    """Greedy tokens of a batch, compiled layer on and off; qwen35 mixes Gated DeltaNet layers (ms_gdn_decode)
    with gated, zero-centred attention layers; hf:qwen3 is a safetensors checkpoint (float32 rows). Every layer
    is compiled."""
    from moestream import LLM

    path = tiny_checkpoint(kind[3:]) if kind.startswith("hf:") else _gguf(kind, "Q8_0", tmp_path, tiny_checkpoint)
    monkeypatch.setenv("MOESTREAM_CPU_DECODE_LAYER", "0")
    ref = _generate(LLM(path, device="cpu", dtype="float32", max_running_requests=4), 8)
    monkeypatch.setenv("MOESTREAM_CPU_DECODE_LAYER", "1")
    llm = LLM(path, device="cpu", dtype="float32", max_running_requests=4)
    assert _generate(llm, 8) == ref
    plan = llm.engine.model.cpu_decode
    assert plan.steps >= 7 and plan.layers == len(llm.engine.model.layers)
    # a GGUF's MoE blocks are compiled too: the whole stack in one call each step (hf:qwen3's float32 experts
    # are not read by the kernels, so its MoE blocks stay per-op between the layer calls)
    assert plan.stack_steps == (plan.steps if not kind.startswith("hf:") else 0)
    gdn = [layer.kind == "linear_attention" for layer in llm.engine.model.layers]
    assert [k == "gdn" for k in plan.kinds] == gdn and any(gdn) == (kind == "qwen35_causal")


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen35_causal"])
def test_stack_call_gives_the_per_layer_calls_tokens(kind, tmp_path, tiny_checkpoint, monkeypatch):
    """The whole stack in one ms_decode_stack call (layers, MoE blocks, final norm) against one call per layer and
    block: the same greedy tokens and runtime statistics; a routing tap attached (--record-routing) sends the step
    back to the per-layer path, whose per-op MoE blocks the tap sees."""
    from moestream import LLM
    from moestream.moe.trace import read_trace

    path = _gguf(kind, "Q8_0", tmp_path, tiny_checkpoint)
    runs = {}
    for mode in ("stack", "per_layer"):
        llm = LLM(path, device="cpu", dtype="float32", max_running_requests=4)
        _generate(llm, 2)  # the plan is made at the first decode step
        plan = llm.engine.model.cpu_decode
        assert plan.stack is not None
        if mode == "per_layer":
            plan.stack = None
        before = plan.stack_steps
        runs[mode] = _generate(llm, 8), llm.engine.runtime.stats()["total"]
        assert (plan.stack_steps > before) == (mode == "stack") and plan.steps >= 7
    assert runs["stack"] == runs["per_layer"]
    if kind == "llama":
        return
    trace = tmp_path / "routing.trace"
    llm = LLM(path, device="cpu", dtype="float32", max_running_requests=4, record_routing=str(trace))
    # the tap's per-op MoE blocks sum in another order than the compiled ones, and Q8_0's int8 activations can turn a
    # 1e-7 difference into a ~1e-3 one (one int8 code moved, some CPUs), which the tiny random Gated DeltaNet model
    # carries on in its state from step to step (an AMD EPYC VM: a flip at step 6 with the top two 0.055 apart):
    # tokens must agree up to a pick whose top two are within 0.1 nats, never at a clear margin
    from moestream import SamplingParams

    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    tapped = [o.token_ids for o in llm.generate(PROMPTS, sp)]
    for want, got, out in zip(runs["stack"][0], tapped, ref_logprobs(path, sp)):
        for i, (a, b) in enumerate(zip(want, got)):
            if a != b:
                top = out.logprobs[i][1]
                assert top[0][1] - top[1][1] < 0.1, (i, top)
                break
    plan = llm.engine.model.cpu_decode
    assert plan.steps >= 7 and plan.stack_steps == 0
    llm.close()
    assert int(read_trace(trace).step_decode.sum()) >= 7  # every decode step's routes reached the recorder


@pytest.mark.parametrize("backend", ["fused", "cpu"])
def test_gated_deltanet_model_compiles_every_layer(backend, tmp_path, tiny_checkpoint, monkeypatch):
    """Qwen3.5 (3 Gated DeltaNet layers, 1 attention layer, fused shared-expert MoE blocks): every layer and every
    MoE block is one call, and a batch of 3 prompts x 8 tokens gives the per-op path's tokens and runtime
    statistics. (The recurrent state advances at each step, so logits cannot be compared by running a step twice.)"""
    from moestream import LLM
    from moestream.models.cpu_decode import M

    path = _gguf("qwen35_causal", "Q8_0", tmp_path, tiny_checkpoint)
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("MOESTREAM_CPU_DECODE_LAYER", flag)
        llm = LLM(path, device="cpu", dtype="float32", moe_backend=backend, max_running_requests=4)
        tokens = _generate(llm, 8)
        st = llm.engine.runtime.stats()
        runs[flag] = tokens, st["total"], st["layers"], st.get("expert_hits")
        plan = llm.engine.model.cpu_decode
        assert (plan.steps >= 7) == (flag == "1")
    n = len(llm.engine.model.layers)
    assert all(d is not None for d in plan.descs) and all(d is not None for d in plan.moe) and len(plan.moe) == n
    assert all(d[M["FW"]] != 0 for d in plan.moe)  # the fused [router | shared gate | up | gate] GEMM
    assert plan.kinds.count("gdn") == 3
    # value heads of 16 channels, half a Q8_0 block: out_proj keeps the file's tiled head order, the call gathers
    from moestream.models.cpu_decode import F_OUT_TILED, G

    assert all(d[G["FLAGS"]] & F_OUT_TILED for d, k in zip(plan.descs, plan.kinds) if k == "gdn")
    assert runs["0"] == runs["1"]


def test_16_bit_activations_stay_per_op(tiny_checkpoint):
    """The call computes in float32: a bfloat16 model decodes on the per-op path (and still decodes)."""
    from moestream import LLM

    llm = LLM(tiny_checkpoint("qwen3"), device="cpu", dtype="bfloat16")
    assert len(_generate(llm, 3)[0]) == 3
    assert llm.engine.model.cpu_decode.steps == 0


def test_fused_block_with_its_own_router(tmp_path, tiny_checkpoint, monkeypatch):
    """A fused block whose router stayed its own GEMM (router_rows 0: shared_in is [shared gate | up | gate]):
    ms_moe_decode takes the logits from the router's product; tokens match the per-op path."""
    from torch import nn

    from moestream import LLM
    from moestream.models.cpu_decode import M
    from moestream.models.fuse import FusedLinear

    path = _gguf("qwen35_attn", "Q8_0", tmp_path, tiny_checkpoint)
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("MOESTREAM_CPU_DECODE_LAYER", flag)
        llm = LLM(path, device="cpu", dtype="float32", max_running_requests=4)
        for block in llm.engine.model.moe_blocks():
            e, f = block.router_rows, block.shared_in
            assert e > 0
            block.shared_in = FusedLinear(f.weight.detach()[e:].clone(), f.sizes[1:])
            del block.gate.weight
            block.gate.weight = nn.Parameter(f.weight.detach()[:e].clone(), requires_grad=False)
            block.router_rows = 0
        llm.engine.model.cpu_decode = None  # the engine's plan read the modules replaced here: made again
        runs[flag] = _generate(llm, 8), llm.engine.runtime.stats()["total"]
        plan = llm.engine.model.cpu_decode
    assert all(d is not None and d[M["FW"]] and not d[M["FROUTER"]] and d[M["RW"]] for d in plan.moe)
    assert plan.steps >= 7 and runs["0"] == runs["1"]


@pytest.mark.parametrize("kind,qtype", [("qwen3", "Q8_0"), ("llama", "Q4_0"),
                                        ("qwen35_attn", "Q8_0")])
def test_one_call_step_gives_the_stack_calls_logits(kind, qtype, tmp_path, tiny_checkpoint):
    """ms_decode_logits (embedding, every layer, final norm and vocabulary head in one call) against the stack call
    followed by the head module: the same logits to the bit (top-5 log-probabilities of every step, batch of 2),
    the same tokens; a step where not every row samples (prompt logprobs) or a plan without its stack call takes the
    other path."""
    from moestream import LLM, SamplingParams

    path = _gguf(kind, qtype, tmp_path, tiny_checkpoint)
    llm = LLM(path, device="cpu", dtype="float32", max_running_requests=4)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, temperature=0))  # the plan is made at a decode step
    plan = llm.engine.model.cpu_decode
    assert plan.io is not None, "the tiny GGUF's embedding and head are ones the one-call step computes"
    calls = []
    one_call = plan.logits
    plan.logits = lambda batch: calls.append(batch.input_ids.numel()) or one_call(batch)
    runs = {}
    for mode in ("one_call", "stack"):
        if mode == "stack":
            plan.logits = lambda batch: None
        outs = llm.generate(PROMPTS[:2], sp)
        runs[mode] = [(o.token_ids, o.logprobs) for o in outs]
        assert all(o.logprobs and len(o.logprobs) == 6 for o in outs)
    assert calls and max(calls) == 2  # batch-2 decode steps went through the one call
    assert runs["one_call"] == runs["stack"]
    llm.close()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])  # Q4_K: tests/test_cpu_kernels.py (tiny models lack K % 256)
def test_interleaved_dense_weights_in_the_plan(qtype, tmp_path, tiny_checkpoint, monkeypatch):
    """A plan built with repacking on reads its 4-bit dense projections from 8-row interleaved copies (their type ids
    in the descriptions, the bytes counted); its decode log-probabilities are the GGUF layout's to float rounding;
    MOESTREAM_CPU_REPACK=0 keeps the GGUF bytes."""
    from moestream import LLM, SamplingParams
    from moestream.models.cpu_decode import D

    path = _gguf("llama", qtype, tmp_path, tiny_checkpoint)
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=5)
    runs = {}
    for repack in ("1", "0"):
        monkeypatch.setenv("MOESTREAM_CPU_REPACK", repack)
        llm = LLM(path, device="cpu", dtype="float32", max_running_requests=4)
        runs[repack] = llm.generate(PROMPTS[:2], sp)
        plan = llm.engine.model.cpu_decode
        seg_types = {int(d[D["SEG0"] + 1]) for d in plan.descs if d is not None}
        x8 = cpu_quant.X8_TYPES[qtype][0]
        if repack == "1":
            assert plan.repack.nbytes > 0 and x8 in seg_types | {int(d[D["TO"]]) for d in plan.descs if d is not None}
        else:
            assert plan.repack is None and x8 not in seg_types
        llm.close()
    for a, b in zip(runs["1"], runs["0"]):
        (lp_a, top_a), (lp_b, top_b) = a.logprobs[0], b.logprobs[0]  # the first decode step: the same context
        assert abs(lp_a - lp_b) < 1e-3
        assert [t for t, _ in top_a] == [t for t, _ in top_b] or max(abs(x - y) for (_, x), (_, y) in zip(top_a, top_b)) < 1e-3


def test_interleaved_routed_experts_in_the_plan(tmp_path, tiny_checkpoint, monkeypatch):
    """Routed experts' 4-bit projections are read from interleaved copies too (one type a projection: the MoE
    descriptions' gate / up ids are the interleaved type's, a Q5_0 down projection (no interleaved layout) stays as
    stored; every expert's
    row of the table points into the copy); decode log-probabilities are the GGUF layout's to float rounding; where
    the host could not keep the copy beside the file's bytes none is made."""
    import gguf_writer
    from gguf import GGMLQuantizationType as Q

    from moestream import LLM, SamplingParams
    from moestream.models import cpu_decode
    from moestream.models.cpu_decode import M

    path = gguf_writer.write_gguf(tiny_checkpoint("qwen3"), tmp_path / "m.gguf", Q.Q4_1,
                                  expert_qtype=lambda layer, proj: Q.Q5_0 if proj == "down_proj" else Q.Q4_1)[0]
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=5)
    x8, q8 = cpu_quant.X8_TYPES["Q4_1"][0], cpu_quant.TYPES["Q5_0"]
    runs = {}
    for repack in ("1", "0", "full"):
        monkeypatch.setenv("MOESTREAM_CPU_REPACK", "0" if repack == "0" else "1")
        if repack == "full":  # no room for any copy
            monkeypatch.setattr(cpu_decode, "REPACK_RESERVE", 1 << 60)
        llm = LLM(path, device="cpu", dtype="float32", max_running_requests=4)
        runs[repack] = llm.generate(PROMPTS[:2], sp)
        plan = llm.engine.model.cpu_decode
        blocks = [d for d in plan.moe if d is not None]
        assert blocks
        for d in blocks:
            types = (int(d[M["TG"]]), int(d[M["TU"]]), int(d[M["TD"]]))
            assert types == ((x8, x8, q8) if repack == "1" else (cpu_quant.TYPES["Q4_1"],) * 2 + (q8,))
            if repack == "1":
                table = np.ctypeslib.as_array(ctypes.cast(int(d[M["TABLE"]]), ctypes.POINTER(ctypes.c_int64)),
                                              shape=(int(d[M["E"]]), 3))
                held = [(a.ctypes.data, a.ctypes.data + a.nbytes) for a in plan.repack.arrays.values()]
                assert all(any(lo <= p < hi for lo, hi in held) for p in table[:, :2].ravel().tolist())
        llm.close()
    for other in ("0", "full"):
        for a, b in zip(runs["1"], runs[other]):
            (lp_a, top_a), (lp_b, top_b) = a.logprobs[0], b.logprobs[0]  # the first decode step: the same context
            assert abs(lp_a - lp_b) < 1e-3
            assert [t for t, _ in top_a] == [t for t, _ in top_b] or \
                max(abs(x - y) for (_, x), (_, y) in zip(top_a, top_b)) < 1e-3


def test_prefill_reads_the_plans_interleaved_copies(tmp_path, tiny_checkpoint, monkeypatch):
    """Once the CPU decode plan made its interleaved copies (routed experts' Q4_1 gate / up, Q4_1 dense projections), a
    prompt's calls read them (moe/cpu_moe.attach_x8, QuantLinear.x8): the expert layer calls name the copies' types
    and no Q4_1 product reads the file's layout (the file's bytes of those matrices are not touched); the prompt's
    log-probabilities are the file layout's (MOESTREAM_CPU_REPACK=0) to float rounding. Without copies the prompt
    reads the file's layout."""
    import gguf_writer
    from gguf import GGMLQuantizationType as Q

    from moestream import LLM, SamplingParams

    path = gguf_writer.write_gguf(tiny_checkpoint("qwen3"), tmp_path / "m.gguf", Q.Q4_1,
                                  expert_qtype=lambda layer, proj: Q.Q5_0 if proj == "down_proj" else Q.Q4_1)[0]
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=3)
    q41 = cpu_quant.TYPES["Q4_1"]
    seen = {"moe": [], "rows": [], "x8": 0}
    moe_layer, rows_matmul, x8_matmul = cpu_quant.moe_layer, cpu_quant.rows_matmul, cpu_quant.x8_matmul

    def rec_moe(x, wptr, types, *a, **k):
        seen["moe"].append(tuple(types))
        return moe_layer(x, wptr, types, *a, **k)

    def rec_rows(x, raw2d, type_id):
        seen["rows"].append(type_id)
        return rows_matmul(x, raw2d, type_id)

    def rec_x8(*a):
        seen["x8"] += 1
        return x8_matmul(*a)

    monkeypatch.setattr(cpu_quant, "moe_layer", rec_moe)
    monkeypatch.setattr(cpu_quant, "rows_matmul", rec_rows)
    monkeypatch.setattr(cpu_quant, "x8_matmul", rec_x8)
    runs = {}
    for repack in ("1", "0"):
        monkeypatch.setenv("MOESTREAM_CPU_REPACK", repack)
        llm = LLM(path, device="cpu", dtype="float32", max_running_requests=4)
        llm.generate([PROMPTS[1]], sp)  # (the engine made the plan and its copies at start)
        assert llm.engine.model.cpu_decode is not None
        seen.update(moe=[], rows=[], x8=0)
        runs[repack] = llm.generate([PROMPTS[2]], sp)[0]
        assert seen["moe"], "the prompt's experts went elsewhere"
        if repack == "1":
            assert all(t[:2] == ("Q4_1_x8",) * 2 and t[2] == "Q5_0" for t in seen["moe"]), seen["moe"]
            assert q41 not in seen["rows"] and seen["x8"] > 0
        else:
            assert all(t == ("Q4_1", "Q4_1", "Q5_0") for t in seen["moe"]) and q41 in seen["rows"] and not seen["x8"]
        llm.close()
    a, b = runs["1"].prompt_logprobs, runs["0"].prompt_logprobs
    assert len(a) == len(b) == len(PROMPTS[2])
    n = 0
    for pa, pb in zip(a, b):
        if pa is None or pb is None:
            continue
        (lp_a, top_a), (lp_b, top_b) = pa, pb
        assert abs(lp_a - lp_b) < 1e-3
        n += 1
    assert n >= len(PROMPTS[2]) - 1


def test_compressed_shared_expert_stays_compressed_and_compiles(tmp_path, tiny_checkpoint, monkeypatch):
    """A shared expert whose three projections are all GGUF blocks (a real Qwen3.5/3.6 GGUF's: I = 512) is not
    densified to join the router's GEMM (models/fuse.py): it stays compressed, the compiled MoE call computes it as an
    unfused shared expert, and the tokens are the per-op path's."""
    import gguf_writer
    from gguf import GGMLQuantizationType as Q

    from moestream import LLM
    from moestream.layers.quant_linear import QuantLinear
    from moestream.models.cpu_decode import M

    hf = tiny_checkpoint("qwen35_causal", shared_expert_intermediate_size=64)  # 64 columns: whole Q8_0 blocks
    path = gguf_writer.write_gguf(hf, tmp_path / "m.gguf", Q.Q8_0)[0]
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("MOESTREAM_CPU_DECODE_LAYER", flag)
        llm = LLM(path, device="cpu", dtype="float32", max_running_requests=4)
        runs[flag] = _generate(llm, 8)
        blocks = llm.engine.model.moe_blocks()
        assert all(b.shared_in is None and isinstance(b.shared_expert.gate_proj, QuantLinear)
                   and isinstance(b.shared_expert.down_proj, QuantLinear) for b in blocks)
        plan = llm.engine.model.cpu_decode
        if flag == "1":
            assert plan.steps >= 7 and all(d is not None and d[M["FW"]] == 0 and d[M["SI"]] == 64 for d in plan.moe)
        llm.close()
    assert runs["0"] == runs["1"]


@pytest.mark.parametrize("kind", ["qwen3", "qwen35_causal"])
def test_decode_fast_build_is_the_general_build(kind, tmp_path, tiny_checkpoint, monkeypatch):
    """The runner's CPU decode fast path (every sequence decodes its newest token: indices in one host buffer the
    compiled step reads by address) builds the batch the general build does — ids, positions, KV indices, write
    slots, logits rows, state slots — for a batch of 3 sequences of different lengths crossing KV pages; and with
    it off (the general build every step) the same tokens and log-probabilities come out."""
    from moestream import LLM, SamplingParams
    from moestream.engine.runner import ModelRunner

    path = _gguf(kind, "Q8_0", tmp_path, tiny_checkpoint)
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=3)
    llm = LLM(path, device="cpu", dtype="float32", max_running_requests=4, prefix_cache=False)
    runner = llm.llm_engine.runner
    fast = ModelRunner._build_decode
    compared = []

    def check(sched, kv):
        batch, rows = fast(sched, kv)
        ref, ref_rows = runner._build_general(sched)
        for name in ("input_ids", "positions", "kv_write_index", "logits_index", "state_slots"):
            assert torch.equal(getattr(batch, name), getattr(ref, name)), name
        assert [(q.start, q.length, q.cached, q.state_slot, q.kv_index.tolist(), q.snapshots) for q in batch.seqs] \
            == [(q.start, q.length, q.cached, q.state_slot, q.kv_index.tolist(), q.snapshots) for q in ref.seqs]
        assert (rows.logits, rows.sample, rows.split) == (ref_rows.logits, ref_rows.sample, ref_rows.split)
        compared.append(len(batch.seqs))
        return batch, rows

    monkeypatch.setattr(ModelRunner, "_build_decode", staticmethod(check))
    got = [(o.token_ids, o.logprobs) for o in llm.generate(PROMPTS, sp)]
    assert max(compared) == 3 and len(compared) >= 19
    plan = llm.engine.model.cpu_decode
    assert plan.stack_steps >= 19  # the one-call step read the fast path's buffer
    monkeypatch.setattr(ModelRunner, "_build_decode", staticmethod(lambda sched, kv: runner._build_general(sched)))
    assert [(o.token_ids, o.logprobs) for o in llm.generate(PROMPTS, sp)] == got


def test_step_profile_counts_each_part_once_a_layer(tmp_path, tiny_checkpoint):
    """ms_decode_profile (benchmarks/cpu_step_profile.py): with it on, a one-call step counts its embedding and head
    once, each attention layer's parts once a layer and each MoE block's once a block; off, nothing more is counted; the same
    tokens either way."""
    from moestream import LLM, SamplingParams

    path = _gguf("qwen3", "Q8_0", tmp_path, tiny_checkpoint)
    llm = LLM(path, device="cpu", dtype="float32", max_running_requests=4)
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    plain = llm.generate(PROMPTS[:1], sp)[0].token_ids
    plan, mod = llm.engine.model.cpu_decode, cpu_quant.module()
    layers, blocks = len(plan.descs), sum(m is not None for m in plan.moe)
    n = mod.ms_decode_profile(1, None, None)
    steps = plan.stack_steps
    assert llm.generate(PROMPTS[:1], sp)[0].token_ids == plain
    steps = plan.stack_steps - steps
    secs, counts = np.zeros(n), np.zeros(n, dtype=np.int64)
    mod.ms_decode_profile(0, secs.ctypes.data, counts.ctypes.data)
    assert steps == 4 and (secs >= 0).all()
    embed, qkv, experts, head = 0, 2, 8, 15  # decode.cpp's P_EMBED, P_QKV, P_EXPERTS, P_HEAD
    assert counts[embed] == counts[head] == steps
    assert counts[qkv] == steps * layers and counts[experts] == steps * blocks and secs[experts] > 0 and blocks
    llm.generate(PROMPTS[:1], sp)
    again = np.zeros(n, dtype=np.int64)
    mod.ms_decode_profile(0, None, again.ctypes.data)
    assert (again == counts).all()  # off: nothing counted
    llm.close()


@pytest.mark.parametrize("kind,dtype", [(1, torch.float16), (2, torch.float8_e4m3fn)])
def test_kv_rows_written_and_widened_as_torch_does(kind, dtype):
    """decode.cpp's KV row codecs (store_row; load_row and the attention's in-register kv8) against torch: float16
    rounded to nearest even; e4m3fn saturated at +-448 and rounded to nearest even, as layers/attention.kv_write's
    `clamp(-448, 448).to(torch.float8_e4m3fn)` — bit for bit on every e4m3fn code, every midpoint between two (ties),
    values beyond the range and random ones."""
    from test_kv_fp8 import encode_inputs  # (every code, the ties between them, out of range, random)

    from moestream.kernels import cpu_quant

    if not cpu_quant.available():
        pytest.skip("CPU kernels not built")
    x = encode_inputs()
    x = x[: len(x) // 8 * 8].contiguous()
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    want_codes = (x.clamp(-448, 448) if kind == 2 else x).to(dtype)
    pool = torch.zeros(len(x), dtype=dtype)
    back, back8 = torch.empty_like(x), torch.full_like(x, float("nan"))
    wrote8 = cpu_quant.module().ms_kv_roundtrip(kind, x.data_ptr(), len(x), pool.data_ptr(), back.data_ptr(),
                                                back8.data_ptr())
    bits = torch.int16 if kind == 1 else torch.uint8
    assert torch.equal(pool.view(bits), want_codes.view(bits))  # the codes written
    want = want_codes.float()
    assert torch.equal(back.view(torch.int32), want.view(torch.int32))  # widened exactly (signed zeros too)
    if wrote8:
        assert torch.equal(back8.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("kind", ["qwen3", "qwen35"])
def test_bf16_checkpoint_keeps_16_bit_experts_and_compiles_its_moe_blocks(kind, tiny_checkpoint):
    """A bf16 safetensors checkpoint on a CPU with --dtype auto computes in float32 with its routed experts and linear
    weights left in their bf16 rows (half the host memory and the bytes a step reads of float32 copies): every layer
    and MoE block is one
    compiled call (the layer kernel reads bf16 rows against float32 activations), and the tokens are those of the
    same checkpoint with float32 experts on the per-op path (--dtype float32)."""
    from moestream import LLM

    path = tiny_checkpoint(kind, dtype=torch.bfloat16)
    ref = LLM(path, device="cpu", dtype="float32", max_running_requests=4)
    want = _generate(ref, 8)
    assert ref.engine.runtime.ctx.store.fmt.dtype == torch.float32
    assert not any(d is not None for d in ref.engine.model.cpu_decode.moe)
    llm = LLM(path, device="cpu", max_running_requests=4)
    assert llm.engine.dtype == torch.float32
    store = llm.engine.runtime.ctx.store
    assert store.fmt.dtype == torch.bfloat16
    assert all(a.dtype == torch.bfloat16 for layer in store.moe_layers for a in store.bank(layer).values())
    model = llm.engine.model
    lin = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert sum(m.weight.dtype == torch.bfloat16 for m in lin) >= len(model.layers)  # dense rows kept 16-bit too
    assert _generate(llm, 8) == want
    plan = llm.engine.model.cpu_decode
    assert plan.steps >= 7 and sum(d is not None for d in plan.moe) == len(store.moe_layers)
    assert plan.layers == len(model.layers)

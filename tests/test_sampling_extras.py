"""logprobs, penalties, logit_bias, min_tokens, prompt logprobs, the thinking budget and grammar masks, in
the engine (offline API) on the tiny random checkpoint."""
from __future__ import annotations

import json
import random

import pytest
import torch

from moestream import LLM, SamplingParams
from moestream.core import RequestError
from moestream.engine.sampler import PenaltyState, apply_penalties


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("qwen35"), device="cpu", dtype="float32")


def _reference_penalties(logits: list[float], p: SamplingParams, prompt: list[int], output: list[int],
                         stops: set[int]) -> list[float]:
    """The OpenAI / vLLM definitions written out token by token."""
    x = list(logits)
    if len(output) < p.min_tokens:
        for t in stops:
            x[t] = float("-inf")
    for t, b in p.logit_bias.items():
        x[t] += b
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        c = output.count(t)
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x


@pytest.mark.parametrize("kw", [dict(presence_penalty=0.7), dict(frequency_penalty=-0.4),
                                dict(repetition_penalty=1.3), dict(repetition_penalty=0.8, frequency_penalty=1.1,
                                                                   presence_penalty=-1.5),
                                dict(logit_bias={3: 5.0, 7: -100.0}), dict(min_tokens=5, max_tokens=9)])
def test_penalties_match_reference(kw):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, generator=g) * 3
    prompt, output = [1, 2, 2, 5, 39], [5, 5, 9, 1, 12, 5, 30]
    p = SamplingParams(**kw)
    got = apply_penalties(logits.clone(), p, prompt, output[:4], {0, 11})
    want = _reference_penalties(logits.tolist(), p, prompt, output[:4], {0, 11})
    assert torch.allclose(got, torch.tensor(want), atol=1e-5), (got, want)
    assert not torch.equal(got, logits)  # the test can fail: something changed
    state = PenaltyState()  # kept from step to step as the model runner keeps it: the same rows at every length
    for n in range(len(output) + 1):
        got = apply_penalties(logits.clone(), p, prompt, output[:n], {0, 11}, state)
        want = _reference_penalties(logits.tolist(), p, prompt, output[:n], {0, 11})
        assert torch.allclose(got, torch.tensor(want), atol=1e-5), (n, got, want)


def _step_seconds(p: SamplingParams, prompt: list[int], steps: int = 15) -> tuple[float, float]:
    """(first step, median of the next ones): seconds of a request's logits processing per decode step,
    with its state kept between steps as the model runner keeps it."""
    import statistics
    import time

    row, state, output, times = torch.randn(151936), PenaltyState(), [], []
    for i in range(steps + 1):
        x = row.clone()
        t0 = time.perf_counter()
        apply_penalties(x, p, prompt, output, state=state)
        times.append(time.perf_counter() - t0)
        output.append(i)
    return times[0], statistics.median(times[1:])


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("kw,prompt", [
    (dict(repetition_penalty=1.1, frequency_penalty=0.5), list(range(128_000)) * 2),
    (dict(logit_bias={t: 0.5 for t in range(151936)}), list(range(100)))], ids=["long prompt", "full bias"])
def test_a_steps_penalty_work_does_not_repeat_the_prompt_or_the_bias(kw, prompt):
    """Every running request pays for each request's logits processing in every step. A 256k-token prompt
    with repetition_penalty, or a logit_bias over the whole vocabulary, cost tens of milliseconds in every
    step (the prompt's ids set and the bias tensor were built again each time); kept in the request's state,
    they are built once, and later steps cost a small part of the first."""
    first, later = _step_seconds(SamplingParams(**kw), prompt)
    assert later < first / 4, (first, later)


def test_the_runner_keeps_each_requests_penalty_state(llm, monkeypatch):
    """The step loop builds a request's penalty tensors once and keeps them on the request: two requests of
    6 tokens make two states, not one per request and step (which rebuilds the prompt's ids and the bias)."""
    made, init = [], PenaltyState.__init__
    monkeypatch.setattr(PenaltyState, "__init__", lambda self: (made.append(1), init(self))[1])
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, repetition_penalty=1.3, logit_bias={3: 1.0})
    outs = llm.generate([[5, 6, 7], [8, 9]], p)
    assert [len(o.token_ids) for o in outs] == [6, 6] and len(made) == 2


def test_bad_extra_params():
    for kw in ({"presence_penalty": 3}, {"repetition_penalty": 0}, {"logit_bias": {1: 200}}, {"logprobs": 21},
               {"min_tokens": 5, "max_tokens": 2}, {"max_thinking_tokens": -1}):
        with pytest.raises(RequestError):
            SamplingParams(**kw)


def _capture(llm):
    """Record the logits every step computes (the engine's, before any processing)."""
    seen = []
    fwd = llm.engine.forward

    def forward(batch):
        out = fwd(batch)
        seen.append(out.clone())
        return out

    llm.engine.forward = forward
    return seen, lambda: setattr(llm.engine, "forward", fwd)


def test_logprobs_are_log_softmax_of_engine_logits(llm):
    seen, undo = _capture(llm)
    try:
        out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=6, temperature=1.0, seed=3, logprobs=4,
                                                            ignore_eos=True, presence_penalty=1.0))[0]
    finally:
        undo()
    assert len(out.logprobs) == len(out.token_ids) == len(seen) == 6
    for tok, (lp, alts), logits in zip(out.token_ids, out.logprobs, seen):
        ref = torch.log_softmax(logits[0].double(), -1)
        assert abs(lp - ref[tok].item()) < 1e-4
        top = torch.topk(ref, 4)
        assert [a for a, _ in alts] == top.indices.tolist()
        assert all(abs(v - w) < 1e-4 for (_, v), w in zip(alts, top.values.tolist()))


def test_prompt_logprobs_match_a_full_forward(llm):
    prompt = [5, 6, 7, 8, 9, 10, 11]
    seen, undo = _capture(llm)
    llm.scheduler.chunk, chunk = 3, llm.scheduler.chunk  # chunked prefill: rows come from three steps
    try:
        out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))[0]
    finally:
        undo()
        llm.scheduler.chunk = chunk
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    # a greedy continuation from each prefix gives the reference distribution at that position
    for k in range(1, len(prompt)):
        ref_seen, undo = _capture(llm)
        try:
            llm.generate([prompt[:k]], SamplingParams(max_tokens=1, temperature=0))
        finally:
            undo()
        ref = torch.log_softmax(ref_seen[-1][0].double(), -1)
        lp, alts = out.prompt_logprobs[k]
        assert abs(lp - ref[prompt[k]].item()) < 1e-4, k
        assert [a for a, _ in alts] == torch.topk(ref, 2).indices.tolist()


def test_prompt_logprob_rows_per_step_are_bounded(llm, monkeypatch):
    """SchedulerConfig.logit_rows (on a GPU: what the plan's workspace holds of [rows, vocabulary] logits): a
    prompt_logprobs request's prefill takes at most that many positions a step, another request's prefill beside it
    is not held back, and the prompt logprobs are those of an unbounded run."""
    import dataclasses

    prompt, other = [5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24, 25, 26, 27, 28]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)
    want = llm.generate([prompt], params)[0].prompt_logprobs
    sched = llm.scheduler
    steps = []
    plan = sched._plan

    def spy():
        out = plan()
        steps.append([(r.prompt_ids[:1], n) for r, n in out])
        return out

    monkeypatch.setattr(sched, "_plan", spy)
    monkeypatch.setattr(sched, "config", dataclasses.replace(sched.config, logit_rows=2))
    outs = llm.generate([prompt, other], [params, SamplingParams(max_tokens=1, temperature=0)])
    got = outs[0].prompt_logprobs
    assert got[0] is None and len(got) == len(want)
    for (lp, alts), (wlp, walts) in zip(got[1:], want[1:]):  # (other chunk boundaries: float32 sums differ slightly)
        assert abs(lp - wlp) < 1e-4 and [a for a, _ in alts] == [a for a, _ in walts]
    assert [n for s in steps for p0, n in s if p0 == prompt[:1]] == [2, 2, 2, 1]  # 7 prompt tokens, 2 a step
    assert (other[:1], len(other)) in steps[0]  # the other prompt: one step


def test_logit_rows_from_the_plan_on_a_gpu():
    from types import SimpleNamespace

    from moestream.engine.llm_engine import LOGIT_BYTES, logit_rows

    plan = SimpleNamespace(bytes=SimpleNamespace(workspace=384 << 20))
    cfg = SimpleNamespace(vocab_size=248320)
    assert logit_rows(SimpleNamespace(plan=plan, device=torch.device("cuda"), cfg=cfg)) == \
        (384 << 20) // (248320 * LOGIT_BYTES) == 135
    assert logit_rows(SimpleNamespace(plan=plan, device=torch.device("cpu"), cfg=cfg)) == 0


def test_logit_bias_and_min_tokens_steer_generation(llm):
    p = [5, 6, 7, 8]
    out = llm.generate([p], SamplingParams(max_tokens=5, temperature=0, logit_bias={42: 100.0}))[0]
    assert out.token_ids == [42] * 5
    eos = next(iter(llm.scheduler.eos))
    early = llm.generate([p], SamplingParams(max_tokens=6, temperature=0, logit_bias={eos: 100.0}))[0]
    assert early.token_ids == [eos] and early.finish_reason == "stop"
    late = llm.generate([p], SamplingParams(max_tokens=6, temperature=0, logit_bias={eos: 100.0}, min_tokens=3))[0]
    assert len(late.token_ids) == 4 and late.token_ids[-1] == eos and eos not in late.token_ids[:3]


def test_penalties_change_greedy_repeats(llm):
    p = [5, 6, 7, 8]
    base = llm.generate([p], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                            logit_bias={42: 3.0}))[0].token_ids
    pen = llm.generate([p], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logit_bias={42: 3.0},
                                           frequency_penalty=2.0, presence_penalty=2.0))[0].token_ids
    assert max(pen.count(t) for t in set(pen)) <= max(base.count(t) for t in set(base))
    assert pen != base


def test_thinking_budget_closes_the_block(llm):
    tok = llm.tokenizer
    think, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    prompt = tok.encode("hello") + [think]
    budget = 4
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, reasoning_open=True,
                                                max_thinking_tokens=budget, logit_bias={end: -100.0}))[0]
    close = llm.llm_engine.runner.think_close
    assert out.token_ids[budget:budget + len(close)] == close
    assert end not in out.token_ids[:budget] and len(out.token_ids) == 12


def test_grammar_constrains_random_weights(llm):
    from moestream.tokenizer.grammar import compile_grammar

    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
                  "required": ["age"], "additionalProperties": False}},
        "required": ["name", "kind", "tags", "owner"], "additionalProperties": False}
    g = compile_grammar("json_schema", schema)
    prompt = llm.tokenizer.encode("Give me JSON:")
    params = [SamplingParams(max_tokens=120, temperature=1.0, seed=s, grammar=g) for s in range(12)]
    outs = llm.generate([prompt] * len(params), params)
    for o in outs:
        value = json.loads(o.text)
        assert set(value) == {"name", "kind", "tags", "owner"} and value["kind"] in ("cat", "dog", "bird")
        assert len(value["name"]) <= 6 and len(value["tags"]) <= 3 and 0 <= value["owner"]["age"] <= 120
        assert o.finish_reason == "stop"
    free = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=1.0, seed=0))[0].text
    with pytest.raises(ValueError):
        json.loads(free)  # without the grammar the random model writes no JSON


def test_seeded_requests_are_independent_of_batching(llm):
    prompt = [5, 6, 7]
    ps = [SamplingParams(max_tokens=6, temperature=1.0, seed=100 + i, ignore_eos=True) for i in range(4)]
    together = [o.token_ids for o in llm.generate([prompt] * 4, ps)]
    alone = [llm.generate([prompt], p)[0].token_ids for p in ps]
    assert together == alone and len({tuple(t) for t in together}) > 1


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder"])
def test_forced_tool_call_grammars_parse_against_the_schema(fmt, tmp_path):
    """A uniform random walk over the tokens each grammar allows always ends in a call the server's parser
    reads, with arguments of the declared types."""
    from moestream.demo_tokenizer import build_tokenizer
    from moestream.server.parsers import HermesToolParser, Qwen3CoderToolParser
    from moestream.tokenizer import Tokenizer
    from moestream.tokenizer.grammar import Grammars, tool_call_grammar, xml_tool_call_grammar

    build_tokenizer(tmp_path)
    tok = Tokenizer.from_pretrained(tmp_path)
    tools = [{"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}, "hourly": {"type": "boolean"}},
        "required": ["city", "unit", "days"], "additionalProperties": False}}]
    special = {t: tok.token_to_id(t) for t in ("<tool_call>", "</tool_call>")}
    make, parser_cls = ((tool_call_grammar, HermesToolParser) if fmt == "hermes"
                        else (xml_tool_call_grammar, Qwen3CoderToolParser))
    grammars = Grammars(tok, 600, tok.eos_token_ids)
    g = make(tools, special)
    for seed in range(10):
        rng = random.Random(seed)
        m, out = grammars.matcher(g), []
        for _ in range(300):
            allowed = [t for t in m.allowed().nonzero().flatten().tolist() if t not in tok.eos_token_ids]
            if not allowed:
                break
            t = rng.choice(allowed)
            assert m.consume(t)
            out.append(t)
            if m.done:
                break
        text = tok.decode(out, skip_special_tokens=False)
        parser = parser_cls([{"type": "function", "function": {"name": "get_weather",
                                                                 "parameters": tools[0]["parameters"]}}])
        calls = [e for e in parser.feed(text) + parser.finish() if not isinstance(e, str)]
        assert len(calls) == 1, text
        args = json.loads(calls[0].arguments)
        assert calls[0].name == "get_weather" and args.get("unit") in ("c", "f") and 1 <= args["days"] <= 7, text
        assert isinstance(args["days"], int) and isinstance(args.get("hourly", True), bool), text


def test_n_children_copy_the_parent_prefill(llm):
    """Choices 1..n-1 of an n > 1 request copy choice 0's prompt K/V and linear state instead of prefilling:
    same tokens as four independent seeded requests, the prompt computed once."""
    from moestream.scheduler.request import Request

    prompt = list(range(5, 45))
    ps = [SamplingParams(max_tokens=6, temperature=1.0, seed=70 + i, ignore_eos=True, logprobs=1) for i in range(4)]
    alone = [llm.generate([prompt], p)[0] for p in ps]
    sched, engine = llm.scheduler, llm.llm_engine
    reqs = [Request(f"fork-{i}", list(prompt), p, parent="fork-0" if i else None) for i, p in enumerate(ps)]
    for r in reqs:
        engine.add_request(r)
    assert len(sched.held["fork-0"]) == 3
    prefill = 0
    while any(r.finish_reason is None for r in reqs):
        engine.step()
        prefill += engine.last_step.get("prefill_tokens", 0)
    # once, not four times (less what the prefix cache held from the single runs above)
    assert prefill == len(prompt) - (reqs[0].cached_tokens or 0)
    assert all((r.cached_tokens or 0) == 0 for r in reqs[1:])  # the children copied, they did not look up
    assert [r.output_ids for r in reqs] == [a.token_ids for a in alone]
    for r, a in zip(reqs, alone):
        assert all(abs(x[0] - y[0]) < 1e-4 for x, y in zip(r.output_lps, a.logprobs))
    sched.check_integrity()
    cached = sched.prefix.num_evictable if sched.prefix is not None else 0
    assert not sched.held and sched.kv.pages.num_used == cached


def test_aborted_parent_lets_children_prefill(llm):
    from moestream.scheduler.request import Request

    engine = llm.llm_engine
    p = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    parent, kid = Request("par", [5, 6, 7], p), Request("kid", [5, 6, 7], p, parent="par")
    engine.add_request(parent)
    engine.add_request(kid)
    engine.abort("par")
    while kid.finish_reason is None:
        engine.step()
    assert kid.output_ids == llm.generate([[5, 6, 7]], p)[0].token_ids and not llm.scheduler.held


def test_structural_tag_grammar_constrains_only_the_tags(tmp_path):
    """Free text is free; a trigger starts a tag whose JSON must fit its schema and whose end is forced; a
    special-token trigger (the demo's <tool_call>) is matched as that token."""
    from moestream.demo_tokenizer import build_tokenizer
    from moestream.tokenizer import Tokenizer
    from moestream.tokenizer.grammar import Grammars, compile_grammar

    build_tokenizer(tmp_path)
    tok = Tokenizer.from_pretrained(tmp_path)
    grammars = Grammars(tok, tok.vocab_size, tok.eos_token_ids)
    eos = tok.eos_token_ids[0]
    ints = lambda key: {"type": "object", "properties": {key: {"type": "integer"}}, "required": [key],
                        "additionalProperties": False}
    text_tags = compile_grammar("structural_tag", {"triggers": ["<function="], "structures": [
        {"begin": "<function=add>", "schema": ints("a"), "end": "</function>"},
        {"begin": "<function=mul>", "schema": ints("b"), "end": "</function>"}]})
    special = {t: tok.token_to_id(t) for t in ("<tool_call>", "</tool_call>")}
    token_tags = compile_grammar("structural_tag", {"triggers": ["<tool_call>"], "structures": [
        {"begin": "<tool_call>\n", "schema": ints("x"), "end": "\n</tool_call>"}]}, special)

    def verdict(grammar, text):
        m = grammars.matcher(grammar)
        for t in tok.encode(text):
            if not m.consume(t):
                return "rejected"
        return "complete" if m.allowed()[eos] else "open"

    assert verdict(text_tags, "Just prose, no call at all.") == "complete"
    assert verdict(text_tags, 'Sum: <function=add>{"a":1}</function> and <function=mul>{"b":12}</function>!') \
        == "complete"
    assert verdict(text_tags, '<function=add>{"a":1}') == "open"  # the end is still owed
    assert verdict(text_tags, '<function=add>{"b":1}</function>') == "rejected"  # add's schema has no b
    assert verdict(text_tags, '<function=sub>{"a":1}</function>') == "rejected"  # no such tag
    assert verdict(text_tags, '<function=add>{"a":"one"}</function>') == "rejected"
    assert verdict(token_tags, 'Hi <tool_call>\n{"x":5}\n</tool_call> done') == "complete"
    assert verdict(token_tags, "Hi <tool_call>\nnot json") == "rejected"
    assert verdict(token_tags, 'Hi <tool_call>\n{"x":5}') == "open"

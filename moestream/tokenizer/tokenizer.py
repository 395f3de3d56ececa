"""Text <-> token ids, plus the model's chat template and stop (EOS) tokens.

Wraps a `tokenizers.Tokenizer` (the Rust fast tokenizer) so that encode/decode match
`transformers`' fast tokenizers exactly, without importing transformers at runtime.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers

from moestream.core import ConfigError
from moestream.tokenizer.chat_template import SPECIAL_TOKEN_NAMES, render_chat_template


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must contain a JSON object, got {type(data).__name__}")
    return data


def _token_string(value: Any, where: str) -> str | None:
    """A special token in tokenizer_config.json is a string, null, or an AddedToken-like dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ConfigError(f"{where}: expected a token string or {{'content': ...}}, got {value!r}")


def _pick_template(value: Any, where: str) -> str | None:
    """`chat_template` is a string, or a list of {"name", "template"} of which "default" is the chat one."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" not in named:
            raise ConfigError(f"{where}: chat_template lists templates {sorted(map(str, named))} but none named 'default'")
        return named["default"]
    raise ConfigError(f"{where}: chat_template must be a string or a list of {{name, template}}, got {type(value).__name__}")


def _eos_ids_from_generation_config(folder: Path) -> list[int]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return []
    value = _read_json(path).get("eos_token_id")
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"{path}: eos_token_id must be an integer or a list of integers, got {value!r}")
    return values


def _read_chat_template(folder: Path, config: dict) -> str | None:
    # A standalone chat_template.jinja is the newer layout and wins over the config's copy.
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _pick_template(config.get("chat_template"), str(folder / "tokenizer_config.json"))
    if template is None and (folder / "chat_template.json").is_file():
        # Older multimodal layout: {"chat_template": "..."} next to the processor config.
        template = _pick_template(_read_json(folder / "chat_template.json").get("chat_template"),
                                  str(folder / "chat_template.json"))
    return template


# Fill-in-the-middle markers (prefix, suffix, middle), in the order a FIM prompt holds them:
# PREFIX text SUFFIX text MIDDLE, and the model writes what goes between. Qwen2.5/3-Coder and Qwen3.5
# (with pipes), StarCoder (without), DeepSeek-Coder (begin / hole / end).
FIM_TOKENS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>", "<\uff5cfim\u2581end\uff5c>"),
)


class Tokenizer:
    """A model's tokenizer: encode/decode, special token ids and chat template rendering."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        chat_template: str | None = None,
        *,
        special_tokens: Mapping[str, str | None] | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        name_or_path: str | None = None,
    ) -> None:
        """Build from an in-memory fast tokenizer (e.g. one a GGUF loader assembled).

        special_tokens: names from SPECIAL_TOKEN_NAMES ("bos_token", "eos_token", "pad_token", ...)
            to token strings; they are resolved to ids and passed to the chat template.
        extra_eos_token_ids: more ids that end generation (generation_config.json's eos_token_id).
        """
        self._backend = backend
        self.chat_template = chat_template
        self.name_or_path = name_or_path
        self.special_tokens: dict[str, str] = {}
        for name, token in (special_tokens or {}).items():
            if name not in SPECIAL_TOKEN_NAMES:
                raise ConfigError(f"unknown special token name {name!r}; expected one of {SPECIAL_TOKEN_NAMES}")
            if token is None:
                continue
            # Generation depends on bos/eos ids; other names (pad, unk...) only feed the template,
            # and some configs name a pad/unk token the vocabulary lacks, so those resolve to None.
            if name in ("bos_token", "eos_token"):
                self._require_in_vocab(token, name)
            self.special_tokens[name] = token
        self.bos_token_id = self._named_id("bos_token")
        self.pad_token_id = self._named_id("pad_token")
        self.eos_token_ids = self._collect_eos_ids(extra_eos_token_ids)
        # Ids the backend drops on decode(skip_special_tokens=True): added tokens flagged special.
        self.special_added_token_ids = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        named_ids = [i for i in map(self.token_to_id, self.special_tokens.values()) if i is not None]
        self.all_special_ids: list[int] = list(dict.fromkeys(named_ids + sorted(self.special_added_token_ids)))

    # ------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> Tokenizer:
        """Load an HF-layout folder: tokenizer.json, tokenizer_config.json and optionally
        chat_template.jinja and generation_config.json."""
        folder = Path(path)
        if not folder.is_dir():
            raise ConfigError(f"tokenizer folder {str(folder)!r} does not exist or is not a directory")
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ConfigError(
                f"no tokenizer.json in {str(folder)!r}; moestream needs the fast-tokenizer file "
                "(models with only a sentencepiece/tiktoken vocabulary are not supported)"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust side raises a bare Exception for malformed files
            raise ConfigError(f"could not load {tokenizer_file}: {e}") from e
        config_file = folder / "tokenizer_config.json"
        config = _read_json(config_file) if config_file.is_file() else {}
        special = {name: _token_string(config.get(name), f"{config_file}: {name}") for name in SPECIAL_TOKEN_NAMES}
        return cls(
            backend,
            chat_template=_read_chat_template(folder, config),
            special_tokens=special,
            extra_eos_token_ids=_eos_ids_from_generation_config(folder),
            name_or_path=str(folder),
        )

    def _require_in_vocab(self, token: str, name: str) -> None:
        if self._backend.token_to_id(token) is None:
            raise ConfigError(f"{name} {token!r} is not in the tokenizer's vocabulary")

    def _named_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.token_to_id(token)

    def _collect_eos_ids(self, extra: Iterable[int]) -> list[int]:
        ids = [self._named_id("eos_token")] + [int(i) for i in extra]
        # Order-preserving union: the config's eos first, then generation_config's extras.
        return list(dict.fromkeys(i for i in ids if i is not None))

    # ------------------------------------------------------------ vocabulary

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (may be below the model's embedding rows)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens.get("pad_token")

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(int(token_id))

    def fim_ids(self) -> tuple[int, int, int] | None:
        """(prefix, suffix, middle) ids of the vocabulary's fill-in-the-middle tokens; None without them."""
        for names in FIM_TOKENS:
            ids = tuple(self.token_to_id(t) for t in names)
            if None not in ids:
                return ids  # type: ignore[return-value]
        return None

    # ------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def min_tokens(self, text: str) -> int:
        """A lower bound of len(encode(text)) found without encoding it (a long text's encoding takes seconds and
        gigabytes): the normalized text's UTF-8 bytes over the most bytes one token can stand for. 0 where no
        such bound holds: models other than BPE, or a BPE whose unknown-token piece may stand for any length."""
        per = self._max_token_bytes
        if not per:
            return 0
        norm = self._backend.normalizer
        return len((norm.normalize_str(text) if norm is not None else text).encode("utf-8")) // per

    @cached_property
    def _max_token_bytes(self) -> int:
        """The most UTF-8 bytes of normalized text one token stands for (0: unbounded). A byte-level vocabulary's
        strings have a character per byte they stand for; a SentencePiece-style one's are that text itself (its
        UTF-8 bytes), a byte-fallback piece <0xNN> stands for one byte (fewer than its own); added tokens match
        their own content."""
        b = self._backend
        model = b.model
        if type(model).__name__ != "BPE" or (model.unk_token is not None and not model.byte_fallback):
            return 0
        byte_level = "ByteLevel" in str(b.pre_tokenizer)
        sizes = [len(t) if byte_level else len(t.encode("utf-8")) for t in b.get_vocab(with_added_tokens=False)]
        sizes += [len(t.content.encode("utf-8")) for t in b.get_added_tokens_decoder().values()]
        return max(sizes, default=0)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------ chat

    def apply_chat_template(
        self,
        messages: Any,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        *,
        chat_template: str | None = None,
        documents: list[dict] | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render the conversation into the model's prompt format (ids if tokenize=True).

        Extra keyword arguments (e.g. enable_thinking=False) are visible to the template.
        """
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ConfigError(
                f"tokenizer {self.name_or_path or ''!r} has no chat template (no chat_template.jinja or "
                "chat_template in tokenizer_config.json); use plain completions or pass chat_template="
            )
        text = render_chat_template(
            template,
            messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            **kwargs,
        )
        # The template already wrote every special token it wants, so none are added on top.
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, eos_token_ids={self.eos_token_ids})"

"""Tokenization: encode/decode, chat templates and streaming detokenization."""
from moestream.tokenizer.chat_template import ChatTemplateError, compile_chat_template, render_chat_template
from moestream.tokenizer.detokenizer import IncrementalDetokenizer, KeepMarkup
from moestream.tokenizer.tokenizer import Tokenizer

__all__ = [
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "KeepMarkup",
    "Tokenizer",
    "compile_chat_template",
    "render_chat_template",
]

"""Streaming token ids -> text, with stop strings.

Two layers:
  1. decoding: turn ids into text deltas whose concatenation equals tokenizer.decode(all ids),
     holding back an incomplete UTF-8 sequence (it decodes to a trailing U+FFFD) until it
     completes. Each step decodes only a short trailing window of ids (see below).
  2. stop strings: hold back any tail that could still grow into a stop string, and cut the
     output right before the first stop string that appears.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moestream.tokenizer.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"

# Tags the reasoning and tool-call parsers read. Some tokenizers (the demo's) flag them special,
# which skip_special_tokens would drop from the text, so text for the parsers keeps exactly these.
MARKUP_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")


class KeepMarkup:
    """Tokenizer view for the detokenizer: drops special tokens except the parser markup (MARKUP_TOKENS)."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        keep = {tokenizer.token_to_id(t) for t in MARKUP_TOKENS}
        self.special_added_token_ids = frozenset(tokenizer.special_added_token_ids - keep)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


class IncrementalDetokenizer:
    """Feed generated ids one at a time with `.add(id)`; each call returns the newly safe text.

    Window invariant: `_ids` holds the last emitted chunk of ids (`_ids[:_read]`, kept as
    decoding context) followed by the ids not yet turned into text. Decoders are not plain
    concatenations (sentencepiece drops the first token's leading space, byte-level tokens
    carry partial UTF-8), so new text is decode(window) minus decode(context), never
    decode(token). The window only ever restarts where the decoded text ended on a
    complete character, so window decodes agree with the full decode, and older ids are
    dropped, which keeps every step O(window).
    """

    def __init__(self, tokenizer: Tokenizer, stop: Iterable[str] = (), skip_special_tokens: bool = True) -> None:
        if isinstance(stop, str):
            stop = [stop]
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # The backend drops these ids on decode(skip_special_tokens=True); dropping them here
        # instead is equivalent and stops them from inflating the window.
        self._skipped_ids = tokenizer.special_added_token_ids if skip_special_tokens else frozenset()
        self._stops = [s for s in dict.fromkeys(stop) if s]
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._ids: list[int] = []
        self._read = 0
        self._context = ""  # == decode(_ids[:_read]), cached
        self._held = ""  # decoded text not yet emitted because a stop string may start in it
        self._emitted: list[str] = []
        self.stopped = False
        self.matched_stop: str | None = None
        self.num_tokens = 0

    @property
    def text(self) -> str:
        """All text emitted so far (excluding any stop string)."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    # ------------------------------------------------------------ public API

    def add(self, token_id: int) -> str:
        """Append one generated id; return the text that became safe to show (maybe "")."""
        if self.stopped:
            return ""
        self.num_tokens += 1
        token_id = int(token_id)
        if token_id in self._skipped_ids:
            return ""
        self._ids.append(token_id)
        return self._release(self._decode_step(), final=False)

    def add_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.add(t) for t in token_ids)

    def flush(self) -> str:
        """End of generation: return everything still held back (empty once a stop matched)."""
        if self.stopped:
            return ""
        tail = self._decode_rest()
        return self._release(tail, final=True)

    # ------------------------------------------------------------ layer 1: ids -> text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _decode_step(self) -> str:
        context = self._context
        window = self._decode(self._ids)
        if window.endswith(_REPLACEMENT) or len(window) <= len(context):
            # Either a multi-byte character is still incomplete, or the new ids produced no
            # text yet; keep them pending and decode them again with the next id.
            return ""
        delta = window[len(context):]
        # Advance the window: the chunk just decoded becomes the next context. Its text is
        # decoded on its own (not sliced from `window`) since a window's first token may
        # decode differently at the start of a text.
        del self._ids[:self._read]
        self._read = len(self._ids)
        self._context = self._decode(self._ids)
        return delta

    def _decode_rest(self) -> str:
        # Pending ids may end in a genuinely invalid byte sequence; the full decode shows it
        # as U+FFFD, so emit it as such rather than dropping it.
        window = self._decode(self._ids)
        delta = window[len(self._context):]
        del self._ids[:]
        self._read = 0
        self._context = ""
        return delta

    # ------------------------------------------------------------ layer 2: stop strings

    def _release(self, new_text: str, final: bool) -> str:
        if not new_text and not final:
            return ""
        pending = self._held + new_text
        self._held = ""
        cut = self._find_stop(pending)
        if cut is not None:
            self.stopped = True
            return self._emit(pending[:cut])
        keep = 0 if final else self._partial_stop_len(pending)
        self._held = pending[len(pending) - keep:] if keep else ""
        return self._emit(pending[:len(pending) - keep])

    def _find_stop(self, pending: str) -> int | None:
        """Start of the earliest stop string in `pending`. No stop string can start in text
        already emitted: any such tail was still a possible stop prefix, so it was held."""
        best: int | None = None
        for stop in self._stops:
            pos = pending.find(stop)
            if pos != -1 and (best is None or pos < best):
                best, self.matched_stop = pos, stop
        return best

    def _partial_stop_len(self, pending: str) -> int:
        """Length of the longest tail of `pending` that is a proper prefix of some stop string."""
        for n in range(min(len(pending), self._max_stop_len - 1), 0, -1):
            tail = pending[-n:]
            if any(stop.startswith(tail) for stop in self._stops):
                return n
        return 0

    def _emit(self, text: str) -> str:
        if text:
            self._emitted.append(text)
        return text

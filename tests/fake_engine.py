"""A test double of the engine process for route-layer tests: it "generates" scripted text.

Same surface as `moestream.server.engine_client.EngineClient` (generate/cancel/stats/info/alive).
The script text is tokenized with the real tokenizer and streamed back one token per delta through
the same detokenizer view the engine process uses, so usage counts and markup handling are real.
"""
from __future__ import annotations

import asyncio

from moestream.server.engine_client import EngineError
from moestream.server.messages import Delta
from moestream.tokenizer import IncrementalDetokenizer, KeepMarkup


class FakeEngine:
    def __init__(self, tokenizer, script: str = "Hello!", max_seq_len: int = 4096):
        self.tokenizer = tokenizer
        self.script = script  # the text every request produces (tests change it)
        self.info = {"max_seq_len": max_seq_len, "kv_tokens": 8192, "vocab_size": tokenizer.vocab_size}
        self.alive = True
        self.prompts: list[list[int]] = []
        self.cancelled: list[str] = []
        self.fail_with: EngineError | None = None

    async def generate(self, rid, prompt_ids, params, keep_markup=True, parent=None):
        self.prompts.append(list(prompt_ids))
        if self.fail_with is not None:
            raise self.fail_with
        view = KeepMarkup(self.tokenizer) if keep_markup and params.skip_special_tokens else self.tokenizer
        detok = IncrementalDetokenizer(view, stop=params.stop, skip_special_tokens=params.skip_special_tokens)
        ids = self.tokenizer.encode(self.script)
        for i, tok in enumerate(ids):
            await asyncio.sleep(0)
            text = detok.add(tok)
            last = i + 1 == len(ids) or i + 1 >= params.max_tokens
            if detok.stopped:
                yield Delta(text, 1, "stop", detok.matched_stop)
                return
            if last:
                yield Delta(text + detok.flush(), 1, "stop" if i + 1 == len(ids) else "length")
                return
            yield Delta(text, 1)

    def cancel(self, rid):
        self.cancelled.append(rid)

    async def stats(self):
        return {"running": 0, "queued": 0, "kv": {"used_pages": 0, "total_pages": 8, "usage": 0.0},
                "state": {"used_slots": 0, "total_slots": 4, "usage": 0.0},
                "throughput": {"prefill_tps": 0.0, "decode_tps": 0.0}}

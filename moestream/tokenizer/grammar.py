"""Constrained decoding through llguidance: grammars compiled in the front end, matchers in the engine.

Why llguidance (and not xgrammar or outlines-core): its wheel is one abi3 binary with no Python
dependencies (xgrammar 0.2.9 pulls transformers, triton and apache-tvm-ffi into every install), it
computes a token mask in tens of microseconds with no per-schema precompilation over the vocabulary
(schemas differ per request in agent traffic), it takes JSON Schema, regex, Lark and llama.cpp's GBNF,
and it is maintained by the guidance-ai team and used by vLLM, SGLang and llama.cpp.

- `compile_grammar(kind, value)` (front end): a request's JSON schema / regex / grammar / structural tags -> the
  llguidance grammar string that travels to the engine in `SamplingParams.grammar`; raises
  `RequestError` (HTTP 400) on an invalid one, `GrammarUnavailable` when llguidance is not installed.
- `Grammars(tokenizer, vocab_size, eos_ids)` (engine): builds the llguidance tokenizer once and a
  `Matcher` per constrained request, compiled in a worker thread (`build`: the step loop queues the
  request once it is ready, engine/llm_engine.py). A matcher computes its next mask in a worker thread right after
  it consumed a token, so the mask of step t+1 is built while step t+1's forward pass runs (llguidance
  releases the GIL); the scheduler only waits when the forward pass was faster.
"""
from __future__ import annotations

import functools
import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from moestream.core import MoestreamError, RequestError

# JSON as models write it: no free whitespace (a weak model would fill it with newlines), ", " and ": ".
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarUnavailable(MoestreamError):
    """The grammar engine (llguidance) cannot be imported on this machine."""


def _llg():
    try:
        import llguidance
    except Exception as e:  # ImportError, or a wheel built for another platform
        raise GrammarUnavailable(
            f"structured outputs need the llguidance package, which could not be imported here ({e}); "
            "install it with `pip install llguidance`") from None
    return llguidance


def available() -> bool:
    try:
        _llg()
        return True
    except GrammarUnavailable:
        return False


def _check(grammar: str, what: str) -> str:
    llg = _llg()
    err = llg.LLMatcher.validate_grammar(grammar)
    if err:
        raise RequestError(f"invalid {what}: {err.strip()}")
    return grammar


def compile_grammar(kind: str, value: Any, special_ids: dict[str, int] | None = None) -> str:
    """kind: "json_schema" (a dict), "json_object", "regex", "grammar" (Lark or GBNF text),
    "choice" (a list of strings), "structural_tag" ({"structures", "triggers"}, see
    `structural_tag_grammar`) -> a validated llguidance grammar. special_ids: the tokenizer's special
    tokens by text, matched as those tokens where a structural tag's strings hold them."""
    llg = _llg()
    if kind == "structural_tag":
        return structural_tag_grammar(value, special_ids or {})
    if kind == "json_object":
        kind, value = "json_schema", {"type": "object"}
    if kind == "json_schema":
        if isinstance(value, bool) or value == {}:  # "true" / "{}": any JSON value
            value = {}
        if not isinstance(value, dict):
            raise RequestError(f"a JSON schema must be an object, got {type(value).__name__}")
        try:
            g = llg.LLMatcher.grammar_from_json_schema(value, defaults=_JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise RequestError(f"invalid JSON schema: {e}") from None
        return _check(g, "JSON schema")
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise RequestError("a regex must be a non-empty string")
        return _check(llg.LLMatcher.grammar_from_regex(value), "regex")
    if kind == "grammar":
        if not isinstance(value, str) or not value.strip():
            raise RequestError("a grammar must be a non-empty string (Lark or GBNF)")
        try:
            g = llg.grammar_from("grammar", value)
        except Exception as e:  # the GBNF converter raises on syntax errors
            raise RequestError(f"invalid grammar: {e}") from None
        return _check(g, "grammar")
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise RequestError("a choice must be a non-empty list of non-empty strings")
        lark = "start: " + " | ".join(json.dumps(c) for c in value)
        return _check(llg.LLMatcher.grammar_from_lark(lark), "choice")
    raise RequestError(f"unknown grammar kind {kind!r}")


def _seq(text: str, special_ids: dict[str, int]) -> str:
    """A Lark sequence for `text`: quoted literals, each special token's text in it matched as that token
    (a special token is never produced by spelling its text). "" for an empty text."""
    parts, i = [], 0
    while i < len(text):
        hits = [(at, -len(tag), tag) for tag in special_ids if (at := text.find(tag, i)) >= 0]
        if not hits:
            parts.append(json.dumps(text[i:]))
            break
        at, _, tag = min(hits)  # the first tag in the text; the longest where two start together
        if at > i:
            parts.append(json.dumps(text[i:at]))
        parts.append(f"<[{special_ids[tag]}]>")
        i = at + len(tag)
    return " ".join(parts)


def structural_tag_grammar(value: Any, special_ids: dict[str, int] | None = None) -> str:
    """vLLM's structural tags: free text, in which each trigger starts a tag — `begin`, JSON valid against
    `schema` (any JSON value when it has none), then `end` — after which free text resumes.

    value: {"structures": [{"begin", "schema", "end"}, ...], "triggers": [str, ...]}; each begin starts
    with a trigger (the longest one that fits is its trigger). A text trigger is matched lazily, the moment
    the model has written it; a trigger that starts with a special token (the demo tokenizer's `<tool_call>`)
    waits for that token, and the rest of its begin is forced."""
    special_ids = special_ids or {}
    structures, triggers = _structural_tag_parts(value)
    rules, names = [], []
    for i, st in enumerate(structures):
        begin, end, schema = st["begin"], st.get("end", ""), st.get("schema")
        fits = [t for t in triggers if begin.startswith(t)]
        if not fits:
            raise RequestError(f"structural tag {i}: begin {begin!r} starts with none of the triggers {triggers}")
        trigger = max(fits, key=len)
        schema = {**(schema or {}), "x-guidance": dict(_JSON_OPTIONS)}
        body = f"%json {json.dumps(schema, separators=(',', ':'))} {_seq(end, special_ids)}"
        head = max((t for t in special_ids if trigger.startswith(t)), key=len, default=None)
        if head is not None:  # a special token: not text, so no lazy match; the tag starts at that token
            rules.append(f"tag{i}: TEXT <[{special_ids[head]}]> {_seq(begin[len(head):], special_ids)} {body}")
        elif any(t in trigger for t in special_ids):
            raise RequestError(f"structural tag trigger {trigger!r} holds a special token after its start")
        else:
            rules += [f"trigger{i}[lazy]: TEXT {json.dumps(trigger)}",
                      f"tag{i}: trigger{i} {_seq(begin[len(trigger):], special_ids)} {body}"]
        names.append(f"tag{i}")
    lark = "\n".join(["%llguidance {}", f"start: ({' | '.join(names)})* TEXT", "TEXT: /(.|\\n)*/", *rules])
    return _check(_llg().LLMatcher.grammar_from_lark(lark), "structural tag")


def _structural_tag_parts(value: Any) -> tuple[list[dict], list[str]]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise RequestError("a structural tag must be an object (or its JSON text)") from None
    if not isinstance(value, dict):
        raise RequestError("a structural tag must be an object with 'structures' and 'triggers'")
    if "format" in value:
        raise RequestError("the structural tag 'format' shape is not supported; send 'structures' "
                           "([{begin, schema, end}]) and 'triggers'")
    structures, triggers = value.get("structures"), value.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise RequestError("a structural tag needs 'triggers': a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise RequestError("a structural tag needs 'structures': a non-empty list of {begin, schema, end}")
    for i, st in enumerate(structures):
        if not isinstance(st, dict) or not isinstance(st.get("begin"), str) or not st["begin"] \
                or not isinstance(st.get("end", ""), str):
            raise RequestError(f"structural tag {i} needs a non-empty string 'begin' and a string 'end'")
        if st.get("schema") is not None and not isinstance(st["schema"], dict):
            raise RequestError(f"structural tag {i}: 'schema' must be a JSON schema object")
    return structures, triggers


def _literal(tag: str, special_ids: dict[str, int], before: str = "", after: str = "") -> str:
    """A Lark literal for `before + tag + after`, the tag matched as its special token where it is one."""
    return _seq(before + tag + after, {tag: special_ids[tag]} if tag in special_ids else {})


def tool_call_grammar(tools: list[dict], special_ids: dict[str, int] | None = None, multiple: bool = False) -> str:
    """Forced tool calls in the hermes format the tool parser reads:
    `<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>` with ARGS valid against NAME's schema.
    tools: [{"name", "parameters"}] (the allowed ones); special_ids: the tags that are special tokens of
    the tokenizer (matched as that token, not as text); `multiple`: one or more calls."""
    lit = functools.partial(_literal, special_ids=special_ids or {})

    branches = []
    for t in tools:
        schema = {"type": "object", "properties": {"name": {"const": t["name"]},
                                                   "arguments": t.get("parameters") or {"type": "object"}},
                  "required": ["name", "arguments"], "additionalProperties": False,
                  "x-guidance": dict(_JSON_OPTIONS)}
        branches.append("%json " + json.dumps(schema, separators=(",", ":")))
    lark = "\n".join([
        "start: call" + ("+" if multiple else ""),
        f"call: {lit('<tool_call>', after=chr(10))} body {lit('</tool_call>', before=chr(10))}",
        "body: " + " | ".join(f"b{i}" for i in range(len(branches))),
        *(f"b{i}: {b}" for i, b in enumerate(branches)),
    ])
    return _check(_llg().LLMatcher.grammar_from_lark(lark), "tool schema")


def xml_tool_call_grammar(tools: list[dict], special_ids: dict[str, int] | None = None,
                          multiple: bool = False) -> str:
    """Forced tool calls in the Qwen3-Coder / Qwen3.5 XML format (`<tool_call>\\n<function=NAME>\\n
    <parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>`): the schema's properties in
    order, required ones always, the others optionally; string values on one line (enums as listed),
    every other type as compact JSON valid against its schema."""
    lit = functools.partial(_literal, special_ids=special_ids or {})

    rules, bodies = [], []
    for i, t in enumerate(tools):
        schema = t.get("parameters") or {}
        # the JSON-schema compiler checks the shapes this walk trusts (properties an object, required a list
        # of names, lengths whole numbers), as it does for every schema of the hermes format
        compile_grammar("json_schema", schema)
        props = schema.get("properties") or {}
        required = set(schema.get("required") or [])
        parts = []
        for j, (key, ps) in enumerate(props.items()):
            ps = ps if isinstance(ps, dict) else {}
            if isinstance(ps.get("enum"), list) and all(isinstance(v, str) for v in ps["enum"]) and ps["enum"]:
                value = " | ".join(json.dumps(v) for v in ps["enum"])
            elif ps.get("type") == "string":
                lo, hi = int(ps.get("minLength", 0)), ps.get("maxLength")
                value = "/[^<\\n]{%d,%s}/" % (lo, "" if hi is None else int(hi))
            else:
                value = "%json " + json.dumps({**ps, "x-guidance": dict(_JSON_OPTIONS)}, separators=(",", ":"))
            rules.append(f"v{i}_{j}: {value}")
            p = f"{json.dumps('<parameter=' + key + '>' + chr(10))} v{i}_{j} {json.dumps(chr(10) + '</parameter>' + chr(10))}"
            parts.append(f"({p})" + ("" if key in required else "?"))
        head = json.dumps("<function=" + t["name"] + ">" + chr(10))
        bodies.append(f"f{i}: {head} {' '.join(parts)} {json.dumps('</function>')}".replace("  ", " "))
    lark = "\n".join([
        "start: call" + ("+" if multiple else ""),
        f"call: {lit('<tool_call>', after=chr(10))} body {lit('</tool_call>', before=chr(10))}",
        "body: " + " | ".join(f"f{i}" for i in range(len(tools))),
        *bodies, *rules,
    ])
    return _check(_llg().LLMatcher.grammar_from_lark(lark), "tool schema")


# ---- engine side ------------------------------------------------------------------------------------
_POOL: ThreadPoolExecutor | None = None
_BUILD_POOL: ThreadPoolExecutor | None = None  # compiles: apart, so a slow one never delays another's mask
_POOL_LOCK = threading.Lock()


def _pool(build: bool = False) -> ThreadPoolExecutor:
    """The worker threads of the masks (build False) or of the compiles (build True), made at first use."""
    global _POOL, _BUILD_POOL
    with _POOL_LOCK:
        if build:
            if _BUILD_POOL is None:
                _BUILD_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="moestream-grammar-build")
            return _BUILD_POOL
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="moestream-grammar")
        return _POOL


class Grammars:
    """One llguidance tokenizer for the engine's vocabulary (built at the first constrained request)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int]):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, list(eos_ids)
        self._lltok = None
        self._lock = threading.Lock()
        self._compiled: dict[str, Future] = {}  # grammar -> future of its unused LLMatcher (recent last)

    def _lt(self):
        with self._lock:  # matchers are built in worker threads (build): one tokenizer for them all
            if self._lltok is None:
                llg = _llg()
                backend = getattr(self.tokenizer, "_backend", None)
                if backend is None:
                    raise RequestError("structured outputs need the model's tokenizer")
                self._lltok = llg.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size,
                                              eos_token=self.eos_ids or None)
            return self._lltok

    def matcher(self, grammar: str) -> "Matcher":
        return Matcher(self._compile(grammar), self.vocab_size)

    def _compile(self, grammar: str):
        """A new LLMatcher for `grammar` (RequestError when llguidance cannot use it)."""
        m = _llg().LLMatcher(self._lt(), grammar, log_level=0)
        if m.is_error():
            raise RequestError(f"the grammar could not be used: {m.get_error()}")
        return m

    def build(self, grammar: str, keep: int = 8) -> Future:
        """The future of a Matcher for `grammar`, compiled in a worker thread: a large grammar takes seconds
        (llguidance releases the GIL meanwhile), which the engine's step loop, serving everyone, must not wait
        for. Requests with one grammar (the n choices of a request, an agent's fixed schema) share a compile,
        each getting a copy of the matcher; the `keep` most recent grammars stay compiled."""
        with self._lock:
            proto = self._compiled.pop(grammar, None) or _pool(build=True).submit(self._compile, grammar)
            self._compiled[grammar] = proto
            while len(self._compiled) > keep:
                self._compiled.pop(next(iter(self._compiled)))
        out: Future = Future()
        proto.add_done_callback(lambda f: _copy_into(f, out, self.vocab_size))
        return out


def _copy_into(compiled: Future, out: Future, vocab_size: int) -> None:
    """out <- a fresh Matcher copied from the compiled (never consumed) one, or the compile's error."""
    try:
        out.set_result(Matcher(compiled.result().deep_copy(), vocab_size))
    except Exception as e:
        out.set_exception(e)


DEAD_END = ("the structured output cannot be completed: after the tokens generated so far its grammar allows no "
            "further token (a JSON schema or grammar that no finite output satisfies, e.g. an object that requires a "
            "property of its own type)")


class Matcher:
    """A request's grammar state: `allowed()` is the mask for the next token (a bool tensor [V]),
    `consume(token)` advances and starts computing the next mask in the background."""

    def __init__(self, m, vocab_size: int):
        self._m = m
        self.vocab_size = vocab_size
        self._next: Future | None = None
        self._stopped = m.is_stopped()  # read only here and in consume: a mask may be computing meanwhile
        self._dead = self._dead_now()

    def prefetch(self) -> None:
        if self._next is None:
            self._next = _pool().submit(self._compute)

    def _dead_now(self) -> bool:
        """llguidance found no way forward (its error state) in a state that does not accept: it would then allow
        only end-of-sequence, which must not end the request as a normal stop with an incomplete value."""
        return self._m.is_error() and not self._m.is_accepting()

    def _compute(self):
        import numpy as np
        import torch

        bits = np.unpackbits(np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        return torch.from_numpy(bits[:self.vocab_size].astype(np.bool_)), self._dead_now()

    def allowed(self):
        self.prefetch()
        fut, self._next = self._next, None
        mask, dead = fut.result()
        self._dead = self._dead or dead
        return mask

    def consume(self, token: int) -> bool:
        """False when the token broke the grammar (only a forced token can)."""
        if self._next is not None:  # a mask still computing reads the state we are about to change
            self._next.result()
            self._next = None
        ok = self._m.consume_token(int(token))
        self._stopped = self._m.is_stopped()
        self._dead = self._dead or self._dead_now()
        if ok and not self._stopped:
            self.prefetch()
        return ok

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more."""
        return self._stopped

    def dead_end(self) -> str | None:
        """Why no output can complete the grammar from here (seen by the last `allowed()` or `consume()`), or None."""
        return DEAD_END if self._dead else None

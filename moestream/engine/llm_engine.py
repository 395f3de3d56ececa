"""The step loop every front end drives: `LLM.generate` (llm.py), the server's engine process
(server/engine_proc.py) and in-process chat (server/chat.py) all call add_request / step / abort / has_work.

    add_request(req)  the scheduler checks it; the engine gives it its sampling state (generator, grammar
                      matcher, reasoning flag) and its detokenizer (text is made at this edge); queued, or
                      with a grammar first compiling in a worker thread (`compiling`: seconds for a big one,
                      which the loop serving everyone must not wait for; counted as queued, abortable)
    step()            requests whose grammar compiled are queued -> scheduler.schedule() -> runner.run()
                      (forward + sampling) -> scheduler.postprocess() (tokens appended, stops, finishing)
                      -> runner.draft() with --speculative mtp; returns one StepOutput per token produced,
                      and one with `error` per request that failed alone (its grammar, its text, its sampling)

The scheduler (scheduler/) does the bookkeeping only; the runner (engine/runner.py) the tensors.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait

from ..core import FinishReason, MoestreamError, RequestError
from ..scheduler.request import Request, StepOutput
from ..scheduler.scheduler import Scheduler, SchedulerConfig
from ..tokenizer import IncrementalDetokenizer, KeepMarkup
from .runner import ModelRunner
from .sampler import make_generator

log = logging.getLogger("moestream.engine")


LOGIT_BYTES = 12  # bytes a prompt-logprob logit takes while a step's logprobs are computed (16-bit, float32, log-softmax)


def logit_rows(engine) -> int:
    """Prompt positions whose logits one step may compute for prompt_logprobs requests: on a GPU what the plan's
    workspace holds of [rows, vocabulary] logits (a 2,048-token chunk of a 248k vocabulary would be 6 GB: at a 4 GiB cap
    the request would fail for memory), at least one; 0 (no limit) on a CPU."""
    plan, device = getattr(engine, "plan", None), getattr(engine, "device", None)
    if plan is None or device is None or device.type != "cuda":
        return 0
    return max(1, plan.bytes.workspace // (engine.cfg.vocab_size * LOGIT_BYTES))


def scheduler_config(engine) -> SchedulerConfig:
    """The scheduler's limits from an engine's options and sizes."""
    e = engine.ecfg
    return SchedulerConfig(max_running=e.max_running_requests, chunk=e.chunked_prefill_size,
                           max_seq_len=engine.max_seq_len, vocab_size=engine.cfg.vocab_size,
                           prefix_cache=e.prefix_cache, prompt_snapshots=e.prefix_cache_prompt_snapshot == "on",
                           forks=e.tp_size == 1, logit_rows=logit_rows(engine))


class LLMEngine:
    def __init__(self, engine, tokenizer=None, eos_token_ids=()):
        """engine: an Engine (or rank 0's parallel.TPEngine); tokenizer: None for token ids only (no text,
        no grammars); eos_token_ids: the ids that end a request (one set, read by the scheduler's stop check
        and the runner's min_tokens mask)."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids)
        self.scheduler = Scheduler(scheduler_config(engine), engine.caches, self.eos)
        self.runner = ModelRunner(engine, self.eos, tokenizer)
        self.grammars = None  # tokenizer.grammar.Grammars, built at the first constrained request
        # id -> (request, future of its grammar's Matcher): requests waiting for their grammar to compile
        self.compiling: dict[str, tuple[Request, Future]] = {}
        self._markup = None  # KeepMarkup view of the tokenizer, made at the first request that keeps markup
        self.last_step: dict = {}  # the last step's counts and seconds (LLM timing, server log lines)
        self._inflight = None  # runner.Inflight: an overlapped decode step launched, its tokens not yet read
        self._carry: list[StepOutput] = []  # outputs read between steps (drain), returned by the next step
        self.overlapped = 0  # decode steps launched while the one before was in flight

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, req: Request, keep_markup: bool = False) -> None:
        """Queue req; RequestError when it cannot run here. keep_markup: its text keeps the reasoning and
        tool-call tags (for the server's parsers) where skip_special_tokens drops other special tokens."""
        self.scheduler.check(req)
        self._prepare(req, keep_markup)
        if req.params.grammar and req.matcher is None:  # queued once compiled (_add_compiled)
            self.compiling[req.id] = (req, self._grammars().build(req.params.grammar))
            return
        self._queue(req)

    def _queue(self, req: Request) -> None:
        """Hand a prepared request (its matcher, when it has a grammar, ready) to the scheduler."""
        if req.matcher is not None and not req.thinking:
            req.matcher.prefetch()  # the first mask is built while the prompt is prefilled
        self.scheduler.add(req)

    def _prepare(self, req: Request, keep_markup: bool) -> None:
        p = req.params
        req.generator = make_generator(p, self.engine.device)
        req.thinking = p.reasoning_open
        if p.prompt_logprobs is not None and not req.prompt_lps:
            req.prompt_lps = [None]
        if self.tokenizer is not None and req.detok is None:
            view = self.tokenizer
            if keep_markup and p.skip_special_tokens:
                view = self._markup = self._markup or KeepMarkup(self.tokenizer)
            req.detok = IncrementalDetokenizer(view, stop=p.stop, skip_special_tokens=p.skip_special_tokens)

    def _grammars(self):
        if self.grammars is None:
            from ..tokenizer.grammar import Grammars

            if self.tokenizer is None:
                raise RequestError("structured outputs need the model's tokenizer")
            self.grammars = Grammars(self.tokenizer, self.engine.cfg.vocab_size, sorted(self.eos))
        return self.grammars

    def _add_compiled(self) -> list[StepOutput]:
        """Queue the requests whose grammar has compiled (an n > 1 child after its parent, whose prefill it
        copies). One that cannot join ends with "error": its output says why, `refused` when it is the
        request's fault (a grammar llguidance cannot use, a prompt the pool no longer holds: a rebuild
        shrank it meanwhile) rather than the engine's."""
        outs = []
        for rid in [rid for rid, (req, fut) in self.compiling.items()
                    if fut.done() and req.parent not in self.compiling]:
            req, fut = self.compiling.pop(rid)
            try:
                req.matcher = fut.result()
                self.scheduler.check(req)
                self._queue(req)
            except Exception as e:
                if not isinstance(e, MoestreamError):
                    log.exception("request %s could not join the step loop", rid)
                why = str(e) if isinstance(e, MoestreamError) else f"internal error: {type(e).__name__}: {e}"
                outs.append(self.scheduler.fail(req, why, refused=isinstance(e, MoestreamError)))
        return outs

    def abort(self, req_id: str, reason: str = FinishReason.ABORT.value) -> bool:
        """Finish a request now, freeing its pages and slot (or dropping its grammar's compile); False when it
        is unknown or already done."""
        if req_id in self.compiling:
            self.scheduler.finish(self.compiling.pop(req_id)[0], reason)
            return True
        return self.scheduler.abort(req_id, reason)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.compiling) or self._inflight is not None or bool(self._carry)

    def stats(self) -> dict:
        """The scheduler's occupancy and prefix-cache counters (the requests whose grammar is compiling
        count as queued), and speculative decoding's."""
        out = self.scheduler.stats()
        out["queued"] += len(self.compiling)
        out["overlapped_steps"] = self.overlapped  # decode steps launched before the last one's tokens were read
        if self.runner.spec_k:
            out["speculative"] = self.runner.spec_stats()
        return out

    # ---- one step --------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One step of every request that can run (last_step: its counts, {} when none could); with only
        grammars compiling, a short wait for one of them instead (callers loop on has_work: no busy loop).

        Overlapped decode (--overlap-schedule, Engine.overlap_ok): a decode step of plain requests (greedy or sampled) is launched
        and left running; the next call plans and launches the step after it (its input tokens read on the device)
        before it reads the first one's tokens, so the host's part of a step (planning, batch building, launching,
        emitting text) runs while the GPU computes. A request's tokens then come one call later; one that stops
        (EOS, a stop string) has one wasted row computed after its last token. Any other step first reads the step
        in flight."""
        outputs = self._add_compiled() if self.compiling else []
        if self._carry:
            outputs, self._carry = self._carry + outputs, []
        outputs += self.scheduler.take_stalled()  # (ended while an overlapped step planned the next)
        if self._inflight is not None:
            if (self.scheduler.overlap_room() and all(map(self.runner.overlappable, self.scheduler.running))
                    and self.engine_overlap(len(self.scheduler.running))):
                return outputs + self._overlapped_step()
            outputs += self._read_inflight()
        batch = self.scheduler.schedule()
        outputs += self.scheduler.take_stalled()
        if batch is None:
            self.last_step = {}
            pending = [f for _, f in self.compiling.values() if not f.done()]
            if pending and not outputs:
                wait(pending, timeout=0.01, return_when=FIRST_COMPLETED)
            return outputs
        t0 = time.perf_counter()
        if self._starts_overlap(batch):
            try:
                self._inflight = self.runner.launch(batch)
            except BaseException:
                self.scheduler.step_failed(batch)
                raise
            self.scheduler.advance(batch)
            self.last_step = self._step_stats(batch, outputs, time.perf_counter() - t0)
            return outputs
        try:
            result = self.runner.run(batch)
        except BaseException:
            self.scheduler.step_failed(batch)
            raise
        outputs += self.scheduler.postprocess(batch, result)
        self.engine.caches.state.copy(batch.after_copies)  # rolling snapshots of verify steps
        if self.runner.spec_k:
            self._draft(batch)
        self.last_step = self._step_stats(batch, outputs, time.perf_counter() - t0)
        return outputs

    # ---- overlapped decode ---------------------------------------------------------------------
    def _starts_overlap(self, batch) -> bool:
        """A decode step that may be launched and read a step later: every sequence decodes one token of an
        overlappable request, nothing else is in the step, and the engine allows it (Engine.overlap_ok)."""
        return (not batch.forks and not batch.prompt and not self.runner.spec_k and self.engine_overlap(len(batch.seqs))
                and all(s.n == 1 and s.samples and not s.prefill and not s.verify and self.runner.overlappable(s.req)
                        for s in batch.seqs))

    def engine_overlap(self, rows: int | None = None) -> bool:
        """Engine.overlap_ok for a decode step of `rows` rows (re-asked before each overlapped launch: hybrid overlaps
        only while its arms hold the fetch form for that batch size)."""
        ok = getattr(self.engine, "overlap_ok", None)
        return bool(ok and ok(rows))

    def _overlapped_step(self) -> list[StepOutput]:
        """Plan and launch the next step (the pending tokens read on the device), then read the step in flight and
        emit its tokens; the launched step becomes the one in flight."""
        t0 = time.perf_counter()
        prev = self._inflight
        batch = self.scheduler.schedule()
        self._inflight = None
        try:
            launched = self.runner.launch(batch, prev)
            outputs = self.scheduler.resolve(self.runner.read(prev))
        except BaseException:  # the caller isolates or ends the requests (their pending tokens are dropped then)
            self.scheduler.step_failed(batch)
            raise
        self._inflight = launched
        self.overlapped += 1
        self.scheduler.advance(batch)
        if not launched.live():  # every request of the launched step stopped at the token just read
            self._read_inflight()
        self.last_step = self._step_stats(batch, outputs, time.perf_counter() - t0)
        return outputs

    def _read_inflight(self) -> list[StepOutput]:
        """Read the step in flight and emit its tokens (nothing is in flight after)."""
        prev, self._inflight = self._inflight, None
        return self.scheduler.resolve(self.runner.read(prev))

    def drain(self) -> None:
        """Between steps, before the caches or requests are changed from outside the step loop (a cache rebuild):
        the step in flight is read; its outputs come with the next step()."""
        if self._inflight is not None:
            self._carry += self._read_inflight()

    def _draft(self, batch) -> None:
        try:
            self.runner.draft(batch, self.scheduler.draft_room)
        except Exception:  # drafts only save time: this step's tokens are already out, keep them
            log.exception("the MTP drafter failed; these requests decode without drafts this step")
            for s in batch.seqs:
                s.req.drafts = []

    def _step_stats(self, batch, outputs: list[StepOutput], seconds: float) -> dict:
        decoding = {s.req.id for s in batch.seqs if not s.prefill}
        decode = len(decoding)
        if self.runner.spec_k:  # decode requests' tokens this step (a verify step emits up to K + 1 each)
            decode = sum(1 for o in outputs if o.request.id in decoding)
        return {"seconds": seconds, "tokens": batch.num_tokens, "decode": decode,
                "prefill_tokens": sum(s.n for s in batch.seqs if s.prefill),
                "prefill_seqs": len(batch.seqs) - len(decoding),
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting)}

    # ---- live cache rebuild ----------------------------------------------------------------
    def resize_caches(self, kv_tokens: int | None = None, moe_slots: int | str | None = None) -> dict:
        """Between steps: a KV pool of kv_tokens tokens (rounded up to whole pages; None: as now) and moe_slots
        expert slots ("auto": the slots that fit; None: as now). Requests in flight keep their pages (moved
        below the new size when they sit above it) and their linear state; unreferenced prefix-cache pages are
        evicted, least recently used first, until the rest fits. Refused, nothing changed: RequestError for a
        value this server cannot take, ConfigError (with the reason) when the plan does not fit the memory
        budget or the requests in flight could not go on."""
        t0 = time.perf_counter()
        self.drain()
        sched, old = self.scheduler, self.engine.plan
        kv, P = sched.kv, sched.kv.page_size
        for name, v in (("KV tokens", kv_tokens), ("expert slots", None if moe_slots == "auto" else moe_slots)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise RequestError(f"{name} must be a positive integer, got {v!r}")
        pages = kv.pages_for(kv_tokens) if kv_tokens is not None else kv.num_pages
        slots = None if moe_slots == "auto" else moe_slots if moe_slots is not None else (old.cache_slots or None)
        sched.check_room(pages)
        plan, ecfg = self.engine.plan_caches(pages * P, slots)
        # nothing has changed up to here
        keep, evicted = sched.shrink_to(pages)
        before = kv.num_pages * P
        self.engine.resize_caches(plan, ecfg, keep)
        sched.renumber(keep)
        report = {"kv_tokens": {"before": before, "after": pages * P},
                  "moe_slots": {"before": old.cache_slots, "after": plan.cache_slots},
                  "total_experts": plan.total_experts, "backend": plan.backend, "running": len(sched.running),
                  "queued": len(sched.waiting), "moved_pages": sum(a != b for a, b in keep.items()),
                  "evicted_prefix_pages": evicted, "rebuild_s": time.perf_counter() - t0}
        log.info("cache rebuild in %.3f s: KV %d -> %d tokens, expert slots %d -> %d of %d; %d requests in flight "
                 "(%d pages moved), %d queued, %d prefix-cache pages evicted", report["rebuild_s"], before, pages * P,
                 old.cache_slots, plan.cache_slots, plan.total_experts, report["running"], report["moved_pages"],
                 report["queued"], evicted)
        return report

"""Continuous batching with chunked prefill: the bookkeeping of a step, no tensors.

A step is three calls (engine/llm_engine.py makes them): `schedule()` decides which requests run and how
many tokens each computes, reserving their pages and slots (`ScheduledBatch`); the engine's model runner
computes it and samples (`StepResult`); `postprocess()` appends the tokens, checks the stops, finishes
requests and frees what they held. Cache copies a decision needs travel in the ScheduledBatch, for the
engine to run.

Each step: every running request that is decoding contributes one token; the remaining token budget
(`chunked_prefill_size`) goes to prefill chunks, first of running requests, then of waiting ones
admitted while a state slot and KV pages are free. KV pages are taken as tokens arrive; when none is
left the prefix cache gives back unreferenced pages, then the newest running request is preempted (its
caches freed, recomputed later from its tokens).

Prefix cache (kvcache/prefix.py, on unless --disable-prefix-cache): a request admitted from the queue
starts after the longest cached run of full pages of its tokens (at most all but the last token), and
its pages enter the tree as they fill. For models with Gated DeltaNet layers the run must end at a state
snapshot: the request's slot is loaded from it before its first step (state_loads); a prompt's prefill
saves one at its last page boundary and where it leaves the cached pages (taken inside the chunk that
crosses it, ScheduledSeq.snapshots), and decoding saves one at each page boundary, replacing that
request's previous one (state_saves, copied after the step). Attention-only models also copy the shared
head of a page a request leaves midway (kv_copies); with a host tier, evicted pages and snapshots are
spilled to host memory and fetched back on a hit (host_copies).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ..core import ConfigError, FinishReason, RequestError
from ..kvcache.prefix import PrefixCache
from .batch import ScheduledBatch, ScheduledSeq, StepResult
from .request import PENDING, Request, Status, StepOutput

STALL_LIMIT = 3  # lone self-preemptions in a row at one length before a request is ended (Scheduler._stall)

log = logging.getLogger("moestream.scheduler")


@dataclass(frozen=True)
class SchedulerConfig:
    max_running: int  # --max-running-requests
    chunk: int  # --chunked-prefill-size: tokens a step computes at most (decode tokens first)
    max_seq_len: int  # the context: prompt plus generated tokens
    vocab_size: int
    prefix_cache: bool = True
    prompt_snapshots: bool = True  # --prefix-cache-prompt-snapshot on
    forks: bool = True  # n > 1 children copy their parent's prefill (off under tensor parallelism)
    # prompt positions whose logits a step may compute for prompt_logprobs requests (each such position is a row of
    # [rows, vocab] logits: on a GPU the plan's workspace bounds them, engine/llm_engine.logit_rows); 0: no limit
    logit_rows: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, caches, eos: set[int]):
        """caches: the engine's pools (kv, state, host); only their allocators and sizes are used here.
        eos: the stop token ids, shared with the engine (one set)."""
        self.config = config
        self.kv, self.state, self.host = caches.kv, caches.state, caches.host
        self.eos = eos
        self.max_running, self.chunk, self.max_seq_len = config.max_running, config.chunk, config.max_seq_len
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # After a failed step: ids of the requests that were in it, run one at a time until they end,
        # so a request that fails again fails alone and the others go on.
        self.suspects: set[str] = set()
        self._stalled: list[StepOutput] = []  # requests ended because they could never run (take_stalled)
        self.prefix: PrefixCache | None = None
        if config.prefix_cache:
            linear, host = self.state.conv is not None, self.host
            self.prefix = PrefixCache(self.kv.pages, self.kv.page_size, needs_snapshot=linear,
                                      snap_slots=self.state.snapshot_slots if linear else None,
                                      host_pages=host.num_pages if host else 0, host_snaps=host.num_snaps if host else 0)
        self._host_unsure = False  # a failed step carried host-tier copies: drop the cache once it is released
        self._pending_snaps: list[tuple[Request, int, int, bool]] = []  # (req, tokens, slot, rolling)
        self._resets: list[int] = []  # state slots admitted since the last batch (zeroed before its pass)
        self.prefix_totals = {"requests": 0, "hits": 0, "prompt_tokens": 0, "cached_tokens": 0,
                              "saved_prefill_tokens": 0}
        # n > 1: children waiting for their parent's prefill, which they copy (KV positions + linear state)
        self.held: dict[str, list[Request]] = {}

    # ---- requests ------------------------------------------------------------------------
    def check(self, req: Request) -> None:
        """RequestError when req cannot run here (empty, longer than the context or the KV pool, ids
        outside the vocabulary)."""
        n = len(req.prompt_ids)
        if n == 0:
            raise RequestError("the prompt is empty")
        if n >= self.max_seq_len:
            raise RequestError(f"the prompt has {n} tokens; this server's context is {self.max_seq_len} tokens "
                               f"(prompt plus at least one generated token must fit)")
        if self.kv.pages_for(n + 1) > self.kv.num_pages:
            raise RequestError(f"the prompt has {n} tokens but the KV cache holds only "
                               f"{self.kv.num_pages * self.kv.page_size}; start the engine with "
                               f"--max-seq-len-override {n + 1} or more (its memory plan then holds one whole "
                               "request that long) or a larger --num-tokens")
        vocab = self.config.vocab_size
        if any(not 0 <= t < vocab for t in req.prompt_ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab})")

    def add(self, req: Request) -> None:
        """Queue a checked request (`check`); a child of an n > 1 request whose parent has not prefilled
        yet is held until it has."""
        self.requests[req.id] = req
        parent = self.requests.get(req.parent) if req.parent else None
        if (parent is not None and parent.status != Status.FINISHED and parent.prompt_ids == req.prompt_ids
                and not parent.output_ids and req.params.prompt_logprobs is None
                and self.config.forks):  # tensor parallel ranks would need the copies too
            self.held.setdefault(parent.id, []).append(req)  # admitted when the parent's prefill is done
        else:
            self.waiting.append(req)

    def abort(self, req_id: str, reason: str = FinishReason.ABORT.value) -> bool:
        req = self.requests.get(req_id)
        if req is None or req.status == Status.FINISHED:
            return False
        self._finish(req, reason)
        return True

    def finish(self, req: Request, reason: str) -> None:
        """End req now with `reason` wherever it is: running, queued, held, or not added yet (a request the
        engine was still preparing: its grammar compiling)."""
        if req.status != Status.FINISHED:
            self._finish(req, reason)

    def fail(self, req: Request, why: str, tok: int | None = None, refused: bool = False) -> StepOutput:
        """End req with "error" for a failure of its own (its grammar, its text, its sampling) while the
        others go on; the StepOutput carries why (refused: the request's fault, not the engine's)."""
        self.finish(req, FinishReason.ERROR.value)
        return StepOutput(req, tok, "", True, error=why, refused=refused)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.held)

    def stats(self) -> dict:
        """Occupancy right now: what /v1/stats and the per-batch log lines show."""
        kv, slots = self.kv.pages, self.state.slots
        out = {"running": len(self.running), "queued": len(self.waiting),
               "kv": {"used_pages": kv.num_used, "total_pages": kv.n, "page_size": self.kv.page_size,
                      "usage": kv.num_used / kv.n if kv.n else 0.0},
               "state": {"used_slots": slots.num_used, "total_slots": slots.n,
                         "usage": slots.num_used / slots.n if slots.n else 0.0}}
        if self.prefix is not None:
            t = self.prefix_totals
            out["prefix_cache"] = {**self.prefix.stats(), **t, **self._host_bytes(),
                                   "hit_rate": t["cached_tokens"] / t["prompt_tokens"] if t["prompt_tokens"] else 0.0}
        return out

    def _host_bytes(self) -> dict:
        """Bytes moved to and from the prefix cache's host tier (this rank's)."""
        host, tree = self.host, self.prefix
        if host is None:
            return {"host_spill_bytes": 0, "host_fetch_bytes": 0}
        page, snap = host.page_bytes, host.snap_bytes
        return {"host_spill_bytes": tree.spilled_pages * page + tree.spilled_snaps * snap,
                "host_fetch_bytes": tree.fetched_pages * page + tree.fetched_snaps * snap}

    # ---- after a failed step -----------------------------------------------------------------
    def step_failed(self, batch: ScheduledBatch) -> None:
        """The engine could not compute `batch`: the snapshots it was to write are freed, and the prefix
        cache is dropped once its requests are released when its host-tier copies may not have run."""
        for _, _, slot, _ in self._pending_snaps:  # never written: the step did not finish
            self.prefix.free_snapshot(slot)
        self._pending_snaps = []
        self._host_unsure = self._host_unsure or bool(batch.host_copies)

    def abort_all(self, reason: str = FinishReason.ABORT.value) -> list[Request]:
        """Finish every running request (after a failed step their caches may be half-written)."""
        victims = list(self.running)
        for req in victims:
            self._finish(req, reason)
        self._forget_unsure_host_copies()
        return victims

    def isolate_running(self) -> list[Request]:
        """After a failed step: every running request goes back to the queue (its caches may be
        half-written: they are freed and recomputed) and is then run alone until it finishes."""
        victims = list(self.running)
        for req in reversed(victims):  # reversed: they keep their order at the head of the queue
            self._release(req)
            req.status = Status.WAITING
            req.num_computed = 0
            self.waiting.insert(0, req)
        self.suspects.update(r.id for r in victims)
        self._forget_unsure_host_copies()
        return victims

    def _forget_unsure_host_copies(self) -> None:
        """A failed step may not have run its host-tier copies, so the tree may name pages and snapshots
        whose bytes were never copied: drop every cached node (none is referenced any more)."""
        if self._host_unsure:
            self.prefix.clear()
            self._host_unsure = False

    # ---- live cache rebuild: the page side ---------------------------------------------------
    def check_room(self, pages: int) -> None:
        """The requests in flight can go on in a pool of `pages` pages (after evicting the prefix cache)."""
        P = self.kv.page_size
        held = self.kv.pages.num_used - (self.prefix.num_evictable if self.prefix is not None else 0)
        if held > pages:
            raise ConfigError(f"the {len(self.running)} requests in flight hold {held * P} tokens of KV, more than "
                              f"a pool of {pages * P} tokens; ask for more or wait until they finish")
        reqs = self.running + self.waiting + [k for kids in self.held.values() for k in kids]
        longest = max((r.num_tokens + 1 for r in reqs), default=0)
        if self.kv.pages_for(longest) > pages:
            raise ConfigError(f"a request in flight needs {longest} tokens of KV, more than a pool of {pages * P} "
                              "tokens; ask for more or wait until it finishes")

    def shrink_to(self, pages: int) -> tuple[dict[int, int], int]:
        """Make the pages in use fit a pool of `pages` (check_room said they can): unreferenced prefix-cache
        pages are evicted, then every page in use is mapped to its id in the new pool (ids below `pages`
        stay, the others take free low ids). Returns (old id -> new id, pages evicted)."""
        evicted = self.prefix.evict(self.kv.pages.num_used - pages) if self.prefix is not None else 0
        used = self.kv.pages.used_ids()
        keep = {p: p for p in used if p < pages}
        spare = (i for i in range(pages) if i not in keep)
        for p in used:
            if p >= pages:
                keep[p] = next(spare)
        return keep, evicted

    def renumber(self, keep: dict[int, int]) -> None:
        """The pool was resized with its pages moved by `keep`: the page tables and the tree follow."""
        for req in self.running:
            req.pages = [keep[p] for p in req.pages]
        if self.prefix is not None:
            self.prefix.renumber(keep)

    # ---- schedule ----------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """This step's requests and token counts, their pages and slots reserved (preempting when the pool
        runs out); None when nothing can run."""
        plan = self._plan()
        if not plan:
            return None
        batch = ScheduledBatch([ScheduledSeq(r, n, r.num_computed, prefill=r.in_prefill,
                                             verify=n > 1 and not r.in_prefill,
                                             samples=not (n > 1 and not r.in_prefill)
                                             and r.num_computed + n == r.num_tokens) for r, n in plan])
        if self.prefix is not None:
            self._plan_kv_copies(batch)
            if self.prefix.needs_snapshot:
                self._plan_state_copies(batch)
        if self.held:
            self._adopt_children(batch)
        batch.state_resets, self._resets = self._resets, []
        if self.prefix is not None and self.prefix.host_ops:  # last: state copies may spill snapshots
            batch.host_copies, self.prefix.host_ops = self.prefix.host_ops, []
        return batch

    def _plan(self) -> list[tuple[Request, int]]:
        """Choose (request, number of new tokens) for this step, allocating pages and slots."""
        plan: list[tuple[Request, int]] = []
        budget = self.chunk
        lp = [self.config.logit_rows or None]  # prompt-logprob rows left this step (None: no limit)
        for req in list(self.running):
            if req.status != Status.RUNNING or req.in_prefill:
                continue
            n = 1 + len(self._trim_drafts(req))
            if self._reserve(req, req.num_computed + n):
                plan.append((req, n))
                budget -= n
        for req in list(self.running):
            if req.status == Status.RUNNING and req.in_prefill and budget > 0:
                n = self._logit_cap(req, min(budget, req.num_tokens - req.num_computed), lp)
                if n and self._reserve(req, req.num_computed + n):
                    plan.append((req, self._logit_cap(req, n, lp, take=True)))
                    budget -= n
        limit = 1 if self.suspects else self.max_running
        while self.waiting and budget > 0 and len(self.running) < limit:
            req = self.waiting[0]
            hit, part = self._lookup(req)
            m = len(hit) * self.kv.page_size + (part[1] if part else 0)
            n = self._logit_cap(req, min(budget, req.num_tokens - m), lp)
            on_device = sum(node.page >= 0 for node in hit)  # spilled ones come back into new pages
            if not n or self.kv.pages_for(m + n) - on_device > self._free_pages() or self.state.slots.num_free == 0:
                if hit or part:
                    self.prefix.release(hit + ([part[0]] if part else []))
                break
            self.waiting.pop(0)
            self._admit(req, hit, part)
            self._reserve(req, m + n)
            plan.append((req, self._logit_cap(req, n, lp, take=True)))
            budget -= n
        return [(r, n) for r, n in plan if r.status == Status.RUNNING]

    @staticmethod
    def _logit_cap(req: Request, n: int, left: list, take: bool = False) -> int:
        """n prefill tokens of req, at most the prompt-logprob rows left this step (left[0]; None: no limit) when req
        asks for prompt logprobs (each of its prompt positions is a logits row); take: the n planned, taken from left."""
        if left[0] is None or getattr(req.params, "prompt_logprobs", None) is None:
            return n
        if take:
            left[0] -= n
            return n
        return min(n, left[0])

    def _trim_drafts(self, req: Request) -> list[int]:
        """The drafts req may verify: none for requests that decode one token a step (Request.can_draft), and
        no more than what it may still generate after the target's own token (max_tokens, the context)."""
        room = min(req.params.max_tokens - len(req.output_ids), self._token_limit() - req.num_tokens) - 1
        req.drafts = req.drafts[:max(0, room)] if req.can_draft else []
        return req.drafts

    def _free_pages(self) -> int:
        return self.kv.pages.num_free + (self.prefix.num_evictable if self.prefix is not None else 0)

    def _lookup(self, req: Request) -> tuple[list, tuple | None]:
        """The cached path req can start after, and (node, n) when its tokens go on through the first n
        positions of a cached page (copied, not recomputed; attention-only models); references taken.
        ([], None) without the cache."""
        if self.prefix is None or getattr(req.params, "prompt_logprobs", None):
            return [], None  # prompt logprobs need the logits of every prompt position: computed, not reused
        limit = req.num_tokens - 1  # the last token is computed for its logits
        hit = self.prefix.match(req.all_ids, limit)
        if self.prefix.needs_snapshot:  # where its tokens leave the cached pages: a branch point worth a snapshot
            req.branch_at = len(self.prefix.match_pages(req.all_ids, limit)) * self.kv.page_size
        part = None
        if not self.prefix.needs_snapshot:
            node, n = self.prefix.match_partial(hit[-1] if hit else self.prefix.root, req.all_ids,
                                                len(hit) * self.kv.page_size, limit)
            part = (node, n) if node is not None else None
        self.prefix.acquire(hit + ([part[0]] if part else []))
        return hit, part

    def _admit(self, req: Request, hit: list | None = None, part: tuple | None = None) -> None:
        hit = hit or []
        req.state_slot = self.state.slots.alloc(1)[0]
        self._resets.append(req.state_slot)  # zeroed before the next pass (ScheduledBatch.state_resets)
        req.status = Status.RUNNING
        m = len(hit) * self.kv.page_size + (part[1] if part else 0)
        req.num_computed = m
        if self.prefix is not None:
            self._admit_hit(req, hit, part, m)
        self.running.append(req)

    def _admit_hit(self, req: Request, hit: list, part: tuple | None, m: int) -> None:
        """req starts after the cached path `hit` (and the head `part` of a cached page): its pages and
        snapshot, and the prefix cache's counters."""
        spilled = [node for node in hit if node.page < 0]  # fetched back from the host tier
        for node, page in zip(spilled, self._take_pages(len(spilled))):
            self.prefix.fetch(node, page)
        req.nodes, req.pages = list(hit), [node.page for node in hit]
        req.pending_copy = part  # copied into its next page when the batch is built
        if hit and self.prefix.needs_snapshot:
            if hit[-1].snap >= 0:
                req.pending_load = hit[-1].snap
            else:  # only in the host tier: copied straight into the request's slot
                self.prefix.load_host_snapshot(hit[-1], req.state_slot)
        t = self.prefix_totals
        if req.cached_tokens is None:  # first admission: what the usage reports
            req.cached_tokens = min(m, len(req.prompt_ids))
            t["requests"] += 1
            t["hits"] += m > 0
            t["prompt_tokens"] += len(req.prompt_ids)
            t["cached_tokens"] += req.cached_tokens
        t["saved_prefill_tokens"] += m

    def _take_pages(self, count: int) -> list[int]:
        """`count` free KV pages, evicting unreferenced cached ones if needed (admission counted them)."""
        if self.kv.pages.num_free < count:
            self.prefix.evict(count - self.kv.pages.num_free)
        return self.kv.pages.alloc(count) if count else []

    def _reserve(self, req: Request, tokens: int) -> bool:
        """Make sure req owns pages for `tokens` positions, evicting unreferenced cached pages, then
        preempting newer requests if needed."""
        need = self.kv.pages_for(tokens) - len(req.pages)
        while need > 0:
            if self.prefix is not None and self.kv.pages.num_free < need:
                self.prefix.evict(need - self.kv.pages.num_free)
            got = self.kv.pages.alloc(need)
            if got is not None:
                req.pages += got
                return True
            victim = self.running[-1]
            alone = victim is req and len(self.running) == 1
            self._preempt(victim)
            if victim is req:
                if alone:
                    self._stall(req)
                return False
        return True

    def _stall(self, req: Request) -> None:
        """req preempted itself with no other request running: with everything else evictable, the pool could not
        give it its pages. Once again after a retry from the cache, but STALL_LIMIT times in a row at the same
        length it never can: it ends with an error (take_stalled) instead of being recomputed for ever while the
        engine serves no one else (a safety net: the prefix cache's page sharing removed the case that did it)."""
        req.stalls = req.stalls + 1 if req.stall_at == req.num_tokens else 1
        req.stall_at = req.num_tokens
        if req.stalls >= STALL_LIMIT:
            log.error("request %s (%d tokens) cannot get its KV pages even alone; ending it", req.id, req.num_tokens)
            P = self.kv.page_size
            self._stalled.append(self.fail(
                req, f"the KV cache ({self.kv.num_pages * P} tokens) could not hold this request's "
                     f"{req.num_tokens} tokens with the pages it shares; it was ended after {req.stalls} attempts"))

    def take_stalled(self) -> list[StepOutput]:
        """The outputs of requests ended by _stall since the last call (the step loop returns them)."""
        out, self._stalled = self._stalled, []
        return out

    def _preempt(self, req: Request) -> None:
        log.warning("KV cache full: preempting %s (%d tokens), it will be recomputed", req.id, req.num_tokens)
        self._release(req)
        req.status = Status.WAITING
        req.num_computed = 0
        req.preemptions += 1
        self.waiting.insert(0, req)

    def _release(self, req: Request) -> None:
        req.drafts = []
        if req.pending:  # a token a launched step was still sampling: never emitted, so never generated
            req.output_ids.pop()
            req.pending = False
        if self.prefix is not None:
            # pages in the tree stay cached (unreferenced ones are evicted when pages run short)
            own = [p for p in req.pages if p not in self.prefix.owned]
            if own:
                self.kv.pages.free(own)
            self.prefix.release(req.nodes + ([req.pending_copy[0]] if req.pending_copy else []))
            req.nodes, req.pages, req.pending_load, req.roll_node, req.pending_copy = [], [], -1, None, None
        elif req.pages:
            self.kv.pages.free(req.pages)
            req.pages = []
        if req.state_slot >= 0:
            self.state.slots.free([req.state_slot])
            req.state_slot = -1
        if req in self.running:
            self.running.remove(req)

    def _plan_kv_copies(self, batch: ScheduledBatch) -> None:
        """Copy-on-write of the cached page a newly admitted request shares only the head of: its K/V
        head goes into the request's own page before the pass (nothing evicts it before then), and the
        reference taken at lookup is given back."""
        for s in batch.seqs:
            req = s.req
            if req.pending_copy is not None:
                node, n = req.pending_copy
                batch.kv_copies.append((node.page, req.pages[len(req.nodes)], n))
                self.prefix.release([node])
                req.pending_copy = None

    def _plan_state_copies(self, batch: ScheduledBatch) -> None:
        """Snapshot loads (hits, before the step) and saves: the state at the last page boundary before a
        prompt's last token (taken inside the prefill chunk that crosses it: ScheduledSeq.snapshots, or
        copied after the step when the chunk ends there) and at the page boundaries decoding reaches. Every
        load is done before any save, so a save may reuse the slot of a snapshot loaded in the same step."""
        for s in batch.seqs:
            if s.req.pending_load >= 0:
                batch.state_loads.append((s.req.pending_load, s.req.state_slot))
                s.req.pending_load = -1
        if not self.prefix.num_snap_slots:
            return
        for s in batch.seqs:
            self._plan_snapshots(s, batch)

    def _plan_snapshots(self, s: ScheduledSeq, batch: ScheduledBatch) -> None:
        """The snapshots one sequence's step writes (see _plan_state_copies)."""
        P, req, c, end = self.kv.page_size, s.req, s.cached, s.end
        # the last boundary a later request can resume from, and where this one left the cached pages
        # (a prefix shared with another request, e.g. a system prompt: the next one resumes there)
        points = sorted({(req.num_tokens - 1) // P * P, req.branch_at}) if self.config.prompt_snapshots else []
        for b in points:
            if s.prefill and c < b < end:
                slot = self._alloc_snapshot(req, b, rolling=False)
                s.snapshots += ((b - c, slot),) if slot >= 0 else ()
        if end % P or not ((s.prefill and end in points) or end == req.num_tokens):
            return
        if s.verify:
            return  # its snapshot is taken once it knows what it kept (_roll_snapshot)
        rolling = not s.prefill  # a decode step: replaces this request's previous decode snapshot
        if rolling and req.roll_node is not None:
            self.prefix.drop_snapshot(req.roll_node)
            req.roll_node = None
        slot = self._alloc_snapshot(req, end, rolling)
        if slot >= 0:
            batch.state_saves.append((req.state_slot, slot))

    def _alloc_snapshot(self, req: Request, tokens: int, rolling: bool) -> int:
        """A snapshot slot for req's state after `tokens` tokens, attached to its node after the step; -1
        when every slot holds a snapshot this step is writing."""
        slot = self.prefix.alloc_snapshot()
        if slot >= 0:
            self._pending_snaps.append((req, tokens, slot, rolling))
        return slot

    def _adopt_children(self, batch: ScheduledBatch) -> None:
        """Parents whose prefill this step ends hand it to their held children: each child gets its own
        pages and state slot now, and the engine copies the parent's prompt K/V and linear state into them
        after the pass (ScheduledBatch.forks). A child that finds no room is queued and prefills itself."""
        for s in batch.seqs:
            kids = self.held.pop(s.req.id, None) if s.samples and not s.req.output_ids else None
            for kid in kids or []:
                if kid.status == Status.FINISHED:
                    continue
                n = len(kid.prompt_ids)
                if self.state.slots.num_free == 0 or self.kv.pages_for(n + 1) > self.kv.pages.num_free \
                        or len(self.running) >= self.max_running:
                    self.waiting.append(kid)
                    continue
                self._admit(kid)
                kid.pages = self.kv.pages.alloc(self.kv.pages_for(n))
                kid.num_computed = n
                batch.forks.append((kid, s.req))

    def draft_room(self, req: Request, position: int) -> bool:
        """req owns the page of `position`, taking a free one if needed (never evicting or preempting: a
        speculative draft is not worth it)."""
        need = position // self.kv.page_size + 1 - len(req.pages)
        if need <= 0:
            return True
        got = self.kv.pages.alloc(need)
        if got is None:
            return False
        req.pages += got
        return True

    # ---- postprocess -------------------------------------------------------------------------
    def postprocess(self, batch: ScheduledBatch, result: StepResult) -> list[StepOutput]:
        """After the engine computed `batch`: the requests advance, their full pages enter the prefix tree,
        the snapshots written are attached, and the tokens are appended (stops, finishing, freeing). A
        request whose own work failed (result.failed, or its text here) finishes with "error" alone."""
        for s in batch.seqs:
            if s.verify:
                continue  # advanced by what it kept (_accept)
            s.req.num_computed += s.n
            if self.prefix is not None:
                self._cache_pages(s.req)
        if self._pending_snaps:
            self._attach_snapshots()
        outs, now = [], time.perf_counter()
        for req, toks in result.verified:
            outs += self._accept(req, toks, now, batch)
        now = time.perf_counter()
        outs += [self._emit_guarded(req, tok, lp, now) for req, tok, lp in result.sampled]
        return outs + [self.fail(req, why, refused=refused) for req, why, refused in result.failed]

    # ---- overlapped decode (engine/llm_engine.py): a step launched before the last one's tokens are known ---------
    def advance(self, batch: ScheduledBatch) -> None:
        """`batch` (one decoded token per request) is launched and its tokens are still on the device: each request
        that runs advances past the token it computed and gets a PENDING placeholder for the one being sampled, so
        the next schedule() plans the step after (whose input the engine reads on the device). `resolve` puts the
        token in; the bookkeeping of postprocess runs now (pages into the prefix tree, snapshots attached)."""
        for s in batch.seqs:
            if s.req.status != Status.RUNNING:
                continue
            s.req.num_computed += s.n
            if self.prefix is not None:
                self._cache_pages(s.req)
        if self._pending_snaps:
            self._attach_snapshots()
        for s in batch.seqs:
            if s.req.status == Status.RUNNING:
                s.req.output_ids.append(PENDING)
                s.req.pending = True

    def resolve(self, sampled: list[tuple[Request, int]]) -> list[StepOutput]:
        """The tokens of an advanced batch, now read: each running request's PENDING placeholder becomes its token
        (emitted: text, stops, finishing). Requests that ended meanwhile (aborted, or stopped by the token before)
        dropped their placeholder when released; their token is discarded."""
        outs, now = [], time.perf_counter()
        for req, tok in sampled:
            if req.status != Status.RUNNING or not req.pending:
                continue
            req.output_ids.pop()
            req.pending = False
            outs.append(self._emit_guarded(req, tok, None, now))
        return outs

    def overlap_room(self) -> bool:
        """Whether the next step of every running request can be planned before its pending token is known: no
        admissions or held children waiting, every running request decoding with a pending token, none at its
        length limit (its pending token may be its last), and free pages for every next position (no preemption,
        which would recompute a placeholder)."""
        if self.waiting or self.held or self.suspects or not self.running:
            return False
        need, limit = 0, self._token_limit()
        for r in self.running:
            if r.status != Status.RUNNING or not r.pending or r.in_prefill or r.drafts:
                return False
            if len(r.output_ids) >= r.params.max_tokens or r.num_tokens >= limit:
                return False
            need += len(r.pages) < self.kv.pages_for(r.num_tokens)
        return need <= self.kv.pages.num_free

    def _cache_pages(self, req: Request) -> None:
        """Put req's newly filled pages into the tree, or share the node another request made first: req then
        reads the node's page and its own copy goes back to the pool (a spilled node takes req's page instead of
        its host copy). Holding both had a request that recomputed a cached prefix it could not resume from (a
        linear-state model with no snapshot there) need its pages twice: where the pool held one prompt, it
        preempted itself at every admission, for ever."""
        P, tree = self.kv.page_size, self.prefix
        if req.num_computed // P <= len(req.nodes):
            return
        ids = req.all_ids
        parent = req.nodes[-1] if req.nodes else tree.root
        for i in range(len(req.nodes), req.num_computed // P):
            own = req.pages[i]
            node, adopted = tree.insert(parent, tuple(ids[i * P:(i + 1) * P]), own)
            if not adopted and node.page != own:
                if node.page >= 0:
                    req.pages[i] = node.page  # same tokens after the same prefix: the same K/V
                    self.kv.pages.free([own])
                else:
                    tree.adopt(node, own)
            tree.acquire([node])
            req.nodes.append(node)
            parent = node

    def _attach_snapshots(self) -> None:
        for req, end, slot, rolling in self._pending_snaps:
            k = end // self.kv.page_size
            if req.status != Status.RUNNING or len(req.nodes) < k:
                self.prefix.free_snapshot(slot)
                continue
            if self.prefix.attach_snapshot(req.nodes[k - 1], slot) and rolling:
                req.roll_node = req.nodes[k - 1]
        self._pending_snaps = []

    def _accept(self, req: Request, toks: list[int], now: float, batch: ScheduledBatch) -> list[StepOutput]:
        """A verify step kept len(toks) - 1 drafts and one token of the target (the engine rolled the linear
        state back to the last kept position): req advances by them, its full pages enter the tree, and the
        pages past the kept tokens go back to the pool."""
        req.num_computed += len(toks)
        outs = []
        for tok in toks:
            outs.append(self._emit_guarded(req, tok, None, now))
            if req.status == Status.FINISHED:
                break
        if req.status != Status.RUNNING:
            return outs
        if self.prefix is not None:  # the kept tokens are in all_ids now: full pages enter the tree
            self._cache_pages(req)
            if self.prefix.needs_snapshot and self.prefix.num_snap_slots \
                    and req.num_computed % self.kv.page_size == 0:
                self._roll_snapshot(req, batch)
        self._trim_pages(req, req.num_tokens)
        return outs

    def _roll_snapshot(self, req: Request, batch: ScheduledBatch) -> None:
        """A verify step that kept req's state at a page boundary: the rolling decode snapshot there (as a
        decode step's would be, copied by the engine right after this step: ScheduledBatch.after_copies)."""
        k = req.num_computed // self.kv.page_size
        if len(req.nodes) < k:
            return
        if req.roll_node is not None:
            self.prefix.drop_snapshot(req.roll_node)
            req.roll_node = None
        slot = self.prefix.alloc_snapshot()
        if slot < 0:
            return
        batch.after_copies.append((req.state_slot, slot))
        if self.prefix.attach_snapshot(req.nodes[k - 1], slot):
            req.roll_node = req.nodes[k - 1]

    def _trim_pages(self, req: Request, tokens: int) -> None:
        keep = self.kv.pages_for(tokens)
        if len(req.pages) > keep:  # pages past the kept tokens are the request's own (never in the tree)
            self.kv.pages.free(req.pages[keep:])
            del req.pages[keep:]

    def _emit_guarded(self, req: Request, tok: int, lp, now: float) -> StepOutput:
        """_emit, where a failure of req's own text (its detokenizer, its stop strings) ends req alone: the
        others of the step keep the tokens they were given, which a retry of the whole step would lose
        (with the end of any that finished in it)."""
        try:
            return self._emit(req, tok, lp, now)
        except Exception as e:
            log.exception("request %s failed on its token %d; the others in the step go on", req.id, tok)
            return self.fail(req, f"internal error: {type(e).__name__}: {e}", tok)

    def _emit(self, req: Request, tok: int, lp, now: float) -> StepOutput:
        """Append one generated token to req: its text (the detokenizer the engine attached), finishing."""
        first = req.first_token_at is None
        if first:
            req.first_token_at = now
        req.output_ids.append(tok)
        if lp is not None:
            req.output_lps.append(lp)
        delta = req.detok.add(tok) if req.detok is not None else ""
        reason = self._finish_reason(req, tok)
        if reason is not None:
            if req.detok is not None and not req.detok.stopped:
                delta += req.detok.flush()
            self._finish(req, reason)
        return StepOutput(req, tok, delta, reason is not None, lp, req.prompt_lps if first and req.prompt_lps else None)

    def _finish_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if req.detok is not None and req.detok.stopped:
            return FinishReason.STOP.value
        if (tok in self.eos and not p.ignore_eos) or tok in p.stop_token_ids:
            return FinishReason.STOP.value
        if req.matcher is not None and req.matcher.done:  # the grammar is complete
            return FinishReason.STOP.value
        if len(req.output_ids) >= p.max_tokens or req.num_tokens >= self._token_limit():
            return FinishReason.LENGTH.value
        return None

    def _token_limit(self) -> int:
        """Tokens a request may reach: the context, and the KV pool (whose pages must hold every token but
        the last). A request that outgrows the whole pool finishes with "length" instead of preempting itself
        and being recomputed forever."""
        return min(self.max_seq_len, self.kv.num_pages * self.kv.page_size + 1)

    def _finish(self, req: Request, reason: str) -> None:
        self._release(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if self.held:
            self._release_children(req)
            if req.parent in self.held and req in self.held[req.parent]:
                self.held[req.parent].remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finished_at = time.perf_counter()
        self.requests.pop(req.id, None)
        self.suspects.discard(req.id)

    def _release_children(self, req: Request) -> None:
        """A parent that ends before its prefill did: its children prefill themselves."""
        for kid in self.held.pop(req.id, []):
            if kid.status != Status.FINISHED:
                self.waiting.append(kid)

    def check_integrity(self) -> None:
        self.kv.pages.check_integrity()
        self.state.slots.check_integrity()
        if self.prefix is None:
            owned = sum(len(r.pages) for r in self.running)
        else:
            self.prefix.check_integrity()
            owned = self.prefix.num_pages + sum(len([p for p in r.pages if p not in self.prefix.owned])
                                                for r in self.running)
            for r in self.running:
                assert [n.page for n in r.nodes] == [p if p in self.prefix.owned else n.page
                                                     for n, p in zip(r.nodes, r.pages)]
        assert owned == self.kv.pages.num_used, (owned, self.kv.pages.num_used)

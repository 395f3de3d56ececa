"""Continuous batching with chunked prefill.

Each step: every running request that is decoding contributes one token; the remaining token budget
(`chunked_prefill_size`) goes to prefill chunks, first of running requests, then of waiting ones
admitted while a state slot and KV pages are free. KV pages are taken as tokens arrive; when none is
left the prefix cache gives back unreferenced pages, then the newest running request is preempted (its
caches freed, recomputed later from its tokens).

Prefix cache (kvcache/prefix.py, on unless --disable-prefix-cache): a request admitted from the queue
starts after the longest cached run of full pages of its tokens (at most all but the last token), and
its pages enter the tree as they fill. For models with Gated DeltaNet layers the run must end at a state
snapshot: the request's slot is loaded from it before its first step (ForwardBatch.state_loads); a prompt's
prefill saves one at its last page boundary and where it leaves the cached pages (taken inside the chunk
that crosses it, SeqMeta.snapshots), and decoding saves one at each page boundary, replacing that request's
previous one (ForwardBatch.state_saves, copied after the step). Attention-only models also copy the shared
head of a page a request leaves midway (ForwardBatch.kv_copies); with a host tier, evicted pages and
snapshots are spilled to host memory and fetched back on a hit (ForwardBatch.host_copies).
"""
from __future__ import annotations

import logging
import time

import torch

from ..core import ConfigError, FinishReason, RequestError
from ..batch import ForwardBatch, SeqMeta
from ..engine.sampler import apply_bitmask, apply_penalties, logprobs_of, make_generator, sample, verify_drafts
from ..kvcache.prefix import PrefixCache
from .request import Request, Status, StepOutput

log = logging.getLogger("moestream.scheduler")


class Scheduler:
    def __init__(self, engine, eos_token_ids: list[int], tokenizer=None):
        self.engine = engine
        self.kv = engine.caches.kv
        self.state = engine.caches.state
        self.eos = set(eos_token_ids)
        self.tokenizer = tokenizer
        self.max_running = engine.ecfg.max_running_requests
        self.chunk = engine.ecfg.chunked_prefill_size
        self.max_seq_len = engine.max_seq_len
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.last_step: dict = {}
        # After a failed step: ids of the requests that were in it, run one at a time until they end,
        # so a request that fails again fails alone and the others go on.
        self.suspects: set[str] = set()
        self.prefix: PrefixCache | None = None
        if engine.ecfg.prefix_cache:
            linear, host = self.state.conv is not None, engine.caches.host
            self.prefix = PrefixCache(self.kv.pages, self.kv.page_size, needs_snapshot=linear,
                                      snap_slots=self.state.snapshot_slots if linear else None,
                                      host_pages=host.num_pages if host else 0, host_snaps=host.num_snaps if host else 0)
        self._host_unsure = False  # a failed step carried host-tier copies: drop the cache once it is released
        self._pending_snaps: list[tuple[Request, int, int, bool]] = []  # (req, tokens, slot, rolling)
        self.prefix_totals = {"requests": 0, "hits": 0, "prompt_tokens": 0, "cached_tokens": 0,
                              "saved_prefill_tokens": 0}
        # n > 1: children waiting for their parent's prefill, which they copy (KV positions + linear state)
        self.held: dict[str, list[Request]] = {}
        self._rows = None  # (prompt logprob rows, sampling rows) of the step being built, when they differ
        self.grammars = None  # tokenizer.grammar.Grammars, built at the first constrained request
        tok = tokenizer
        self.think_start = tok.token_to_id("<think>") if tok is not None else None
        self.think_end = tok.token_to_id("</think>") if tok is not None else None
        # what a spent thinking budget forces: the end of the block, as the chat templates write it
        self.think_close = tok.encode("\n</think>\n\n") if tok is not None and self.think_end is not None else []
        # --speculative mtp: K drafts per decoding request and step, verified in the next forward pass
        self.spec_k = engine.ecfg.num_speculative_tokens if getattr(engine, "use_mtp", False) else 0
        self.spec_totals = {"verify_steps": 0, "drafted": 0, "accepted": 0, "emitted": 0,
                            "drafted_at": [0] * self.spec_k, "accepted_at": [0] * self.spec_k}
        self._spec: list[tuple[Request, int, int, list[int]]] = []  # (req, first logits row, n, checkpoints)

    # ---- requests ------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        n = len(req.prompt_ids)
        if n == 0:
            raise RequestError("the prompt is empty")
        if n >= self.max_seq_len:
            raise RequestError(f"the prompt has {n} tokens; this server's context is {self.max_seq_len} tokens "
                               f"(prompt plus at least one generated token must fit)")
        if self.kv.pages_for(n + 1) > self.kv.num_pages:
            raise RequestError(f"the prompt has {n} tokens but the KV cache holds only "
                               f"{self.kv.num_pages * self.kv.page_size}; raise --num-tokens")
        vocab = self.engine.cfg.vocab_size
        if any(not 0 <= t < vocab for t in req.prompt_ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        req.generator = make_generator(req.params, self.engine.device)
        if req.params.grammar and req.matcher is None:
            if self.grammars is None:
                from ..tokenizer.grammar import Grammars

                if self.tokenizer is None:
                    raise RequestError("structured outputs need the model's tokenizer")
                self.grammars = Grammars(self.tokenizer, vocab, sorted(self.eos))
            req.matcher = self.grammars.matcher(req.params.grammar)
        req.thinking = req.params.reasoning_open
        if req.matcher is not None and not req.thinking:
            req.matcher.prefetch()  # the first mask is built while the prompt is prefilled
        if req.params.prompt_logprobs is not None and not req.prompt_lps:
            req.prompt_lps = [None]
        if self.tokenizer is not None and req.detok is None:
            from ..tokenizer import IncrementalDetokenizer

            req.detok = IncrementalDetokenizer(self.tokenizer, stop=req.params.stop,
                                               skip_special_tokens=req.params.skip_special_tokens)
        self.requests[req.id] = req
        parent = self.requests.get(req.parent) if req.parent else None
        if (parent is not None and parent.status != Status.FINISHED and parent.prompt_ids == req.prompt_ids
                and not parent.output_ids and req.params.prompt_logprobs is None
                and self.engine.ecfg.tp_size == 1):  # tensor parallel ranks would need the copies too
            self.held.setdefault(parent.id, []).append(req)  # admitted when the parent's prefill is done
        else:
            self.waiting.append(req)

    def abort(self, req_id: str, reason: str = FinishReason.ABORT.value) -> bool:
        req = self.requests.get(req_id)
        if req is None or req.status == Status.FINISHED:
            return False
        self._finish(req, reason)
        return True

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
        if self.spec_k:
            out["speculative"] = self.spec_stats()
        if self.prefix is not None:
            t = self.prefix_totals
            out["prefix_cache"] = {**self.prefix.stats(), **t, **self._host_bytes(),
                                   "hit_rate": t["cached_tokens"] / t["prompt_tokens"] if t["prompt_tokens"] else 0.0}
        return out

    def spec_stats(self) -> dict:
        """Speculative decoding's counters: drafts proposed and accepted (in all and per draft position),
        verify steps, tokens emitted by them (accepted drafts + the target's own token)."""
        t = self.spec_totals
        rate = [a / d if d else 0.0 for a, d in zip(t["accepted_at"], t["drafted_at"])]
        return {"method": "mtp", "num_speculative_tokens": self.spec_k, **{k: v for k, v in t.items()
                if not isinstance(v, list)}, "drafted_per_position": list(t["drafted_at"]),
                "accepted_per_position": list(t["accepted_at"]), "acceptance_rate_per_position": rate,
                "acceptance_rate": t["accepted"] / t["drafted"] if t["drafted"] else 0.0,
                "tokens_per_verify_step": t["emitted"] / t["verify_steps"] if t["verify_steps"] else 0.0}

    def _host_bytes(self) -> dict:
        """Bytes moved to and from the prefix cache's host tier (this rank's)."""
        host, tree = self.engine.caches.host, self.prefix
        if host is None:
            return {"host_spill_bytes": 0, "host_fetch_bytes": 0}
        page, snap = host.page_bytes, host.snap_bytes
        return {"host_spill_bytes": tree.spilled_pages * page + tree.spilled_snaps * snap,
                "host_fetch_bytes": tree.fetched_pages * page + tree.fetched_snaps * snap}

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

    # ---- live cache rebuild ----------------------------------------------------------------
    def resize_caches(self, kv_tokens: int | None = None, moe_slots: int | str | None = None) -> dict:
        """Between steps: a KV pool of kv_tokens tokens (rounded up to whole pages; None: as now) and moe_slots
        expert slots ("auto": the slots that fit; None: as now). Requests in flight keep their pages (moved
        below the new size when they sit above it) and their linear state; unreferenced prefix-cache pages are
        evicted, least recently used first, until the rest fits. Refused, nothing changed: RequestError for a
        value this server cannot take, ConfigError (with the reason) when the plan does not fit the memory
        budget or the requests in flight could not go on."""
        t0 = time.perf_counter()
        kv, P, old = self.kv, self.kv.page_size, self.engine.plan
        for name, v in (("KV tokens", kv_tokens), ("expert slots", None if moe_slots == "auto" else moe_slots)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise RequestError(f"{name} must be a positive integer, got {v!r}")
        pages = kv.pages_for(kv_tokens) if kv_tokens is not None else kv.num_pages
        slots = None if moe_slots == "auto" else moe_slots if moe_slots is not None else (old.cache_slots or None)
        self._check_room(pages)
        plan, ecfg = self.engine.plan_caches(pages * P, slots)
        # nothing has changed up to here
        evicted = self.prefix.evict(kv.pages.num_used - pages) if self.prefix is not None else 0
        keep = self._page_map(pages)
        before = kv.num_pages * P
        self.engine.resize_caches(plan, ecfg, keep)
        for req in self.running:
            req.pages = [keep[p] for p in req.pages]
        if self.prefix is not None:
            self.prefix.renumber(keep)
        report = {"kv_tokens": {"before": before, "after": pages * P},
                  "moe_slots": {"before": old.cache_slots, "after": plan.cache_slots},
                  "total_experts": plan.total_experts, "backend": plan.backend, "running": len(self.running),
                  "queued": len(self.waiting), "moved_pages": sum(a != b for a, b in keep.items()),
                  "evicted_prefix_pages": evicted, "rebuild_s": time.perf_counter() - t0}
        log.info("cache rebuild in %.3f s: KV %d -> %d tokens, expert slots %d -> %d of %d; %d requests in flight "
                 "(%d pages moved), %d queued, %d prefix-cache pages evicted", report["rebuild_s"], before, pages * P,
                 old.cache_slots, plan.cache_slots, plan.total_experts, report["running"], report["moved_pages"],
                 report["queued"], evicted)
        return report

    def _check_room(self, pages: int) -> None:
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

    def _page_map(self, pages: int) -> dict[int, int]:
        """Old page id -> new for every page in use: ids below `pages` stay, the others take free low ids."""
        used = self.kv.pages.used_ids()
        keep = {p: p for p in used if p < pages}
        spare = (i for i in range(pages) if i not in keep)
        for p in used:
            if p >= pages:
                keep[p] = next(spare)
        return keep

    def _forget_unsure_host_copies(self) -> None:
        """A failed step may not have run its host-tier copies, so the tree may name pages and snapshots
        whose bytes were never copied: drop every cached node (none is referenced any more)."""
        if self._host_unsure:
            self.prefix.clear()
            self._host_unsure = False

    # ---- one step --------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        plan = self._plan()
        if not plan:
            return []
        batch, sample_reqs = self._build_batch(plan)
        decode = sum(1 for r, _ in plan if not r.in_prefill)
        prefill_seqs = len(plan) - decode
        prefill_tokens = sum(n for r, n in plan if r.in_prefill)
        before = [(r, r.num_computed) for r, _ in plan]
        decoding = {r.id for r, _ in plan if not r.in_prefill}
        t0 = time.perf_counter()
        try:
            logits = self.engine.forward(batch)
        except BaseException:
            for _, _, slot, _ in self._pending_snaps:  # never written: the step did not finish
                self.prefix.free_snapshot(slot)
            self._pending_snaps = []
            self._spec = []
            self._host_unsure = self._host_unsure or bool(batch.host_copies)
            raise
        outputs = self._apply(plan, sample_reqs, logits)
        if self.spec_k:
            try:
                self._draft(before, batch)
            except Exception:  # drafts only save time: this step's tokens are already out, keep them
                log.exception("the MTP drafter failed; these requests decode without drafts this step")
                for req, _ in before:
                    req.drafts = []
            # decode requests' tokens this step (a verify step emits up to K + 1 per request)
            decode = sum(1 for o in outputs if o.request.id in decoding)
        self.last_step = {"seconds": time.perf_counter() - t0, "tokens": batch.num_tokens, "decode": decode,
                          "prefill_tokens": prefill_tokens, "prefill_seqs": prefill_seqs,
                          "running": len(self.running), "waiting": len(self.waiting)}
        return outputs

    def _plan(self) -> list[tuple[Request, int]]:
        """Choose (request, number of new tokens) for this step, allocating pages and slots."""
        plan: list[tuple[Request, int]] = []
        budget = self.chunk
        for req in list(self.running):
            if req.status != Status.RUNNING or req.in_prefill:
                continue
            n = 1 + len(self._trim_drafts(req))
            if self._reserve(req, req.num_computed + n):
                plan.append((req, n))
                budget -= n
        for req in list(self.running):
            if req.status == Status.RUNNING and req.in_prefill and budget > 0:
                n = min(budget, req.num_tokens - req.num_computed)
                if self._reserve(req, req.num_computed + n):
                    plan.append((req, n))
                    budget -= n
        limit = 1 if self.suspects else self.max_running
        while self.waiting and budget > 0 and len(self.running) < limit:
            req = self.waiting[0]
            hit, part = self._lookup(req)
            m = len(hit) * self.kv.page_size + (part[1] if part else 0)
            n = min(budget, req.num_tokens - m)
            on_device = sum(node.page >= 0 for node in hit)  # spilled ones come back into new pages
            if self.kv.pages_for(m + n) - on_device > self._free_pages() or self.state.slots.num_free == 0:
                if hit or part:
                    self.prefix.release(hit + ([part[0]] if part else []))
                break
            self.waiting.pop(0)
            self._admit(req, hit, part)
            self._reserve(req, m + n)
            plan.append((req, n))
            budget -= n
        return [(r, n) for r, n in plan if r.status == Status.RUNNING]

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
        self.state.reset(req.state_slot)
        req.status = Status.RUNNING
        m = len(hit) * self.kv.page_size + (part[1] if part else 0)
        req.num_computed = m
        if self.prefix is not None:
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
        self.running.append(req)

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
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        log.warning("KV cache full: preempting %s (%d tokens), it will be recomputed", req.id, req.num_tokens)
        self._release(req)
        req.status = Status.WAITING
        req.num_computed = 0
        req.preemptions += 1
        self.waiting.insert(0, req)

    def _release(self, req: Request) -> None:
        req.drafts = []
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

    def _build_batch(self, plan: list[tuple[Request, int]]) -> tuple[ForwardBatch, list[Request]]:
        dev = self.engine.device
        ids, pos, seqs, logit_rows, sample_reqs = [], [], [], [], []
        # prompt_logprobs: (request, prompt token index, logits row) of the extra rows this step computes
        prompt_rows: list[tuple[Request, int, int]] = []
        sample_rows: list[int] = []
        start = 0
        ckpt = self.state.checkpoint_slots if self.spec_k else []
        self._spec = []
        for req, n in plan:
            c = req.num_computed
            kv_index = self.kv.flat_index(req.pages, 0, c + n, dev)
            pos += range(c, c + n)
            if n > 1 and not req.in_prefill:  # verify: the newest token and its drafts, every row's logits
                j = len(self._spec) * self.spec_k
                slots = ckpt[j:j + n - 1] if ckpt else None  # the state after each position but the last
                ids += req.all_ids[c:c + 1] + req.drafts[:n - 1]
                seqs.append(SeqMeta(start=start, length=n, cached=c, state_slot=req.state_slot, kv_index=kv_index,
                                    checkpoints=slots))
                self._spec.append((req, len(logit_rows), n, slots or []))
                logit_rows += range(start, start + n)
                start += n
                continue
            ids += req.all_ids[c:c + n]
            seqs.append(SeqMeta(start=start, length=n, cached=c, state_slot=req.state_slot, kv_index=kv_index))
            if req.prompt_lps:  # the row at position j predicts prompt token j + 1
                for j in range(max(c, len(req.prompt_lps) - 1), min(c + n, len(req.prompt_ids) - 1)):
                    prompt_rows.append((req, j + 1, len(logit_rows)))
                    logit_rows.append(start + j - c)
            if c + n == req.num_tokens:  # the chunk reaches the newest token: sample the next one
                if not logit_rows or logit_rows[-1] != start + n - 1:
                    logit_rows.append(start + n - 1)
                sample_rows.append(len(logit_rows) - 1)
                sample_reqs.append(req)
            start += n
        self._rows = (prompt_rows, sample_rows) if prompt_rows or self._spec else None
        write = torch.cat([s.kv_index[s.cached:] for s in seqs])
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(pos, dtype=torch.long, device=dev),
            seqs=seqs, kv_write_index=write,
            logits_index=torch.tensor(logit_rows, dtype=torch.long, device=dev),
            state_slots=torch.tensor([s.state_slot for s in seqs], dtype=torch.long, device=dev),
            prompt=any(req.num_computed < len(req.prompt_ids) for req, _ in plan),
        )
        if self.spec_k:
            batch.extra["keep_hidden"] = True  # the drafter reads every row's final hidden state
            if self._spec and len(self._spec) + sum(1 for s in seqs if s.length == 1) == len(seqs):
                batch.extra["decode_like"] = True  # decode and verify rows only: decode's kernels (engine)
        if self.prefix is not None:
            self._plan_kv_copies(plan, batch)
        if self.prefix is not None and self.prefix.needs_snapshot:
            self._plan_state_copies(plan, batch)
        if self.prefix is not None and self.prefix.host_ops:  # last: state copies may spill snapshots
            batch.host_copies, self.prefix.host_ops = self.prefix.host_ops, []
        return batch, sample_reqs

    def _plan_kv_copies(self, plan, batch: ForwardBatch) -> None:
        """Copy-on-write of the cached page a newly admitted request shares only the head of: its K/V
        head goes into the request's own page before the pass (nothing evicts it before then), and the
        reference taken at lookup is given back."""
        for req, _ in plan:
            if req.pending_copy is not None:
                node, n = req.pending_copy
                batch.kv_copies.append((node.page, req.pages[len(req.nodes)], n))
                self.prefix.release([node])
                req.pending_copy = None

    def _plan_state_copies(self, plan, batch: ForwardBatch) -> None:
        """Snapshot loads (hits, before the step) and saves: the state at the last page boundary before a
        prompt's last token (taken inside the prefill chunk that crosses it: SeqMeta.snapshots, or copied
        after the step when the chunk ends there) and at the page boundaries decoding reaches. Every load
        is done before any save, so a save may reuse the slot of a snapshot loaded in the same step."""
        P = self.kv.page_size
        for req, _ in plan:
            if req.pending_load >= 0:
                batch.state_loads.append((req.pending_load, req.state_slot))
                req.pending_load = -1
        if not self.prefix.num_snap_slots:
            return
        prompt_snaps = self.engine.ecfg.prefix_cache_prompt_snapshot == "on"
        for (req, n), seq in zip(plan, batch.seqs):
            c, end = req.num_computed, req.num_computed + n
            # the last boundary a later request can resume from, and where this one left the cached pages
            # (a prefix shared with another request, e.g. a system prompt: the next one resumes there)
            points = sorted({(req.num_tokens - 1) // P * P, req.branch_at}) if prompt_snaps else []
            for b in points:
                if req.in_prefill and c < b < end:
                    slot = self._alloc_snapshot(req, b, rolling=False)
                    seq.snapshots += ((b - c, slot),) if slot >= 0 else ()
            if end % P or not ((req.in_prefill and end in points) or end == req.num_tokens):
                continue
            if n > 1 and not req.in_prefill:
                continue  # a verify step: its snapshot is taken once it knows what it kept (_roll_snapshot)
            rolling = not req.in_prefill  # a decode step: replaces this request's previous decode snapshot
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

    def _cache_pages(self, req: Request) -> None:
        """Put req's newly filled pages into the tree (or share the node another request made first)."""
        P, tree = self.kv.page_size, self.prefix
        if req.num_computed // P <= len(req.nodes):
            return
        ids = req.all_ids
        parent = req.nodes[-1] if req.nodes else tree.root
        for i in range(len(req.nodes), req.num_computed // P):
            node, _ = tree.insert(parent, tuple(ids[i * P:(i + 1) * P]), req.pages[i])
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

    def _apply(self, plan, sample_reqs: list[Request], logits: torch.Tensor) -> list[StepOutput]:
        verified = {id(r) for r, *_ in self._spec}
        for req, n in plan:
            if id(req) in verified:
                continue  # advanced by what it accepts (_verify)
            req.num_computed += n
            if self.prefix is not None:
                self._cache_pages(req)
        if self._pending_snaps:
            self._attach_snapshots()
        rows, self._rows = self._rows, None
        spec_outs = []
        if rows is not None:  # prompt_logprobs or verify steps asked for extra rows: split them off
            prompt_rows, sample_rows = rows
            if prompt_rows:
                self._prompt_logprobs(logits, prompt_rows)
            spec_outs = self._verify(logits)
            logits = logits[torch.tensor(sample_rows, dtype=torch.long, device=logits.device)]
        return spec_outs + self._sample(sample_reqs, logits)

    def _sample(self, sample_reqs: list[Request], logits: torch.Tensor) -> list[StepOutput]:
        """One token for each request that reached its newest token (logits: one row each)."""
        if self.held:
            sample_reqs, logits = self._adopt_children(sample_reqs, logits)
        if not sample_reqs:
            return []
        raw = logits
        for req in sample_reqs:  # a spent thinking budget closes the block
            p = req.params
            if (req.thinking and p.max_thinking_tokens is not None and not req.forced
                    and req.thinking_tokens >= p.max_thinking_tokens and self.think_end is not None):
                close = list(self.think_close) or [self.think_end]
                if req.matcher is not None and self.think_end in close:  # the grammar starts right after it
                    close = close[:close.index(self.think_end) + 1]
                req.forced = close
        # penalties, logit_bias, min_tokens and grammar masks touch only the rows of requests that use them
        touched = [i for i, r in enumerate(sample_reqs)
                   if (r.params.needs_processing or (r.matcher is not None and not r.thinking)) and not r.forced]
        if touched:
            logits = logits.clone()
            for i in touched:
                self._process_row(sample_reqs[i], logits[i])
        tokens = sample(logits, [r.params for r in sample_reqs], [r.generator for r in sample_reqs])
        for i, req in enumerate(sample_reqs):
            if req.forced:
                tokens[i] = req.forced.pop(0)
        lps = self._logprobs(raw, sample_reqs, tokens)
        now = time.perf_counter()
        return [self._emit(req, tok, lps.get(i), now) for i, (req, tok) in enumerate(zip(sample_reqs, tokens))]

    def _emit(self, req: Request, tok: int, lp, now: float) -> StepOutput:
        """Append one generated token to req: reasoning and grammar bookkeeping, text, finishing."""
        first = req.first_token_at is None
        if first:
            req.first_token_at = now
        req.output_ids.append(tok)
        if lp is not None:
            req.output_lps.append(lp)
        self._track(req, tok)
        delta = req.detok.add(tok) if req.detok is not None else ""
        reason = self._finish_reason(req, tok)
        if reason is not None:
            if req.detok is not None and not req.detok.stopped:
                delta += req.detok.flush()
            self._finish(req, reason)
        return StepOutput(req, tok, delta, reason is not None, lp, req.prompt_lps if first and req.prompt_lps else None)

    # ---- speculative decoding (--speculative mtp) -------------------------------------------
    def _can_draft(self, req: Request) -> bool:
        """Drafts for requests sampled from the plain (tempered, top-k/p, min-p) distribution; logits
        processing, grammars, logprobs and forced tokens decode one token a step."""
        p = req.params
        return not (p.needs_processing or req.matcher is not None or p.logprobs is not None or req.forced
                    or (req.thinking and p.max_thinking_tokens is not None))

    def _trim_drafts(self, req: Request) -> list[int]:
        """The drafts req may verify: none for requests that decode one token a step (_can_draft), and no more
        than what it may still generate after the target's own token (max_tokens, the context)."""
        room = min(req.params.max_tokens - len(req.output_ids), self._token_limit() - req.num_tokens) - 1
        req.drafts = req.drafts[:max(0, room)] if self._can_draft(req) else []
        return req.drafts

    def _verify(self, logits: torch.Tensor) -> list[StepOutput]:
        """Each verified request keeps its longest agreeing prefix of drafts plus one token of the target
        (sampler.verify_drafts); the linear state rolls back to the last kept position (one slot copy), and
        the pages past the kept tokens go back to the pool."""
        outs, now, t = [], time.perf_counter(), self.spec_totals
        spec, self._spec = self._spec, []
        for req, row, n, slots in spec:
            drafts, req.drafts = req.drafts[:n - 1], []
            toks = verify_drafts(logits[row:row + n], drafts, req.params, req.generator)
            a = len(toks) - 1
            t["verify_steps"] += 1
            t["drafted"] += len(drafts)
            t["accepted"] += a
            t["emitted"] += len(toks)
            for i in range(len(drafts)):
                t["drafted_at"][i] += 1
                t["accepted_at"][i] += i < a
            req.num_computed += a + 1
            if a < len(drafts) and slots:
                self.state.copy([(slots[a], req.state_slot)])
            for tok in toks:
                outs.append(self._emit(req, tok, None, now))
                if req.status == Status.FINISHED:
                    break
            if req.status != Status.RUNNING:
                continue
            if self.prefix is not None:  # the kept tokens are in all_ids now: full pages enter the tree
                self._cache_pages(req)
                if slots and self.prefix.num_snap_slots and req.num_computed % self.kv.page_size == 0:
                    self._roll_snapshot(req)
            self._trim_pages(req, req.num_tokens)
        return outs

    def _roll_snapshot(self, req: Request) -> None:
        """A verify step that kept req's state at a page boundary: the rolling decode snapshot there (as a
        decode step's would be, copied now that the state is rolled back)."""
        k = req.num_computed // self.kv.page_size
        if len(req.nodes) < k:
            return
        if req.roll_node is not None:
            self.prefix.drop_snapshot(req.roll_node)
            req.roll_node = None
        slot = self.prefix.alloc_snapshot()
        self.state.copy([(req.state_slot, slot)])
        if self.prefix.attach_snapshot(req.nodes[k - 1], slot):
            req.roll_node = req.nodes[k - 1]

    def _trim_pages(self, req: Request, tokens: int) -> None:
        keep = self.kv.pages_for(tokens)
        if len(req.pages) > keep:  # pages past the kept tokens are the request's own (never in the tree)
            self.kv.pages.free(req.pages[keep:])
            del req.pages[keep:]

    def _draft(self, before: list[tuple[Request, int]], batch: ForwardBatch) -> None:
        """The MTP block after a step: over every position the step computed (its K/V, so later drafts attend
        to the whole sequence), then K drafts for each decoding request, one MTP pass per draft position."""
        dev, model = self.engine.device, self.engine.model
        hidden = model.hidden
        ids, pos, seqs, src, rows, drafters = [], [], [], [], [], []
        start = 0
        for (req, c0), s in zip(before, batch.seqs):
            c1 = req.num_computed
            if req.status != Status.RUNNING or c1 <= c0:
                continue
            L = c1 - c0
            ids += req.all_ids[c0 + 1:c1 + 1]  # the token after each position
            pos += range(c0, c1)
            src += range(s.start, s.start + L)
            seqs.append(SeqMeta(start=start, length=L, cached=c0, state_slot=req.state_slot,
                                kv_index=self.kv.flat_index(req.pages, 0, c1, dev)))
            if not req.in_prefill and self._can_draft(req):
                rows.append(start + L - 1)
                drafters.append(req)
            start += L
        if not seqs:
            return
        fill = ForwardBatch(input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
                            positions=torch.tensor(pos, dtype=torch.long, device=dev), seqs=seqs,
                            kv_write_index=torch.cat([q.kv_index[q.cached:] for q in seqs]),
                            logits_index=torch.tensor(rows, dtype=torch.long, device=dev))
        logits = self.engine.draft(fill, hidden[torch.tensor(src, dtype=torch.long, device=dev)], 0)
        for req, tok in zip(drafters, torch.argmax(logits, dim=-1).tolist()):
            req.drafts = [tok]
        for step in range(1, self.spec_k):
            live = [(r, row) for r, row in zip(drafters, rows) if self._page_for(r, r.num_computed - 1 + step)]
            if not live:
                return
            prev = model.hidden  # the block's own output at each request's last row: its next input
            ps = [r.num_computed - 1 + step for r, _ in live]
            seqs = [SeqMeta(start=i, length=1, cached=p, state_slot=r.state_slot,
                            kv_index=self.kv.flat_index(r.pages, 0, p + 1, dev))
                    for i, ((r, _), p) in enumerate(zip(live, ps))]
            ids = torch.tensor([r.drafts[-1] for r, _ in live], dtype=torch.long, device=dev)
            nxt = ForwardBatch(input_ids=ids, positions=torch.tensor(ps, dtype=torch.long, device=dev), seqs=seqs,
                               kv_write_index=torch.cat([q.kv_index[-1:] for q in seqs]),
                               logits_index=torch.arange(len(live), dtype=torch.long, device=dev))
            src = torch.tensor([row for _, row in live], dtype=torch.long, device=dev)
            logits = self.engine.draft(nxt, prev[src], step)
            for (r, _), tok in zip(live, torch.argmax(logits, dim=-1).tolist()):
                r.drafts.append(tok)
            drafters, rows = [r for r, _ in live], list(range(len(live)))

    def _page_for(self, req: Request, position: int) -> bool:
        """req owns the page of `position`, taking a free one if needed (never evicting or preempting: a
        draft is not worth it)."""
        need = position // self.kv.page_size + 1 - len(req.pages)
        if need <= 0:
            return True
        got = self.kv.pages.alloc(need)
        if got is None:
            return False
        req.pages += got
        return True

    def _adopt_children(self, sample_reqs: list[Request], logits: torch.Tensor):
        """Parents that just finished their prefill hand it to their held children: each child gets its own
        pages and state slot, copies of the parent's prompt K/V and linear state, and samples its first
        token from the parent's logits row. A child that finds no room is queued and prefills itself."""
        extra, rows = [], []
        for i, parent in enumerate(sample_reqs):
            kids = self.held.pop(parent.id, None) if not parent.output_ids else None
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
                self._copy_caches(parent, kid, n)
                kid.num_computed = n
                extra.append(kid)
                rows.append(i)
        if not extra:
            return sample_reqs, logits
        idx = torch.tensor(list(range(len(sample_reqs))) + rows, dtype=torch.long, device=logits.device)
        return sample_reqs + extra, logits[idx]

    def _copy_caches(self, src: Request, dst: Request, n: int) -> None:
        dev = self.engine.device
        a = self.kv.flat_index(src.pages, 0, n, dev)
        b = self.kv.flat_index(dst.pages, 0, n, dev)
        if self.kv.k is not None:
            self.kv.k[:, b] = self.kv.k[:, a]
            self.kv.v[:, b] = self.kv.v[:, a]
        st = self.state
        if st.conv is not None:
            st.conv[:, dst.state_slot] = st.conv[:, src.state_slot]
            st.rec[:, dst.state_slot] = st.rec[:, src.state_slot]

    def _release_children(self, req: Request) -> None:
        """A parent that ends before its prefill did: its children prefill themselves."""
        for kid in self.held.pop(req.id, []):
            if kid.status != Status.FINISHED:
                self.waiting.append(kid)

    def _process_row(self, req: Request, row: torch.Tensor) -> None:
        p = req.params
        if p.needs_processing:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos)
            apply_penalties(row, p, req.prompt_ids, req.output_ids, stops)
        if req.matcher is not None and not req.thinking and not req.matcher.done:
            apply_bitmask(row, req.matcher.allowed())

    def _track(self, req: Request, tok: int) -> None:
        """Reasoning-block bookkeeping and the grammar's state after `tok` was appended."""
        if req.thinking:
            if tok == self.think_end:
                req.thinking = False  # the block ended (by the model, or by the forced close)
                if req.matcher is not None:
                    req.matcher.prefetch()
            else:
                req.thinking_tokens += 1
            return
        if req.matcher is not None and not req.matcher.done:
            req.matcher.consume(tok)
        elif tok == self.think_start and self.think_start is not None and req.matcher is None:
            req.thinking = True

    def _logprobs(self, raw: torch.Tensor, reqs: list[Request], tokens: list[int]) -> dict[int, tuple]:
        idx = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if not idx:
            return {}
        rows = raw[torch.tensor(idx, dtype=torch.long, device=raw.device)]
        got = logprobs_of(rows, [tokens[i] for i in idx], [reqs[i].params.logprobs for i in idx])
        return dict(zip(idx, got))

    def _prompt_logprobs(self, logits: torch.Tensor, prompt_rows: list[tuple[Request, int, int]]) -> None:
        rows = logits[torch.tensor([r for _, _, r in prompt_rows], dtype=torch.long, device=logits.device)]
        got = logprobs_of(rows, [req.prompt_ids[k] for req, k, _ in prompt_rows],
                          [req.params.prompt_logprobs for req, _, _ in prompt_rows])
        for (req, k, _), lp in zip(prompt_rows, got):
            if k == len(req.prompt_lps):
                req.prompt_lps.append(lp)

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
